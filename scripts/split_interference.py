"""Where the time of a split pass goes (layers/moe/hybrid.py, HybridExperts.split_path).

`ostinato calibrate` found the CPU branch of split passes of 384 tokens and more 2.6x slower
inside split_path than alone (results/2026-11-29-h200x2-s4/). This script times, on the
routing of real prompts and the engine's own buffers, one layer's pass of n tokens:

  split        split_path itself, with the host timeline of its steps (to the host, GPU branch
               launched, copies waited for, routes gathered, CPU branch, result queued back)
  alone        the CPU branch alone (HybridExperts.cpu_branch, as calibrate's cpu_alone times it)
  gpu||cpu     the GPU branch launched, then the CPU branch (no copies before it)
  copies,cpu   routing and activations copied to the host and waited for, then the CPU branch
  gpu,cpu      the GPU branch run to its end, then the CPU branch
  gather,cpu   the cold routes gathered with torch on the host (as split_path does), then the
               CPU branch
  split,1 thread  split_path with torch's intra-op threads set to 1 for the call

each the median over --reps of the host time, and the native kernel's own time
(ColdExperts.last_stats). Prints a table and one JSON line last.

    python scripts/split_interference.py --model synth:qwen3-30b-a3b --residency res-cap.json \
        --gpu-memory 32GiB --cpu-threads 15 --sessions .carry/agent
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def kernel_ms(h) -> float:
    """The last native call's time from submit to its last phase (ms)."""
    ends = [e for e in h.cpu.last_stats().get("phase_end_us", ()) if e >= 0]
    return max(ends) / 1e3 if ends else float("nan")


def cold_routes(h, layer, ids_h, w_h):
    cid = h.host.compact[layer][ids_h]
    cold = cid >= 0
    return cold.nonzero()[:, 0].to(torch.int32), cid[cold], w_h[cold]


def split_timeline(h, layer, x, topk) -> dict:
    """split_path's steps (the plain split path: no borrowing, no uploads), each timed on the host."""
    from ostinato.layers.moe.hybrid import to_host

    t = [time.perf_counter()]
    ids_h, w_h, x_h, done = to_host(topk, x, h.x_host, h.on_cuda)
    t.append(time.perf_counter())
    pool = h.pools.of(layer)
    gpu = pool.forward(x, pool.slots_for(layer, topk.ids), topk.weights, out_dtype=torch.float32)
    t.append(time.perf_counter())
    if done is not None:
        done.synchronize()
    t.append(time.perf_counter())
    tok, eids, wts = cold_routes(h, layer, ids_h, w_h)
    out_h = h.out_host[:x.shape[0]]
    t.append(time.perf_counter())
    h.cpu.submit(layer, x_h, tok, eids, wts, out_h)
    h.cpu.wait()
    t.append(time.perf_counter())
    (gpu + out_h.to(h.device, non_blocking=True)).to(x.dtype)
    t.append(time.perf_counter())
    names = ("to_host", "gpu_launch", "copies_wait", "gather", "cpu", "queue_back")
    return {n: 1e3 * (b - a) for n, a, b in zip(names, t, t[1:])}


def variants(h, layer, x, topk):
    """name -> a callable of one pass."""
    from ostinato.planner.measure.timing import gpu_branch

    ids_h, w_h = topk.ids.cpu(), topk.weights.cpu()
    cpu = h.cpu_branch(layer, x, topk)

    def gpu_par_cpu():
        gpu_branch(h, layer, x, topk.ids, topk.weights)
        cpu()

    def copies_cpu():
        from ostinato.layers.moe.hybrid import to_host

        done = to_host(topk, x, h.x_host, h.on_cuda)[3]
        if done is not None:
            done.synchronize()
        cpu()

    def gpu_then_cpu():
        gpu_branch(h, layer, x, topk.ids, topk.weights)
        if h.on_cuda:
            torch.cuda.synchronize()
        cpu()

    def gather_cpu():
        _, eids, _ = cold_routes(h, layer, ids_h, w_h)
        torch.unique(eids)
        cpu()

    def split_1thread():
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            h.split_path(layer, x, topk)
        finally:
            torch.set_num_threads(before)

    return {"split": lambda: h.split_path(layer, x, topk), "alone": cpu, "gpu||cpu": gpu_par_cpu,
            "copies,cpu": copies_cpu, "gpu,cpu": gpu_then_cpu, "gather,cpu": gather_cpu,
            "split,1 thread": split_1thread}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--residency", required=True)
    p.add_argument("--gpu-memory")
    p.add_argument("--cpu-threads", type=int)
    p.add_argument("--sessions", default="embedded:4")
    p.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 384, 512, 1024])
    p.add_argument("--layers", type=int, nargs="+", help="MoE layers (default: 4 spread over those with cold experts)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-graph", action="store_true", help="load without decode graphs (no graph worker thread)")
    a = p.parse_args(argv)

    from ostinato.config import parse_bytes
    from ostinato.engine.placement import PlacementSettings
    from ostinato.engine.runner import RunnerSettings
    from ostinato.layers.moe.types import TopKOutput
    from ostinato.load import load_engine
    from ostinato.planner.measure.prefill import capture_routing, prompt_ids
    from ostinato.planner.measure.timing import Clock

    loaded = load_engine(a.model, RunnerSettings(cuda_graph=not a.no_graph, cpu_threads=a.cpu_threads),
                         PlacementSettings(residency=a.residency,
                                           gpu_memory=parse_bytes(a.gpu_memory) if a.gpu_memory else None))
    runner = loaded.runner
    h = runner.experts.unwrapped
    h.mixed = None
    with_cold = [l for l in runner.config.moe_layers if h.has_cold.get(l)]
    layers = a.layers or sorted({with_cold[round(i * (len(with_cold) - 1) / 3)] for i in range(4)})
    clock = Clock(h.device)
    rows = []
    with torch.inference_mode():
        routing = capture_routing(runner, prompt_ids(loaded.tokenizer, a.sessions, max(a.sizes)), layers)
        for n in a.sizes:
            for layer in layers:
                xa, ta = routing[layer]
                x, topk = xa[:n], TopKOutput(ta.ids[:n], ta.weights[:n])
                row = {"n": n, "layer": layer}
                for name, fn in variants(h, layer, x, topk).items():
                    fn()  # warm-up
                    runs = []
                    for _ in range(a.reps):
                        ms = clock.host(fn)
                        runs.append((ms, kernel_ms(h)))
                    row[name] = statistics.median(r[0] for r in runs)
                    row[name + "_kernel"] = statistics.median(r[1] for r in runs)
                clock.sync()
                steps = [split_timeline(h, layer, x, topk) for _ in range(a.reps)]
                clock.sync()
                row["split_steps"] = {k: round(statistics.median(s[k] for s in steps), 3) for k in steps[0]}
                rows.append(row)
    names = ("split", "alone", "gpu||cpu", "copies,cpu", "gpu,cpu", "gather,cpu", "split,1 thread")
    print("host ms (native kernel ms) per layer, median over", a.reps)
    print(f"{'n':>5} {'layer':>5} " + " ".join(f"{k:>16}" for k in names) + "  split steps")
    for r in rows:
        print(f"{r['n']:5d} {r['layer']:5d} " + " ".join(f"{r[k]:7.2f} ({r[k + '_kernel']:6.2f})" for k in names)
              + "  " + " ".join(f"{k} {v:.2f}" for k, v in r["split_steps"].items()))
    print(json.dumps({"script": "split_interference", "model": a.model, "residency": a.residency,
                      "cpu_threads": h.cpu.num_threads, "torch_threads": torch.get_num_threads(),
                      "graph": not a.no_graph, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
