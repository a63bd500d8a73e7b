"""The staging copies' pace, alone and beside a layer's GPU work: how fast does copy_experts
(kernels/triton/stage.py) move K experts from a page-locked host stack into flex slots, on the default
grid and on a few programs, and how much does each slow work on another stream, and it them?

Why: a captured pass prefetches each next layer's P cold experts while a layer runs, on a few programs
and a stream of its own (layers/moe/staging.py). Session 54 replayed P = 12 and 24 (results/2026-12-07-h100-s54/):
at 24 a 253-token turn's worker waited 31 ms longer for the GPU, as if 24 experts (67 MB) took longer than a
layer's 2.2 ms, which they would at half the 51 GB/s a kernel reads host memory at on 132 programs and more
(results/2026-12-06-h100-s39/). And session 53's prefetch on the default grid stalled the layer's own kernels;
whether by the grid or by the shared copy stream is not measured. Session 57 ran this on one H100
(results/2026-12-08-h100-s57/l_bench_stage_copy.txt): every way copied at 48-55 GB/s, but beside bf16 GEMMs the
grid slowed them 1.51-2.01x, 32 and 64 programs 1.23-1.46x, the memcpy 1.01x. A layer's own staging copies still
run on the grid (OSTINATO_STAGE_PROGRAMS sets programs), beside the layer's hot experts. This times, per way of
copying:
- the copy alone: a CUDA graph holding one copy of K experts, its replays' median;
- the work alone: a CUDA graph of --work-ms of a stand-in for a layer's GPU branch: "quant", the engine's
  quantized prefill kernels (Q4_K/Q6_K pools at the 30B shape, what runs beside the copies in a pass), or
  "gemm", bf16 GEMMs (session 57's stand-in);
- both: the two graphs launched together on two streams after one event, each timed from it to its end.
The ways: the default grid ("grid"), copy_experts on N programs (N of --programs), and the copy engine's
memcpy of K contiguous experts ("memcpy": no SMs), the reference. Each copy is checked byte for byte.

Usage: python scripts/bench_stage_copy.py [--experts 12 24] [--programs 8 16 32 64 132] [--work quant gemm]
Prints a table; the last line is one JSON document.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ostinato.bench.report import source_state  # noqa: E402
from ostinato.kernels.triton.handshake import HostPointer  # noqa: E402
from ostinato.kernels.triton.stage import FEW_CHUNK, copy_experts  # noqa: E402
from scripts.bench_gpu_experts import replay_times  # noqa: E402

Q4_K_M_EXPERT = 2_856_960  # bytes of one Qwen3-30B-A3B expert in the Q4_K_M file's mix (bench budget's expert_bytes)


def together(copy: torch.cuda.CUDAGraph, work: torch.cuda.CUDAGraph, reps: int) -> tuple[float, float]:
    """The medians (ms) of the copy's and the work's times from a common start, the copy launched first on a
    side stream, the work on the current one."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    copy_ms, work_ms = [], []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        c_end, w_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        main.synchronize()
        start.record(main)
        side.wait_event(start)
        with torch.cuda.stream(side):
            copy.replay()
            c_end.record(side)
        work.replay()
        w_end.record(main)
        torch.cuda.synchronize()
        copy_ms.append(start.elapsed_time(c_end))
        work_ms.append(start.elapsed_time(w_end))
    return statistics.median(copy_ms), statistics.median(work_ms)


def gemm_work(rows: int):
    """One unit of the "gemm" stand-in: [rows, 2048] x [2048, 1536] x [1536, 2048] in bf16 (cuBLAS)."""
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 1536, device="cuda", dtype=torch.bfloat16) / 64
    w2 = torch.randn(1536, 2048, device="cuda", dtype=torch.bfloat16) / 64
    out = torch.empty_like(x)

    def unit(i: int):
        torch.matmul(x @ w, w2, out=out)
    return unit


def quant_work(rows: int, layers: int = 4):
    """One unit of the "quant" stand-in: a layer call of the engine's quantized prefill kernels (Q4_K gate/up,
    Q6_K down: Q4_K_M's heavier layers) at the 30B shape, `rows` tokens routed over its 128 experts, all hot;
    unit i calls layer i % layers (other weights each call, as a pass does)."""
    from scripts.bench_gpu_quant import bench_inputs, make_pool, quant_forward

    qtypes = ("Q4_K", "Q6_K")
    forward = quant_forward(make_pool(qtypes, layers), qtypes)
    xs, routes, out = bench_inputs(layers, rows)

    def unit(i: int):
        slots, weights = routes[i % layers]
        forward(xs[i % layers], slots, weights, out[i % layers])
    return unit


WORKS = {"quant": quant_work, "gemm": gemm_work}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[12, 24], help="experts copied at once (K)")
    ap.add_argument("--programs", type=int, nargs="+", default=[8, 16, 32, 64, 132],
                    help="copy_experts' programs (OSTINATO_PREFETCH_PROGRAMS: the prefetch's; OSTINATO_STAGE_PROGRAMS: "
                         "a layer's own staging copies')")
    ap.add_argument("--chunk", type=int, nargs="+", default=[16384, 32768],
                    help="bytes a program copies a step on a few programs (FEW_CHUNK is the prefetch's)")
    ap.add_argument("--work", nargs="+", choices=sorted(WORKS), default=["quant", "gemm"],
                    help="the stand-in for a layer's GPU work: the quantized prefill kernels, or bf16 GEMMs")
    ap.add_argument("--expert-bytes", type=int, default=Q4_K_M_EXPERT)
    ap.add_argument("--rows", type=int, default=256, help="the stand-in work's rows (a pass's tokens)")
    ap.add_argument("--work-ms", type=float, default=2.0, help="the stand-in work's time alone, about")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_stage_copy times CUDA kernels: no GPU here")
    if min(*a.experts, *a.programs, *a.chunk, a.expert_bytes, a.rows, a.reps) < 1 or a.work_ms <= 0:
        raise SystemExit("--experts, --programs, --chunk, --expert-bytes, --rows, --work-ms and --reps must be "
                         "positive")
    if any(c & (c - 1) for c in a.chunk):
        raise SystemExit("--chunk: powers of two (a Triton block)")
    dev, E, K_max = "cuda", 128, max(a.experts)
    if K_max > E:
        raise SystemExit(f"--experts: at most {E}")
    g = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (E, a.expert_bytes), dtype=torch.uint8, generator=g).pin_memory()
    src = HostPointer(host)
    dst = torch.zeros(K_max, a.expert_bytes, dtype=torch.uint8, device=dev)
    rows = torch.randperm(E, generator=g).to(torch.int32).to(dev)  # expert e lies in host row rows[e]

    works = {}  # name -> (graph, ms alone, units)
    for name in a.work:
        unit = WORKS[name](a.rows)
        one = statistics.median(replay_times(lambda: unit(0), a.reps)[0])
        n = max(1, round(a.work_ms / one))
        times, graph = replay_times(lambda n=n, unit=unit: [unit(i) for i in range(n)], a.reps)
        works[name] = graph, statistics.median(times), n
        print(f"work {name}: {n} units of {a.rows} rows, {works[name][1]:.3f} ms alone")
    print(f"staging copies beside GPU work, {torch.cuda.get_device_name()}")
    print(f"{'work':>5} {'K':>3} {'way':>8} {'chunk':>6} {'copy ms':>8} {'GB/s':>7} {'beside ms':>9} {'GB/s':>7} "
          f"{'work ms':>8} {'x alone':>7}  check")
    results = []
    for K in a.experts:
        pick = torch.zeros(E, dtype=torch.bool, device=dev)
        chosen = torch.randperm(E, generator=g)[:K].to(dev)
        pick[chosen] = True
        rank = (torch.cumsum(pick.to(torch.int32), 0, dtype=torch.int32) - 1)
        want = host[rows[chosen.sort().values].long().cpu()]  # the picked experts in expert order = rank order
        ways = [("memcpy", None, lambda: dst[:K].copy_(host[:K], non_blocking=True), host[:K])]
        ways.append(("grid", None, lambda: copy_experts(src, dst, rows, pick, rank, 0), want))
        for c in a.chunk:
            for p in a.programs:
                ways.append((f"{p}", c, lambda p=p, c=c: copy_experts(src, dst, rows, pick, rank, 0, p, c), want))
        for name, chunk, fn, expect in ways:
            dst.zero_()
            times, copy = replay_times(fn, a.reps)
            ok = bool(torch.equal(dst[:K].cpu(), expect))
            alone = statistics.median(times)
            nbytes = K * a.expert_bytes
            for work_name, (work, work_alone, _) in works.items():
                beside, work_beside = together(copy, work, a.reps)
                r = {"work": work_name, "experts": K, "way": name, "programs": int(name) if name.isdigit() else None,
                     "chunk": chunk, "copy_ms": alone, "gbps": nbytes / alone / 1e6, "copy_beside_ms": beside,
                     "gbps_beside": nbytes / beside / 1e6, "work_beside_ms": work_beside,
                     "work_slowdown": work_beside / work_alone, "ok": ok}
                results.append(r)
                print(f"{work_name:>5} {K:3d} {name:>8} {chunk or '-':>6} {alone:8.3f} {r['gbps']:7.2f} {beside:9.3f} "
                      f"{r['gbps_beside']:7.2f} {work_beside:8.3f} {r['work_slowdown']:7.2f}  {'ok' if ok else 'WRONG'}")
    print(json.dumps({"bench": "stage_copy", **source_state(), "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "triton": triton.__version__, "expert_bytes": a.expert_bytes,
                      "few_chunk": FEW_CHUNK, "rows": a.rows,
                      "works": {n: {"units": u, "ms": ms} for n, (_, ms, u) in works.items()},
                      "reps": a.reps, "results": results}))


if __name__ == "__main__":
    main()
