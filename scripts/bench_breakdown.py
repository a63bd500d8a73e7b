"""Where a bench run's time went, turn by turn, from its results.json (no GPU needed):

* prefill: the median prefill of each policy by the turn's new tokens (buckets), against the
  first policy named (`--ours`, default ostinato), over the turns both replayed;
* decode: each policy's CPU-branch compute per decode step and per cold route (the graph
  handshake's counters, median over turns);
* host reads after tool outputs: the experts each policy read from host memory in a tool turn's
  prefill (computed on the CPU or uploaded: each is read once from host memory either way), median
  over the tool turns all policies replayed, the ratio to the first policy's, and the rate the
  prefill read them at, and (where the run probed the host's read bandwidth) the prefill against the
  floor of those bytes at the probe's rate. Where a pass touches most cold experts, TTFT follows
  these bytes (GB from the run's expert bytes);
* `--upload-path RES.json`: the planner's decision on the upload path (planner/pipeline.py
  plan_upload_path) for the run's plan and calibration (RES.json: a residency with its
  calibration, e.g. phase calib's res-cap.json), with the held-out turns' new tokens standing
  in for the development prompt sizes where the profile has none.

    python scripts/bench_breakdown.py results/2026-12-02-h200-s15/bench \
        --upload-path results/2026-12-02-h200-s15/bench/res-cap.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ostinato.bench.metrics import median

BUCKETS = ((0, 128), (128, 512), (512, 2048), (2048, None))


def _key(t: dict) -> tuple:
    return t["session"], t["turn"]


def prefill_by_size(turns: dict, ours: str) -> list[str]:
    mine = {_key(t): t for t in turns[ours] if not t.get("error")}
    others = [n for n in turns if n != ours]
    lines = [f"median prefill ms by new tokens ({ours} first; ratio {ours} / policy over the same turns)"]
    for lo, hi in BUCKETS:
        keys = [k for k, t in mine.items() if t["new_tokens"] >= lo and (hi is None or t["new_tokens"] < hi)]
        if not keys:
            continue
        first = 1e3 * median([mine[k]["prefill_s"] for k in keys])
        row = [f"  {lo}-{hi - 1 if hi else ''} ({len(keys)} turns): {ours} {first:.0f}"]
        for n in others:
            theirs = {_key(t): t for t in turns[n] if not t.get("error")}
            both = [k for k in keys if k in theirs]
            ratio = median([mine[k]["prefill_s"] / theirs[k]["prefill_s"] for k in both])
            row.append(f"{n} {1e3 * median([theirs[k]['prefill_s'] for k in both]):.0f} ({ratio:.2f})")
        lines.append(", ".join(row))
    return lines


def decode_cpu(turns: dict) -> list[str]:
    lines = ["CPU branch in decode (median over turns): us per step, us per cold route"]
    for n, ts in turns.items():
        steps = [t["placement"]["decode"] for t in ts
                 if (t.get("placement") or {}).get("decode", {}).get("graph_steps")]
        if not steps:
            lines.append(f"  {n}: no graph handshake counters")
            continue
        per_step = median([d["graph_compute_ns"] / d["graph_steps"] / 1e3 for d in steps])
        per_route = median([d["graph_compute_ns"] / d["graph_cold_routes"] / 1e3 for d in steps
                            if d["graph_cold_routes"]])
        lines.append(f"  {n}: {per_step:.0f} us a step, {per_route:.1f} us a cold route")
    return lines


def host_reads(turns: dict, ours: str, expert_mb: float | None, probes: dict | None = None) -> list[str]:
    """probes: policy -> its host read probe (results.json's host_read_gbps), for the floor of a
    tool turn's prefill: its host bytes at the probe's rate (mean of before and after)."""
    tool = {n: {_key(t): t for t in ts if t.get("kind") == "tool" and not t.get("error")} for n, ts in turns.items()}
    keys = sorted(set.intersection(*(set(v) for v in tool.values()))) if tool else []
    if not keys:
        return ["host expert reads after tool outputs: no tool turn that every policy replayed"]

    def reads(t: dict) -> int:
        p = t["placement"]["prefill"]
        return p.get("cpu_experts", 0) + p.get("uploaded_experts", 0)

    lines = [f"host expert reads in a tool turn's prefill (median over {len(keys)} tool turns; ratio {ours} / policy)"]
    for n, ts in tool.items():
        row = f"  {n}: {median([reads(ts[k]) for k in keys]):.0f} experts"
        if expert_mb:
            gbps = median([reads(ts[k]) * expert_mb / 1e3 / ts[k]["prefill_s"] for k in keys])
            row += f" ({median([reads(ts[k]) for k in keys]) * expert_mb / 1e3:.1f} GB, read at {gbps:.0f} GB/s"
            probe = (probes or {}).get(n)
            if probe:
                rate = (probe["before"] + probe["after"]) / 2
                floor = median([ts[k]["prefill_s"] / (reads(ts[k]) * expert_mb / 1e3 / rate) for k in keys])
                row += f"; {floor:.2f}x the floor of its bytes at the probe's {rate:.0f} GB/s"
            row += ")"
        if n != ours:
            row += f", reads ratio {median([reads(tool[ours][k]) / reads(ts[k]) for k in keys]):.2f}, TTFT ratio " \
                   f"{median([tool[ours][k]['prefill_s'] / ts[k]['prefill_s'] for k in keys]):.2f}"
        lines.append(row)
    return lines


def upload_path(folder: Path, res_file: str, turns: dict, ours: str) -> list[str]:
    import torch

    from ostinato.config import ModelConfig
    from ostinato.engine.residency import Residency
    from ostinato.engine.routes import RouteCounts
    from ostinato.engine.sizes import expert_sizes
    from ostinato.planner.pipeline import plan_upload_path, upload_path_text
    from ostinato.synth.presets import preset_config
    from ostinato.synth.source import parse_synth

    result = json.loads((folder / "results.json").read_text())
    model = result["model"]
    if not model.startswith("synth:"):
        raise SystemExit(f"{model}: --upload-path reads the config of a synthetic preset only")
    preset, opts = parse_synth(model)
    cfg = ModelConfig.from_dict(preset_config(preset, opts.get("layers")))
    planned = Residency.load(res_file)
    res = Residency.load(folder / "residency.json").upload_plan()
    res.calibration = {k: v for k, v in planned.calibration.items() if k != "upload_path"}
    prof = RouteCounts.load(folder / "profile-dev.json")
    note = ""
    if prof.prompts is None:
        prof.prompts = [t["new_tokens"] for t in turns[ours] if not t.get("error")]
        note = f" (development prompt sizes: the {len(prof.prompts)} held-out turns' new tokens)"
    sizes = expert_sizes(cfg, getattr(torch, result["dtype"]), {l: None for l in cfg.moe_layers})
    out = plan_upload_path(res, res.calibration, prof, prof.total("all"), sizes, cfg.num_experts_per_tok,
                           2048, limit=result["budget"]["bytes"])
    return [f"upload path{note}: {upload_path_text(out.calibration['upload_path'])}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a bench --out folder (results.json with its turns)")
    p.add_argument("--ours", default="ostinato")
    p.add_argument("--upload-path", metavar="RES.json", help="also the planner's upload-path decision")
    a = p.parse_args()
    folder = Path(a.folder)
    result = json.loads((folder / "results.json").read_text())
    turns = result["turns"]
    if a.ours not in turns:
        raise SystemExit(f"{folder}: no turns of {a.ours} (policies: {', '.join(turns)})")
    expert_mb = (result.get("budget") or {}).get("expert_bytes", 0) / 1e6 or None
    probes = {n: e["host_read_gbps"] for n, e in result["policies"].items() if e.get("host_read_gbps")}
    lines = prefill_by_size(turns, a.ours) + decode_cpu(turns) + host_reads(turns, a.ours, expert_mb, probes)
    if a.upload_path:
        lines += upload_path(folder, a.upload_path, turns, a.ours)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
