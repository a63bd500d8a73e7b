"""The benchmark's outputs: the environment record, comparisons against every baseline,
the human table, report.md and results.json (BENCHMARK.md, "How a benchmark run reports").

results.json holds everything, raw turns included; the JSON line a run prints last is the
same document without the raw turns.
"""
from __future__ import annotations

import dataclasses

import json
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import torch

from ostinato.bench.metrics import paired_intervals, slope, ttft_by_size, wins
from ostinato.engine.graph import env_pass_midpoints, pass_sizes
from ostinato.layers.moe.cpu_experts import default_amx_int8_min_tokens, default_amx_quant_min_tokens
from ostinato.layers.moe.gpu_quant import QUANT_QTYPES, quant_tuning_source
from ostinato.layers.moe.hybrid import defer_combine
from ostinato.layers.moe.staging import (describe, env_prefetch, env_prefetch_from, env_prefetch_full_from,
                                         env_prefetch_programs, env_stage_from, env_stage_programs, env_stage_routes)
from ostinato.policies.settings import ABLATION, OSTINATO_STEPS
from ostinato.planner.calibrate import cpu_model
from ostinato.planner.pipeline import fill_text

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def source_state() -> dict:
    """The commit this code came from and whether it had uncommitted changes: OSTINATO_COMMIT
    and OSTINATO_DIRTY where set (the GPU machine's copy of the tree, whose .git, if any, is
    not the sender's: scripts/device/ are given them), else git."""
    if os.environ.get("OSTINATO_COMMIT"):  # first: a copied tree may carry a stale .git
        dirty = os.environ.get("OSTINATO_DIRTY")
        return {"commit": os.environ["OSTINATO_COMMIT"], "dirty": None if dirty is None else dirty not in ("0", "")}
    commit = _git("rev-parse", "HEAD")
    return {"commit": commit, "dirty": bool(_git("status", "--porcelain")) if commit else None}


def hardware() -> dict:
    from ostinato.threads import Topology

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"gpu": gpu, "gpu_memory": torch.cuda.get_device_properties(0).total_memory if gpu else None,
            "cpu": cpu_model(), "logical_cpus": os.cpu_count(), "physical_cores": len(Topology.read().cores()),
            "torch": torch.__version__}


# /proc/vmstat's counters of the kernel reclaiming, compacting or faulting memory: what else a replay's host did
VMSTAT_KEYS = ("pgmajfault", "pgscan_kswapd", "pgscan_direct", "compact_stall", "thp_collapse_alloc", "pswpin",
               "pswpout")


def host_counters() -> dict[str, int]:
    """The host's CPU time by state (jiffies of /proc/stat's cpu line: busy, iowait, steal, total) and
    VMSTAT_KEYS, now; {} where /proc is not Linux's. Two reads' difference (host_counter_delta) tells what
    a replay's host spent besides the engine: the hypervisor's steal, reclaim, compaction (session 55's
    disturbed runs had no such record)."""
    try:
        with open("/proc/stat") as f:
            cpu = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/vmstat") as f:
            vm = dict(line.split() for line in f)
    except (OSError, ValueError):
        return {}
    idle, iowait, steal = cpu[3], cpu[4], cpu[7] if len(cpu) > 7 else 0
    total = sum(cpu[:8])
    return {"total": total, "busy": total - idle - iowait - steal, "iowait": iowait, "steal": steal,
            **{k: int(vm[k]) for k in VMSTAT_KEYS if k in vm}}


def host_counter_delta(before: dict, after: dict) -> dict:
    """after - before of host_counters, the CPU states as shares of the CPU time between them ({} without
    both reads)."""
    if not before or not after:
        return {}
    d = {k: after[k] - before[k] for k in before if k in after}
    total = d.pop("total", 0)
    for k in ("busy", "iowait", "steal"):
        d[k] = round(d[k] / total, 4) if total > 0 else None
    return d


def environment(loaded, bs) -> dict:
    return {**source_state(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "hardware": hardware(),
            "model": bs.model, "device": str(loaded.runner.device), "dtype": str(loaded.runner.dtype).replace(
                "torch.", ""), "max_context": loaded.engine.max_context, "cap": bs.gpu_memory,
            "threads": loaded.runner.threads.as_dict(), "amx_quant_min_tokens": default_amx_quant_min_tokens(),
            "amx_int8_min_tokens": default_amx_int8_min_tokens(),
            "amx_int8_min_tokens_mxfp4": default_amx_int8_min_tokens("MXFP4"),
            "defer_combine": defer_combine() and loaded.runner.device.type == "cuda",  # it defers on CUDA only
            "pass_graphs": loaded.runner.pass_graph_rows() if loaded.runner.device.type == "cuda" else 0,
            "stage_routes": env_stage_routes() if loaded.runner.device.type == "cuda" else 0,
            "stage_from": env_stage_from(),  # None: the rule's count (staging.stage_from)
            "stage_programs": env_stage_programs(),  # None: the default grid
            "quant_tuning": quant_tuning_source(loaded.runner.device) if loaded.runner.device.type == "cuda" else None,
            "prefetch": env_prefetch() if loaded.runner.device.type == "cuda" else 0,
            "prefetch_from": env_prefetch_from(),
            "prefetch_full_from": env_prefetch_full_from(),
            "prefetch_programs": env_prefetch_programs(),
            "pass_midpoints": env_pass_midpoints(),
            **routing_knobs(loaded.source)}


def routing_knobs(source) -> dict:
    """A synthetic model's routing regime as it ran (its knobs, the skew factor included, which
    a preset's measured factors can change later): {"routing": {...}}; {} for other models."""
    spec = getattr(source, "spec", None)
    r = getattr(spec, "regime", None)
    return {} if r is None else {"routing": {**dataclasses.asdict(r), "skew": spec.skew}}


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def comparisons(policies: dict, ours: str = "ostinato", np_: int | None = None, turns: dict | None = None,
                runs: dict | None = None) -> dict:
    """Ostinato against every baseline: speed-ups (baseline / ours for times), session wins, and
    the length-sweep slopes below Ostinato's Np (np_; default: each sweep's own). With the raw
    turns (policy -> records): 95% bootstrap intervals of the TPOT and total-time speed-ups over
    the turns both replayed (metrics.paired_intervals); with runs (provenance): whether the two
    were measured in one run, the only case where those intervals hold everything."""
    me = policies.get(ours, {}).get("summary")
    if me is None:
        return {}
    out = {}
    for name, entry in policies.items():
        s = entry.get("summary")
        if name == ours or s is None:
            continue
        won, both = wins(me["session_s"], s["session_s"])
        out[name] = {
            "tpot_speedup": _ratio(s["tpot_ms"]["median"], me["tpot_ms"]["median"]),
            "ttft_tool_ratio": _ratio(me["ttft_ms"]["median"]["tool"], s["ttft_ms"]["median"]["tool"]),
            "request_time_speedup": _ratio(s["request_s"]["total"], me["request_s"]["total"]),
            "sessions_won": [won, both],
            "slowest_session_speedup": slowest_session_speedup(me["session_s"], s["session_s"]),
            "sweep_slope_ratio": _ratio(entry_slope(policies[ours], np_), entry_slope(entry, np_)),
            "host_read_ratio": host_read_ratio(policies[ours], entry),
        }
        if turns and ours in turns and name in turns:
            out[name]["intervals"] = paired_intervals(turns[ours], turns[name])
            out[name]["ttft_tool_by_size"] = ttft_by_size(turns[ours], turns[name])
        if runs and ours in runs and name in runs:
            out[name]["same_run"] = runs[ours] == runs[name]
    return out


def slowest_session_speedup(ours: dict[str, float], theirs: dict[str, float]) -> float | None:
    """The smallest over the sessions both finished of theirs / ours (session totals, s): how much
    sooner the session Ostinato gains least on finished. None where they share no session."""
    both = [s for s in ours if s in theirs and ours[s] > 0]
    return min(round(theirs[s] / ours[s], 3) for s in both) if both else None


DRIFT = (0.95, 1.05)  # host read ratios of two compared replays outside these: a drift warning


def host_read_ratio(ours: dict, theirs: dict) -> float | None:
    """Ours over theirs of the host's read bandwidth, each the mean of the probes just before and
    after its replay (bench._run_policy): how far the machine drifted between the two. None where
    either has no probe (no CPU pool, another engine, a run from before the probe) or the two
    probes differ (a native read and a torch sum do not compare)."""
    a, b = ours.get("host_read_gbps"), theirs.get("host_read_gbps")
    if not a or not b or a["probe"] != b["probe"]:
        return None
    return _ratio(a["before"] + a["after"], b["before"] + b["after"])


def run_device(result: dict) -> str | None:
    """The device a bench ran on, named as a calibration names its own (planner/calibrate.py
    device_name); None where the result does not say."""
    hw = result.get("hardware") or {}
    if str(result.get("device", "")).startswith("cuda"):
        return hw.get("gpu")
    return f"cpu ({hw['cpu']})" if hw.get("cpu") else None


# how far the replay's host read (the mean of its probes before and after) may lie from the calibration's
# for the calibrated decode bound to be this machine's: the CPU experts' time in it is bytes over that read.
# One machine drifted 18-24% within a replay (session 51: 153.6 -> 116.8 GB/s against 130.1 calibrated);
# two machines of one kind differed by 38% (session 52: 172-188 against 130.1)
HOST_READ_SPREAD = 0.25


def same_host_read(cal: dict, read: dict | None) -> bool:
    """Whether a replay's host-read probes (policy entry's host_read_gbps) ran on the machine its calibration
    measured, as far as the read tells: the same probe, their mean within HOST_READ_SPREAD of the calibrated
    figure. True where either figure is missing (nothing to tell them apart)."""
    if not read or not cal.get("host_read_gbps") or read.get("probe") != cal.get("host_read_probe"):
        return True
    mean = (read["before"] + read["after"]) / 2
    return abs(mean / cal["host_read_gbps"] - 1) <= HOST_READ_SPREAD


def targets(result: dict, ours: str = "ostinato") -> list[dict]:
    """BENCHMARK.md's targets, each with the measured value and whether it is met (None: not
    measured in this run). Baselines over the budget (the `gpu` upper bound) are left out."""
    pol, comp = result["policies"], result.get("comparisons", {})
    me = pol.get(ours, {}).get("summary")
    if me is None:
        return []
    base = {n: c for n, c in comp.items()
            if not pol[n].get("over_budget") and not pol[n].get("external") and n not in OSTINATO_STEPS}
    rows = []

    def add(what, target, value, met):
        rows.append({"what": what, "target": target, "measured": value, "met": met})

    def at_least(name, key, x):
        v = (base.get(name) or {}).get(key)
        return v, None if v is None else v >= x

    def at_most(name, key, x):
        v = (base.get(name) or {}).get(key)
        return v, None if v is None else v <= x

    bound = (result["np"].get("predicted") or {}).get("decode_bound_ms")
    cal = result["np"].get("calibration") or {}
    if pol[ours].get("decode_graph") and cal.get("decode_mode") != "graph":
        bound = None  # a host-driven calibration's dense part is not what a graph step pays: no bound
    here = run_device(result)
    if here is not None and cal.get("device") and cal["device"] != here:
        bound = None  # modelled on another device's constants (sessions 36-39 replayed an H200's on H100s)
    if not same_host_read(cal, pol[ours].get("host_read_gbps")):
        bound = None  # another machine of the kind (session 52: calibrated at 130 GB/s, replayed at 172-188)
    over = _ratio(me["tpot_ms"]["median"], bound)
    add("decode TPOT vs its bound (x)", "<= 1.15", over, None if over is None else over <= 1.15)
    add("decode TPOT speed-up vs graph-decoded layers (x)", ">= 1.5", *at_least("layers", "tpot_speedup", 1.5))
    add("decode TPOT speed-up vs graph-decoded per-layer frequency (x)", ">= 1.0 (1.1 under heterogeneous "
        "routing)", *at_least("fixed-per-layer", "tpot_speedup", 1.0))
    kt = base.get("ktransformers") or {}
    kt_x = kt.get("request_time_speedup")  # None where no turn of both was replayed: nothing measured
    add("total request time speed-up vs ktransformers (x), every session sooner", ">= 1.0, all", kt_x,
        None if kt_x is None else kt_x >= 1.0 and kt["sessions_won"][0] == kt["sessions_won"][1])
    caches = [base[n]["tpot_speedup"] for n in ("expert-cache", "decaying-cache")
              if (base.get(n) or {}).get("tpot_speedup") is not None]
    add("decode TPOT speed-up vs the faster cache (x)", ">= 1.3", min(caches) if caches else None,
        min(caches) >= 1.3 if caches else None)
    add("median TTFT after tool outputs vs expert-cache (ours/theirs)", "<= 0.45",
        *at_most("expert-cache", "ttft_tool_ratio", 0.45))
    add("median TTFT after tool outputs vs layers (ours/theirs)", "<= 0.6", *at_most("layers", "ttft_tool_ratio", 0.6))
    add("length-sweep TTFT slope below Np vs expert-cache (ours/theirs)", "<= 0.4",
        *at_most("expert-cache", "sweep_slope_ratio", 0.4))
    won = [tuple(c["sessions_won"]) for c in base.values() if c["sessions_won"][1]]  # 0/0: none compared
    add("held-out sessions sooner than under every baseline", "all",
        f"{min(w for w, _ in won)}/{won[0][1]}" if won else None, all(w == n for w, n in won) if won else None)
    speedups = [c["request_time_speedup"] for c in base.values() if c.get("request_time_speedup") is not None]
    add("total request time speed-up vs the best baseline (x)", ">= 1.3", min(speedups) if speedups else None,
        min(speedups) >= 1.3 if speedups else None)
    llama = comp.get(LLAMA) or {}
    add("median TTFT after tool outputs vs llama.cpp (ours/theirs)", "<= 0.5", llama.get("ttft_tool_ratio"),
        None if llama.get("ttft_tool_ratio") is None else llama["ttft_tool_ratio"] <= 0.5)
    add("total request time speed-up vs llama.cpp (x)", ">= 1.5", llama.get("request_time_speedup"),
        None if llama.get("request_time_speedup") is None else llama["request_time_speedup"] >= 1.5)
    slowest = llama.get("slowest_session_speedup")
    add("every held-out session's total time speed-up vs llama.cpp, the smallest (x)", ">= 1.5", slowest,
        None if slowest is None else slowest >= 1.5)
    return rows


def ablation_rows(result: dict) -> list[list[str]]:
    """BENCHMARK.md's ablation, the steps this run measured: [step, policy, TTFT after tool ms,
    TPOT ms, total s]."""
    pol = result["policies"]
    rows = []
    for name, step in ABLATION:
        s = (pol.get(name) or {}).get("summary")
        np_ = result.get("np") or {}
        if name == "ostinato" and np_.get("value") is None and np_.get("upload_path"):
            step = "Ostinato: the planner dropped its upload path (its bytes hold hot experts)"
        if s is not None:
            rows.append([step, name, _f(s["ttft_ms"]["median"]["tool"]), _f(s["tpot_ms"]["median"], "{:.2f}"),
                         _f(s["request_s"]["total"], "{:.2f}")])
    return rows


LLAMA = "llama.cpp"  # the engine name `ostinato report --engine` gives llama-server's replay


def add_external(result: dict, turns: dict, name: str, replay: dict, source: str) -> None:
    """Another engine replayed over HTTP on the same held-out turns (`ostinato replay --endpoint`;
    its last JSON line is `replay`) as a row of this bench: compared like a policy (its turn records,
    where the replay kept them, go into `turns`, the raw turns per policy), kept out of the policy
    targets, and checked to have replayed the same sessions and turns."""
    from ostinato.config import ConfigError

    s = replay.get("summary") or {}
    if replay.get("kind") != "ostinato.replay" or not {"session_s", "turns", "tpot_ms"} <= set(s):
        raise ConfigError(f"{source}: not the JSON line of `ostinato replay`")
    ours = (result["policies"].get("ostinato") or {}).get("summary")
    if ours is not None and (set(s["session_s"]) != set(ours["session_s"]) or s["turns"] != ours["turns"]):
        raise ConfigError(f"{source}: replayed {s['turns']} turns of {sorted(s['session_s'])}, this bench "
                          f"{ours['turns']} of {sorted(ours['session_s'])}: not the same turns")
    result["policies"][name] = {"summary": s, "external": {"engine": replay.get("engine"), "file": source,
                                                           "settings": replay.get("settings"),
                                                           "gpu_mib": replay.get("gpu_mib_after_replay"),
                                                           "commit": replay.get("commit"), "date": replay.get("date")}}
    if replay.get("turns"):
        turns[name] = replay["turns"]


def external_line(name: str, e: dict, cap: int | None) -> str:
    """The settings line of an engine replayed over HTTP (add_external): its replay file, commit, and GPU
    memory after the replay, flagged where it exceeds the bench's cap (bytes)."""
    x, mib = e["external"], ""
    if x.get("gpu_mib") is not None:
        over = f", **over the cap of {cap / 2**20:.0f} MiB**" if cap and x["gpu_mib"] * 2**20 > cap else ""
        mib = f"; {x['gpu_mib']} MiB by nvidia-smi after the replay{over}"
    when = f" at `{x['commit'][:7]}` ({x.get('date')})" if x.get("commit") else " (its replay names no commit)"
    return (f"- {name}: another engine, replayed over HTTP on the same turns ({x['engine']}; `{x['file']}`{when}{mib}): "
            "max_tokens = the recorded length, end of sequence ignored; " + _held_text(e["summary"].get("outputs_held")))


def _held_text(held: dict | None) -> str:
    """What the replay did about the recorded answers the engine did not generate (HttpTarget.hold_output)."""
    if not held:
        return ("its cache held its own answers, not the recorded ones, so each next turn prefilled the recorded "
                "answer again: up to --max-output tokens a turn more than Ostinato's, inside its TTFT")
    failed = f", {held['failed']} failed" if held.get("failed") else ""
    return (f"its cache made to hold each recorded answer between turns, untimed ({held['turns']} turns, "
            f"{held['tokens']} tokens{failed})")


def entry_slope(entry: dict, np_: int | None = None):
    """A policy's length-sweep TTFT slope (ms per new token) below np_, from its sweep points
    (a baseline merged from a run with another Np gets the slope below this run's), or the
    slope below the Np of its own run."""
    sw = entry.get("sweep") or {}
    if np_ is None:
        return sw.get("slope_below_np_ms_per_token")
    return slope([(p["new_tokens"], p["ttft_ms"] / 1000) for p in sw.get("points", [])
                  if p.get("ttft_ms") is not None and p["new_tokens"] < np_])


def provenance(result: dict) -> dict[str, tuple[str, str]]:
    """policy -> (commit, date) of the run that measured it, through the --merge records (each
    names the policies it kept from the run before, so a record's own are those its
    predecessor did not hold). Another engine's row (add_external) is its replay's own."""
    src = result.get("merged_from") or []
    kept = set(src[-1]["policies"]) if src else set()
    out = {n: (e["external"].get("commit"), e["external"].get("date")) for n, e in result["policies"].items()
           if "external" in e}
    out.update({n: (result.get("commit"), result.get("date")) for n in result["policies"] if n not in kept | set(out)})
    for k in range(len(src) - 1, -1, -1):
        inherited = set(src[k - 1]["policies"]) if k else set()
        for n in src[k]["policies"]:
            if n not in inherited and n not in out:
                out[n] = (src[k]["commit"], src[k]["date"])
    return out


def _merged_note(result: dict) -> list[str]:
    runs: dict[tuple, list[str]] = {}
    for name, run in provenance(result).items():
        if "external" not in result["policies"][name]:  # another engine's row names its run itself
            runs.setdefault(run, []).append(name)
    if len(runs) < 2:
        return []
    return ["- measured over several runs (`--merge`): " + "; ".join(
        f"{', '.join(names)} at `{(commit or '?')[:7]}` ({date})" for (commit, date), names in runs.items())]


def _interval(iv) -> str:
    return "" if not iv else f" ({iv[0]:.2f}-{iv[1]:.2f})"


def _f(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


TABLE_COLUMNS = ("policy", "TTFT tool ms", "TPOT ms", "total s", "cold/tok", "CPU exp/tok", "uploaded MiB",
                 "resident", "Ostinato wins")


def table_rows(result: dict) -> list[list[str]]:
    rows = []
    comp = result.get("comparisons", {})
    for name, e in result["policies"].items():
        if "summary" not in e:
            rows.append([name, "skipped: " + e.get("skipped", "?")[:60]] + [""] * (len(TABLE_COLUMNS) - 2))
            continue
        s = e["summary"]
        pl = s["placement"].get("decode", {})
        up = s["placement"].get("all", {}).get("bytes_uploaded", 0)
        label = name + (" (over budget)" if e.get("over_budget") else "") + (" (HTTP)" if e.get("external") else "")
        w = comp.get(name, {}).get("sessions_won")
        rows.append([label, _f(s["ttft_ms"]["median"]["tool"]), _f(s["tpot_ms"]["median"], "{:.2f}"),
                     _f(s["request_s"]["total"], "{:.2f}"), _f(pl.get("cold_routes_per_token_layer"), "{:.2f}"),
                     _f(pl.get("cpu_experts_per_token_layer"), "{:.2f}"),
                     _f(up / 2**20), str(e.get("resident_experts", "")),
                     "" if w is None else f"{w[0]}/{w[1]}"])
    return rows


def format_table(result: dict) -> str:
    rows = [list(TABLE_COLUMNS)] + table_rows(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE_COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(result: dict, plots: list[str]) -> str:
    hw = result["hardware"]
    b = result["budget"]
    lines = [f"# Ostinato replay benchmark, {result['date']}", "",
             f"- commit `{result['commit']}`{' (dirty)' if result['dirty'] else ''}; model `{result['model']}` on "
             f"{result['device']} ({result['dtype']}); GPU {hw['gpu'] or 'none'}; CPU {hw['cpu']} "
             f"({hw['physical_cores']} cores)",
             f"- budget: {b['pool_slots']} expert-sized pool slots for every policy ({b['sized_by']}; cap "
             f"{_gib(result['cap'])}); Ostinato keeps {b['hot']} of {b['total_experts']} experts resident "
             f"({100 * b['fraction']:.1f}%)",
             f"- sessions: {result['split']['development']} development, {result['split']['held_out']} held-out "
             f"(`{result['split']['sessions']}`, at most {result['split']['max_turns'] or 'all'} turns each"
             + (f", at most {result['split']['max_output']} recorded output tokens a turn"
                if result['split'].get('max_output') else "") + ")",
             f"- skew: the top {100 * result['skew']['top_fraction']:.1f}% of experts by development routes "
             f"receive {100 * result['skew']['held_out_all_share']:.1f}% of held-out routes "
             f"(decode {100 * result['skew']['held_out_decode_share']:.1f}%, prefill "
             f"{100 * result['skew']['held_out_prefill_share']:.1f}%){routing_note(result['skew'])}",
             *([f"- Ostinato's fill {fill_text(result['np']['fill'])}"] if "fill" in result["np"] else []),
             f"- {_np_text(result['np'])}{_predicted(result)}", *_cpu_note(result),
             *_merged_note(result), "",
             "## Held-out sessions", "",
             "Medians per turn (TTFT after tool outputs, TPOT); total request time of all turns; cold routes "
             "(not served from the pool) and CPU experts per decoded token and MoE layer; bytes uploaded in "
             "all passes; experts resident or cached; held-out sessions Ostinato finished sooner than this "
             "policy.", ""]
    rows = table_rows(result)
    lines.append("| " + " | ".join(TABLE_COLUMNS) + " |")
    lines.append("|" + "---|" * len(TABLE_COLUMNS))
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += host_read_lines(result) + round_lines(result) + compile_lines(result)
    lines += ["", "## Settings and tuning", ""]
    rounds = max((e.get("rounds", 1) for e in result["policies"].values()), default=1)
    if rounds > 1:
        lines.append(f"- replayed in {rounds} rounds: the held-out sessions in {rounds} slices, every policy built "
                     "and replayed on each in turn, the order reversed every other round (the machine's drift falls "
                     "on every policy alike); thresholds tuned in the first round")
    for name, e in result["policies"].items():
        if "skipped" in e:
            held = f" ({e['held_before_build_mib']} MiB held before its build)" if e.get("held_before_build_mib") else ""
            lines.append(f"- {name}: skipped{held}: {e['skipped']}")
        if "tuning" in e:
            t = e["tuning"]
            grid = ", ".join(f"{k}: {v:.2f} s" for k, v in t["offload_threshold"].items())
            lines.append(f"- {name}: offload threshold {t['chosen']} (development sessions: {grid})")
        elif "offload_threshold" in e:
            lines.append(f"- {name}: offload threshold {e['offload_threshold']}")
        if "graph_segments" in e:
            g = e["graph_segments"]
            lines.append(f"- {name}: decode steps replayed as graph segments cut at each MoE layer; per cut (timed "
                         f"steps, {g['timed_cuts']} cuts): {g['gap_ms_per_cut']:.3f} ms from a segment's end to the "
                         f"next one's inputs, {_f(g['sync_ms_per_cut'], '{:.3f}')} ms where the cut had nothing to "
                         f"upload or compute on the CPU ({g['sync_cuts']} cuts: the sync alone)")
        if "gpu_memory" in e:
            m = e["gpu_memory"]
            seen = "not listed by nvidia-smi" if m["process_mib"] is None else f"{m['process_mib']} MiB by nvidia-smi"
            held = f", {e['held_before_build_mib']} MiB held before its build" if "held_before_build_mib" in e else ""
            lines.append(f"- {name}: GPU memory after the replay {seen} (allocator peak {m['allocator_peak_mib']} MiB"
                         f"{held})")
        if "external" in e:
            lines.append(external_line(name, e, result.get("cap")))
    lines += ["", "## Length sweep", "", "Median TTFT (ms) after a fixed development prefix, by new prompt tokens.", ""]
    sizes = sorted({p["size"] for e in result["policies"].values() for p in (e.get("sweep") or {}).get("points", [])})
    if sizes:
        np_ = (result.get("np") or {}).get("value")
        below = f"below Np = {np_}" if np_ is not None else "all sizes: no Np"
        lines.append("| policy | " + " | ".join(map(str, sizes)) + f" | slope ms/token ({below}) |")
        lines.append("|" + "---|" * (len(sizes) + 2))
        for name, e in result["policies"].items():
            sw = e.get("sweep")
            if not sw:
                continue
            by = {p["size"]: p["ttft_ms"] for p in sw["points"]}
            lines.append(f"| {name} | " + " | ".join(_f(by.get(n)) for n in sizes) +
                         f" | {_f(entry_slope(e, np_), '{:.3f}')} |")
    if result.get("targets"):
        lines += ["", "## Targets (BENCHMARK.md)", "", "| what | target | measured | met |", "|---|---|---|---|"]
        for t in result["targets"]:
            met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
            v = t["measured"] if isinstance(t["measured"], str) else _f(t["measured"], "{:.3f}")
            lines.append(f"| {t['what']} | {t['target']} | {v} | {met} |")
    ablation = ablation_rows(result)
    if len(ablation) > 1:
        lines += ["", "## Ablation", "", "From nothing resident to the full design, each step under the same cap and "
                  "budget, every static placement decoding as one CUDA graph.", "",
                  "| step | policy | TTFT after tool ms | TPOT ms | total s |", "|---|---|---|---|---|"]
        lines += ["| " + " | ".join(r) + " |" for r in ablation]
    if result.get("comparisons"):
        lines += ["", "## Ostinato against each baseline", "",
                  "Speed-ups are the baseline's time over Ostinato's (above 1: Ostinato faster), with 95% bootstrap "
                  "intervals over the turns both replayed. Within one run they hold the spread between turns; "
                  "between runs (`--merge`) they cannot hold the machine's drift between them, which reached 10% "
                  "between calls on the H200 machine.", "",
                  "| baseline | TPOT speed-up | TTFT after tool (ours/theirs) | total time speed-up | sessions won | "
                  "slowest session's speed-up | measured |", "|---|---|---|---|---|---|---|"]
        for name, c in result["comparisons"].items():
            if name in OSTINATO_STEPS:  # Ostinato's own steps: in the ablation above
                continue
            won, both = c["sessions_won"]
            iv = c.get("intervals") or {}
            where = {True: "same run", False: "another run", None: ""}[c.get("same_run")]
            lines.append(f"| {name} | {_f(c['tpot_speedup'], '{:.2f}x')}{_interval(iv.get('tpot_speedup'))} | "
                         f"{_f(c['ttft_tool_ratio'], '{:.2f}')} | "
                         f"{_f(c['request_time_speedup'], '{:.2f}x')}{_interval(iv.get('request_time_speedup'))} | "
                         f"{won}/{both} | {_f(c.get('slowest_session_speedup'), '{:.2f}x')} | {where} |")
        lines += drift_warnings(result["comparisons"])
        lines += size_lines(result["comparisons"])
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def size_lines(comp: dict) -> list[str]:
    """TTFT after tool outputs against each baseline, turn by turn, by the turn's new tokens
    (metrics.ttft_by_size): where on the sizes each engine wins."""
    rows = [(name, r) for name, c in comp.items() if name not in OSTINATO_STEPS for r in c.get("ttft_tool_by_size") or []]
    if not rows:
        return []
    lines = ["", "## TTFT after tool outputs by new tokens", "",
             "The same turns of both replays, by Ostinato's new prompt tokens; ours over theirs turn by turn (below 1: "
             "Ostinato sooner).", "",
             "| baseline | new tokens | turns | Ostinato ms | baseline ms | ours / theirs: median (least-largest) |",
             "|---|---|---|---|---|---|"]
    for name, r in rows:
        lo, hi = r["new_tokens"]
        q = r["ratio"]
        lines.append(f"| {name} | {lo}-{hi} | {r['turns']} | {_f(r['ttft_ms'][0])} | {_f(r['ttft_ms'][1])} | "
                     f"{q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f}) |")
    return lines


def round_lines(result: dict) -> list[str]:
    """Each policy's figures round by round (bench --rounds), in the order the rounds ran."""
    rows = [(name, e["by_round"]) for name, e in result["policies"].items() if e.get("by_round")]
    if not rows:
        return []
    lines = ["", "Round by round (each round a slice of the held-out sessions; every policy replays the same "
             "slice in a round):", "", "| policy | round | sessions | TTFT tool ms | TPOT ms | total s | host read "
             "GB/s before / after |", "|---|---|---|---|---|---|---|"]
    for name, rounds in rows:
        for i, r in enumerate(rounds, 1):
            read = r.get("host_read_gbps")
            probe = f"{read['before']:.1f} / {read['after']:.1f}" if read else "-"
            lines.append(f"| {name} | {i} | {r['sessions']} | {_f(r['ttft_tool_ms'], '{:.1f}')} | "
                         f"{_f(r['tpot_ms'], '{:.2f}')} | {r['total_s']:.2f} | {probe} |")
    return lines


def host_read_lines(result: dict) -> list[str]:
    """The host read bandwidth around each policy's replay, for the policies that measured it."""
    rows = [(name, e["host_read_gbps"]) for name, e in result["policies"].items() if e.get("host_read_gbps")]
    if not rows:
        return []
    lines = ["", "Host-memory read bandwidth (GB/s) with each policy's CPU pool just before and just after its "
             "held-out replay, best of 3 reads of a buffer far larger than the caches (native: the pool's own "
             "workers, as its kernels read; torch-sum: a torch sum on its cores; the two probes' figures do not "
             "compare).", "",
             "| policy | probe | before | after | change |", "|---|---|---|---|---|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['probe']} | {r['before']:.1f} | {r['after']:.1f} | "
                     f"{_f(_ratio(r['after'] - r['before'], r['before']), '{:+.1%}')} |")
    return lines


def compile_lines(result: dict) -> list[str]:
    """The policies whose held-out replay compiled triton kernels (runner.placement_stats
    triton_compiles): the turns that met a compile paid for it, a cost of the warm-up, not of the
    policy."""
    rows = []
    for name, e in result["policies"].items():
        p = (e.get("summary") or {}).get("placement", {}).get("all", {})
        if p.get("triton_compiles"):
            rows.append(f"| {name} | {p['triton_compiles']:g} | {p.get('triton_compile_s', 0):.3f} |")
    if not rows:
        return []
    return ["", "Triton compiled kernels during these replays (the turns that met a compile include it; each "
            "turn's placement in results.json says which):", "", "| policy | compiles | seconds |",
            "|---|---|---|"] + rows


def drift_warnings(comp: dict) -> list[str]:
    """A line per comparison whose two replays ran at host read bandwidths further apart than DRIFT."""
    out = []
    for name, c in comp.items():
        r = c.get("host_read_ratio")
        if r is not None and not DRIFT[0] <= r <= DRIFT[1]:
            out.append(f"- **{name}**: host read bandwidth differed by {100 * abs(r - 1):.1f}% between the two "
                       "replays: the decode ratio is confounded by machine drift")
    return [""] + out if out else []


def routing_note(skew: dict) -> str:
    """The spread of the skew figure over the layers and the persistence of experts across
    tokens, where the run measured them (bench.routing_figures)."""
    text = ""
    if skew.get("layers"):
        lay = skew["layers"]
        text += (f"; per MoE layer {100 * lay['min_layer']:.1f}% to {100 * lay['max_layer']:.1f}% (median "
                 f"{100 * lay['median_layer']:.1f}%)")
    if skew.get("persistence"):
        per = skew["persistence"]
        text += (f"; consecutive tokens share {100 * per['overlap']:.1f}% of their top-k experts "
                 f"({100 * per['independent']:.1f}% for independent draws)")
    return text


def _cpu_note(result: dict) -> list[str]:
    amx = result.get("amx_quant_min_tokens")
    lines = [f"- CPU experts: quantized experts with at least {amx} routes of a pass on the AMX tiles, their rows "
             "decoded to bf16 (OSTINATO_AMX_QUANT)"] if amx else []
    groups = (result.get("budget") or {}).get("groups")  # the experts' formats, where the run recorded them

    def has(*qtypes) -> bool:
        return groups is None or any(q in g for g in groups for q in qtypes)

    for which, key in (("Q4_K / Q6_K", "amx_int8_min_tokens"), ("MXFP4", "amx_int8_min_tokens_mxfp4")):
        if result.get(key) and has(*which.split(" / ")):  # runs before session 48 put no MXFP4 on the tiles
            lines.append(f"- CPU experts: the {which} projections of quantized experts with at least {result[key]} "
                         "routes of a pass on the AMX int8 tiles (OSTINATO_AMX_INT8)")
    tuning = result.get("quant_tuning")
    if tuning and has(*QUANT_QTYPES):
        if tuning["file"]:
            at = f" at `{tuning['commit'][:7]}`" if tuning.get("commit") else " (its commit not recorded)"
            lines.append(f"- quantized GPU kernels: the tuning of {tuning['file']}, written {tuning.get('written')}{at}")
        else:
            lines.append("- quantized GPU kernels: the default configs (no tuned file for this GPU)")
    if result.get("defer_combine"):
        lines.append("- split passes that upload nothing join their CPU branch on the GPU stream, the host going on "
                     "(OSTINATO_DEFER_COMBINE, on unless 0)")
    if result.get("pass_graphs") and result.get("stage_routes"):
        which = describe(result["stage_routes"])
        lines.append(f"- prefill passes of up to {result['pass_graphs']} tokens replayed as CUDA graphs, padded to "
                     f"{_padded_to(result)} (OSTINATO_PASS_GRAPHS); each copies {which} into flex slots and computes "
                     "them on the GPU (OSTINATO_STAGE_ROUTES)")
        if result.get("stage_from"):
            lines.append(f"- only the passes of at least {result['stage_from']} rows stage (OSTINATO_STAGE_FROM)")
        if result.get("stage_programs"):
            lines.append(f"- a layer's own staging copies run on {result['stage_programs']} programs, not the default "
                         "grid (OSTINATO_STAGE_PROGRAMS)")
        if result.get("prefetch"):
            taken = {n for p in result.get("policies", {}).values() for n in p.get("prefetch_taken", [])}
            less = f" (the pools took {', '.join(map(str, sorted(taken)))}: a third of their flex slots at most)" \
                if taken - {result["prefetch"]} else ""
            full = result.get("prefetch_full_from")
            half = f" ({result['prefetch'] // 2} in a pass of fewer than {full} real rows)" if full else ""
            lines.append(f"- passes of at least {result['prefetch_from']} rows also copy each next layer's "
                         f"{result['prefetch']} cold experts of most routes in the passes before{half}, while the "
                         f"layer before it runs, on {result.get('prefetch_programs', 64)} programs (OSTINATO_PREFETCH, "
                         f"OSTINATO_PREFETCH_FROM, {'OSTINATO_PREFETCH_FULL_FROM, ' if full else ''}"
                         f"OSTINATO_PREFETCH_PROGRAMS){less}")
    elif result.get("pass_graphs"):
        lines.append(f"- prefill passes of up to {result['pass_graphs']} tokens that a policy runs split without "
                     f"uploads replayed as CUDA graphs, padded to {_padded_to(result)} (OSTINATO_PASS_GRAPHS)")
    for name, p in result.get("policies", {}).items():
        if str(p.get("cpu_backend", "native")).startswith("torch"):
            lines.append(f"- **{name}: its CPU experts ran on plain torch, not the native kernels**: "
                         f"{p['cpu_backend']}; its CPU branch's times do not measure the design")
    if not str(result["device"]).startswith("cpu"):
        return lines
    return lines + ["- no GPU: the \"GPU\" side ran on the CPU device through the same code, so the budget is logical "
                    "and the timings show the mechanics of each policy, not the speed of the design"]


def _padded_to(result: dict) -> str:
    """The captured pass sizes a run padded to (engine/graph.py pass_sizes)."""
    m = result.get("pass_midpoints")
    sizes = ", ".join(map(str, pass_sizes(result["pass_graphs"], midpoints=m or 0)))
    return f"{sizes} rows" + (f" (with the midpoints from {m} rows, OSTINATO_PASS_MIDPOINTS)" if m else "")


def _np_text(np_: dict) -> str:
    """"Np = 2048 (calibrated; ...)", or where the planner dropped the upload path, why (its gain
    and cost over the development sessions: planner/pipeline.py upload_path_text)."""
    if np_.get("value") is None and np_.get("upload_path"):
        return f"Np {np_['how']}"
    return f"Np = {np_['value']} ({np_['how']})"


def _predicted(result: dict) -> str:
    pred = (result["np"].get("predicted") or {}).get("decode_step_ms")
    ours = result["policies"].get("ostinato", {}).get("summary", {}).get("decode_step_ms", {}).get("median")
    gbps = (result["np"].get("calibration") or {}).get("upload_gbps")
    text = f"; measured upload {gbps:.1f} GB/s" if gbps else ""
    if pred is not None:
        text += f"; cost model: decode step {pred:.3f} ms predicted, {_f(ours, '{:.3f}')} ms measured (median)"
    return text


def _gib(v):
    return "none (logical budget)" if v is None else f"{v / 2**30:.1f} GiB"


DERIVED = ("comparisons", "targets", "files", "plot_error")  # what finish_result adds to a result


def load_results(folder: str | Path) -> tuple[dict, dict]:
    """A bench folder's results.json -> (the result as the run measured it, without what
    finish_result derives from it; the raw turns per policy)."""
    path = Path(folder) / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no results.json (the --out folder of `ostinato bench`)")
    result = json.loads(path.read_text())
    turns = result.pop("turns", {})
    for k in DERIVED:
        result.pop(k, None)
    return result, turns


def finish_result(result: dict, turns: dict, out: Path, with_plots: bool = True) -> dict:
    """Adds the comparisons, writes results.json, report.md and (with_plots) the plots;
    returns the result."""
    from ostinato.bench.plots import write_plots

    result["comparisons"] = comparisons(result["policies"], np_=(result.get("np") or {}).get("value"), turns=turns,
                                        runs=provenance(result))
    result["targets"] = targets(result)
    plots: list[str] = []
    try:
        if with_plots:
            plots = write_plots(result, turns, out)
    except Exception as e:  # noqa: BLE001 - a plot must never cost the measurements
        result["plot_error"] = f"{type(e).__name__}: {e}"
    result["files"] = {"report": str(out / "report.md"), "results": str(out / "results.json"),
                       "plots": [str(out / p) for p in plots]}
    (out / "results.json").write_text(json.dumps({**result, "turns": turns}, indent=1) + "\n")
    (out / "report.md").write_text(markdown(result, plots))
    return result
