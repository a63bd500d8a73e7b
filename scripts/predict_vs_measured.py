"""Cost model check: predicted against measured decode step of a residency (issue [C]).

Measure: load the engine with the residency under the cap, replay sessions (prompts
prefilled, the recorded outputs decoded token by token, each step timed with the device
synchronised), then count the routing of exactly the timed tokens in a second, untimed
pass. Predict: the cost model with the calibration (from --calibration, default the
residency's own) on that routing, with the dense part at the steps' mean context. With
--profile, also the prediction from a profile's decode counts (what `calibrate` prints).

    python scripts/predict_vs_measured.py --model synth:qwen3-30b-a3b --residency R \
        --calibration C --gpu-memory 32GiB --cpu-threads 16 --name plan-32g --json-out A.json
    python scripts/predict_vs_measured.py --compare A.json B.json    # table, saving, one JSON line

Legend: L MoE layers, K top-k.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def pick_sessions(spec: str, split: str, n: int):
    from ostinato.sessions.read import load_sessions, split_sessions
    from ostinato.sessions.read import spread

    sessions = load_sessions(spec)
    dev, held = split_sessions(sessions)
    chosen = {"dev": dev, "held-out": held, "all": sessions}[split] or sessions
    return spread(chosen, n)


def replay(runner, streams, max_steps: int, sync) -> tuple[list[float], list[list[bool]], list[int], float]:
    """Prefill prompt runs, decode output runs token by token; -> (step seconds, timed mask per
    stream, positions of the timed steps, cold routes counted by the engine during them)."""
    steps, masks, positions, cold = [], [], [], 0
    for st in streams:
        mask = [False] * len(st.ids)
        i = 0
        while i < len(st.ids) and len(steps) < max_steps:
            j = i
            while j < len(st.ids) and st.is_output[j] == st.is_output[i]:
                j += 1
            if not st.is_output[i] or i == 0:
                runner.forward(st.ids[i:j], i)
            else:
                for p in range(i, j):
                    if len(steps) >= max_steps:
                        break
                    before = runner.placement_stats().get("cold_routes", 0)  # graph steps count on the device
                    sync()
                    t0 = time.perf_counter()
                    runner.forward([st.ids[p]], p)
                    sync()
                    steps.append(time.perf_counter() - t0)
                    cold += runner.placement_stats().get("cold_routes", 0) - before
                    mask[p] = True
                    positions.append(p)
            i = j
        masks.append(mask)
    return steps, masks, positions, cold


def count_routes(loaded, streams, masks):
    """Decode counts of exactly the timed tokens (chunked passes, as `ostinato profile`)."""
    from ostinato.engine.routes import RouteCounts
    from ostinato.planner.profile import CountingExperts

    runner, cfg = loaded.runner, loaded.runner.config
    counts = RouteCounts.zeros(cfg.moe_layers, cfg.num_experts, device=runner.device)
    counter = CountingExperts(runner.experts, counts)
    chunk = runner.settings.prefill_chunk
    with runner.experts_swapped(counter):  # host-driven: a one-token chunk must not replay a graph
        for st, mask in zip(streams, masks):
            end = max((p for p, m in enumerate(mask) if m), default=-1) + 1
            for i in range(0, end, chunk):
                counter.is_output = torch.tensor(mask[i:min(i + chunk, end)], dtype=torch.bool, device=runner.device)
                runner.forward(st.ids[i:min(i + chunk, end)], i)
            counts.tokens["decode"] += sum(mask)
    counts.decode = {l: c.cpu() for l, c in counts.decode.items()}
    counts.prefill = {l: c.cpu() for l, c in counts.prefill.items()}
    return counts


def measure(a) -> dict:
    from ostinato.config import parse_bytes
    from ostinato.engine.placement import PlacementSettings
    from ostinato.engine.residency import Residency
    from ostinato.engine.routes import RouteCounts
    from ostinato.engine.runner import RunnerSettings
    from ostinato.load import load_engine
    from ostinato.planner import cost_model as cm
    from ostinato.planner.profile import session_stream

    res = Residency.load(a.residency)
    cal = Residency.load(a.calibration or a.residency).calibration
    if not cal:
        raise SystemExit(f"{a.calibration or a.residency} has no calibration: run `ostinato calibrate` first")
    cap = parse_bytes(a.gpu_memory) if a.gpu_memory else res.gpu_memory
    kv = a.max_context or res.capacity.get("kv_tokens") or 16384
    t0 = time.perf_counter()
    loaded = load_engine(a.model, RunnerSettings(max_context=kv, cpu_threads=a.cpu_threads),
                         PlacementSettings(residency=a.residency, gpu_memory=cap))
    load_s = time.perf_counter() - t0
    runner, cfg = loaded.runner, loaded.runner.config
    cuda = runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    streams = [session_stream(s, loaded.tokenizer, max_tokens=kv - 1)
               for s in pick_sessions(a.sessions, a.split, a.max_sessions)]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        steps, masks, positions, cold = replay(runner, streams, a.max_steps, sync)
        counts = count_routes(loaded, streams, masks)
    if not steps:
        raise SystemExit("no decode steps: the sessions have no recorded outputs")
    K, L = cfg.num_experts_per_tok, len(cfg.moe_layers)
    costs = cm.layer_costs(cal, cfg.moe_layers)
    context = statistics.fmean(positions)
    dense = cm.dense_ms(cal, context)
    pred = cm.predict_decode_step(counts.decode, counts.tokens["decode"], res.hot, costs, K, dense)
    ms = sorted(1e3 * s for s in steps[2:] or steps)
    trim = ms[: max(1, int(len(ms) * 0.98))]
    out = {
        "name": a.name, "residency": a.residency, "hot_experts": res.hot_count, "steps": len(ms),
        "mean_context": round(context, 1), "load_s": round(load_s, 1),
        "measured_ms_mean": round(statistics.fmean(ms), 3), "measured_ms_median": round(statistics.median(ms), 3),
        "measured_ms_trimmed": round(statistics.fmean(trim), 3),
        "measured_ms_p90": round(ms[int(0.9 * (len(ms) - 1))], 3),
        "predicted_ms": round(pred.total_ms, 3), "predicted_dense_ms": round(dense, 3),
        "predicted_moe_ms": round(pred.moe_ms, 3),
        "cold_routes_per_token_layer_measured": round(cold / (len(steps) * L), 4),
        "cold_routes_per_token_layer_predicted": round(pred.cold_routes_per_layer, 4),
    }
    out["error_pct"] = round(100 * (out["predicted_ms"] / out["measured_ms_mean"] - 1), 2)
    if cm.read_gbps(cal) and cal.get("expert_bytes"):  # BENCHMARK.md's bound on this routing
        out["bound_ms"] = round(cm.decode_bound(pred, costs, cal["expert_bytes"], cm.read_gbps(cal)), 3)
        out["measured_over_bound"] = round(out["measured_ms_median"] / out["bound_ms"], 3)
    if a.profile:
        prof = RouteCounts.load(a.profile)
        pp = cm.predict_decode_step(prof.decode, prof.tokens["decode"], res.hot, costs, K, dense)
        out["predicted_ms_from_profile"] = round(pp.total_ms, 3)
        out["cold_routes_per_token_layer_profile"] = round(pp.cold_routes_per_layer, 4)
    if cuda:
        out["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["gpu_memory_cap_gib"] = round(cap / 2**30, 2) if cap else None
    return out


def compare(paths: list[str], calibration: str | None) -> None:
    from ostinato.bench.report import source_state

    rows = [json.loads(Path(p).read_text()) for p in paths if Path(p).is_file()]
    if not rows:
        print(json.dumps({"error": "no measurements", "files": paths}))
        return
    print(f"{'residency':<14}{'hot':>6}{'steps':>7}{'cold/tok/layer':>16}{'predicted ms':>14}{'measured ms':>13}"
          f"{'median':>9}{'error':>8}")
    for r in rows:
        print(f"{r['name']:<14}{r['hot_experts']:>6}{r['steps']:>7}"
              f"{r['cold_routes_per_token_layer_measured']:>8.3f}/{r['cold_routes_per_token_layer_predicted']:<7.3f}"
              f"{r['predicted_ms']:>14.3f}{r['measured_ms_mean']:>13.3f}{r['measured_ms_median']:>9.3f}"
              f"{r['error_pct']:>7.1f}%" + (f"   bound {r['bound_ms']:.3f} ms (median {r['measured_over_bound']:.2f}x)"
                                            if "bound_ms" in r else ""))
    result = {"check": "issue C: cost model, predicted vs measured decode step", **source_state(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "target_error_pct": 5.0, "rows": rows}
    if len(rows) >= 2:
        small, big = sorted(rows[:2], key=lambda r: r["hot_experts"])
        pred = small["predicted_ms"] - big["predicted_ms"]
        meas = small["measured_ms_mean"] - big["measured_ms_mean"]
        print(f"saving of the bigger pool ({big['hot_experts']} vs {small['hot_experts']} hot experts): "
              f"predicted {pred:.3f} ms per step, measured {meas:.3f} ms")
        result["saving_ms"] = {"predicted": round(pred, 3), "measured": round(meas, 3)}
    result["within_target"] = all(abs(r["error_pct"]) <= 5.0 for r in rows)
    if calibration and Path(calibration).is_file():
        cal = json.loads(Path(calibration).read_text()).get("calibration") or {}
        result["calibration"] = {k: cal.get(k) for k in ("device", "cpu", "date", "torch", "cpu_threads", "cpu_backend",
                                                         "global", "upload_gbps", "host_read_gbps", "dense_step_ms",
                                                         "dense_ms_per_1k_context", "upload_threshold",
                                                         "forced_steps", "cpu_pass")}
        result["calibration"]["passes"] = {k: (cal.get("passes") or {}).get(k)
                                           for k in ("sizes", "split_ms", "upload_ms", "crossings")}
        result["calibration"]["model"] = {k: (cal.get("model") or {}).get(k) for k in
                                          ("upload_threshold", "upload_threshold_on_sizes", "decode_step_ms")}
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", nargs="+", help="measurement JSON files: print the table and one JSON line")
    ap.add_argument("--model")
    ap.add_argument("--residency")
    ap.add_argument("--calibration", help="residency file holding the calibration (default: --residency)")
    ap.add_argument("--profile", help="also predict from this profile's decode counts")
    ap.add_argument("--gpu-memory")
    ap.add_argument("--cpu-threads", type=int)
    ap.add_argument("--max-context", type=int)
    ap.add_argument("--sessions", default="embedded")
    ap.add_argument("--split", choices=["dev", "held-out", "all"], default="held-out")
    ap.add_argument("--max-sessions", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=256)
    ap.add_argument("--name", default="residency")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    if a.compare:
        compare(a.compare, a.calibration)
        return
    if not (a.model and a.residency):
        ap.error("--model and --residency are needed to measure")
    out = measure(a)
    line = json.dumps(out)
    if a.json_out:
        Path(a.json_out).write_text(line + "\n")
    print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
