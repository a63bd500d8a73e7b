"""Benchmark (and with --tune, tune) the slot-expert kernels of the GPU branch on one CUDA device.

Legend: T tokens, K routes per token, D hidden, F expert FFN size, E experts per layer,
N pool slots, L layers measured. Default shapes are Qwen3-30B-A3B's: D=2048, F=768, K=8,
E=128, and a pool of 2000 slots (~19 GB of bf16) whose last K slots are the zero slots.
Each layer maps its E experts to its own slots, and consecutive calls use other layers,
so the weights of one call are never in L2 from the one before.

- decode: a CUDA graph of L single-token layer calls, replayed with 0..8 hot routes
  written into the same routing buffers; G = graph time / L (CUDA events), achieved
  bandwidth = bytes of the hot experts / G, against a measured device copy bandwidth.
- prefill: T in {32, 128, 512, 2048}, every route hot, uniform routing: graph-replay and
  eager (do_bench) medians, TFLOP/s, and a torch baseline (gathered weights + bmm for
  decode, a loop over distinct slots for prefill).
- --tune: sweeps the decode block sizes, prefill tile configs per token bucket and the
  decode/prefill crossover; writes ostinato/kernels/tuned/moe_<device>.json first, then
  benchmarks with it.
Prints a table; the last line is one JSON document. Usage:
  python scripts/bench_gpu_experts.py [--tune] [--slots 2000]
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F_

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ostinato.layers.moe import gpu_experts as ge  # noqa: E402
from ostinato.bench.report import source_state  # noqa: E402

D, F, K, E = 2048, 768, 8, 128
EXPERT_BYTES = 3 * D * F * 2  # bf16 w13 + w2 of one expert
PREFILL_TOKENS = [32, 128, 512, 2048]
CROSSOVER_TOKENS = [1, 2, 4, 8, 16, 24, 32, 48]
TUNED_KEYS = ["decode_max_tokens", "decode_w13", "decode_w2", "prefill"]


def make_pool(num_slots):
    """w13[N, 2F, D], w2[N, D, F] bf16; slots [N-K, N) are the zero slots."""
    w13 = torch.empty(num_slots, 2 * F, D, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(num_slots, D, F, dtype=torch.bfloat16, device="cuda")
    for w in (w13, w2):
        w.normal_(0, 0.02)
        w[num_slots - K:] = 0
    return w13, w2, num_slots - K, num_slots


def layer_tables(zero_lo):
    """One [E] expert -> slot table per layer, disjoint slots across layers."""
    perm = torch.randperm(zero_lo, device="cuda")
    return [perm[i * E:(i + 1) * E] for i in range(zero_lo // E)]


def routing(table, T, num_hot, zero_lo):
    """slots[T, K] int32, weights[T, K]: the first num_hot routes of each token are hot."""
    ids = torch.rand(T, E, device="cuda").argsort(dim=1)[:, :K]
    slots = table[ids]
    zero = zero_lo + torch.arange(K, device="cuda").expand(T, K)
    slots = torch.where(torch.arange(K, device="cuda") < num_hot, slots, zero)
    return slots.to(torch.int32), torch.softmax(torch.randn(T, K, device="cuda"), -1)


def copy_bandwidth():
    from triton.testing import do_bench

    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / ms / 1e6  # GB/s, read + write


def graph_time_ms(fn, reps=20):
    """Median time of one replay of a graph holding fn, and the graph."""
    times, graph = replay_times(fn, reps)
    return times[len(times) // 2], graph


def replay_times(fn, reps, before=None):
    """The sorted times (ms) of reps replays of a graph holding fn (warmed up on a side stream),
    and the graph; before(): host work ahead of each timed replay, outside its time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times), graph


class DecodeRig:
    """L layers of one-token calls with static buffers, captured as one graph."""

    def __init__(self, pool, tables, tuning):
        self.pool, self.tables, self.tuning = pool, tables, tuning
        L = len(tables)
        self.x = torch.randn(L, 1, D, device="cuda").bfloat16()
        self.slots = torch.empty(L, 1, K, dtype=torch.int32, device="cuda")
        self.weights = torch.empty(L, 1, K, device="cuda")
        self.out = torch.empty(L, 1, D, dtype=torch.bfloat16, device="cuda")
        self.set_hot(K)

    def set_hot(self, num_hot):
        zero_lo = self.pool[2]
        for l, table in enumerate(self.tables):
            s, w = routing(table, 1, num_hot, zero_lo)
            self.slots[l].copy_(s)
            self.weights[l].copy_(w)

    def step(self):
        w13, w2, zero_lo, zero_hi = self.pool
        for l in range(len(self.tables)):
            ge.slot_experts_triton(self.x[l], self.slots[l], self.weights[l], w13, w2, zero_lo,
                                   zero_hi, self.out[l], max_distinct=E, tuning=self.tuning)

    def per_layer_us(self, reps=20):
        ms, graph = graph_time_ms(self.step, reps)
        return 1e3 * ms / len(self.tables), graph


def bench_decode(pool, tables, tuning, copy_bw):
    from triton.testing import do_bench

    rig = DecodeRig(pool, tables, tuning)
    _, graph = rig.per_layer_us()
    rows = {}
    for num_hot in range(K + 1):
        rig.set_hot(num_hot)
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        us = 1e3 * sorted(times)[len(times) // 2] / len(tables)
        gbps = num_hot * EXPERT_BYTES / us / 1e3
        rows[num_hot] = {"us": us, "GBps": gbps, "bw_fraction": gbps / copy_bw}
    # Eager, one layer, for comparison (launch overhead included), and the torch baseline.
    w13, w2, zero_lo, zero_hi = pool
    inputs = itertools.cycle([(rig.x[l], *routing(t, 1, K, zero_lo)) for l, t in enumerate(tables)])

    def eager():
        x, s, w = next(inputs)
        ge.slot_experts_triton(x, s, w, w13, w2, zero_lo, zero_hi, max_distinct=E, tuning=tuning)

    def baseline():
        x, s, w = next(inputs)
        idx = s[0].long()
        gate, up = torch.bmm(w13[idx], x[0].view(1, D, 1).expand(K, D, 1)).chunk(2, dim=1)
        y = torch.bmm(w2[idx], F_.silu(gate) * up).squeeze(-1)  # [K, D]
        return (w[0, :, None] * y.float()).sum(0).bfloat16()

    eager_us = 1e3 * do_bench(eager, return_mode="median")
    torch_us = 1e3 * do_bench(baseline, return_mode="median")
    return {"by_hot": rows, "eager_us": eager_us, "torch_gather_bmm_us": torch_us}


def prefill_inputs(tables, T, zero_lo, count=4):
    return [(torch.randn(T, D, device="cuda").bfloat16(), *routing(t, T, K, zero_lo))
            for t in tables[:count]]


def torch_prefill(x, slots, weights, w13, w2):
    """Baseline: loop over distinct slots (host sync), bf16 matmuls, gathered weights."""
    flat = slots.reshape(-1).long()
    out = torch.zeros(slots.numel(), D, dtype=torch.float32, device="cuda")
    order = torch.argsort(flat)
    uniq, counts = torch.unique_consecutive(flat[order], return_counts=True)
    start = 0
    for s, c in zip(uniq.tolist(), counts.tolist()):
        routes = order[start:start + c]
        start += c
        gate, up = F_.linear(x[routes // K], w13[s]).chunk(2, dim=-1)
        y = F_.linear(F_.silu(gate) * up, w2[s]).float()
        out[routes] = y * weights.reshape(-1)[routes, None]
    return out.view(*slots.shape, D).sum(1).bfloat16()


def bench_prefill(pool, tables, tuning, T, baseline=True):
    from triton.testing import do_bench

    w13, w2, zero_lo, zero_hi = pool
    inputs = prefill_inputs(tables, T, zero_lo)
    cycle = itertools.cycle(inputs)
    out = torch.empty(T, D, dtype=torch.bfloat16, device="cuda")

    def run(x, s, w):
        return ge.slot_experts_triton(x, s, w, w13, w2, zero_lo, zero_hi, out, max_distinct=E,
                                      tuning=tuning)

    eager_ms = do_bench(lambda: run(*next(cycle)), return_mode="median")
    graph_ms, _ = graph_time_ms(lambda: run(*inputs[0]))
    flops = 2 * T * K * 3 * D * F
    row = {"eager_us": 1e3 * eager_ms, "graph_us": 1e3 * graph_ms,
           "tflops": flops / graph_ms / 1e9, "path": path_of(tuning, T)}
    if baseline:
        row["torch_loop_us"] = 1e3 * do_bench(lambda: torch_prefill(*next(cycle), w13, w2),
                                              return_mode="median")
    return row


def path_of(tuning, T):
    return "decode" if T <= tuning["decode_max_tokens"] else "prefill"


def check_correctness(pool, tables, tuning):
    """Relative error against the torch oracle for a decode and a prefill call."""
    w13, w2, zero_lo, zero_hi = pool
    errs = {}
    for T, hot in [(1, 5), (3, 8), (200, 6)]:
        x = torch.randn(T, D, device="cuda").bfloat16()
        s, w = routing(tables[0], T, hot, zero_lo)
        got = ge.slot_experts_triton(x, s, w, w13, w2, zero_lo, zero_hi, max_distinct=E,
                                     tuning=tuning).float()
        want = ge.slot_experts_torch(x, s, w, w13, w2, zero_lo, zero_hi, out_dtype=torch.float32)
        errs[T] = ((got - want).abs().max() / want.abs().max()).item()
    return errs


def try_time(fn):
    try:
        return fn()
    except Exception as exc:  # a tile that does not fit (shared memory, registers)
        print(f"  skipped: {type(exc).__name__}: {str(exc)[:100]}")
        return float("inf")


def tune(pool, tables):
    tuning = copy.deepcopy(ge.DEFAULT_TUNING)
    rig = DecodeRig(pool, tables, tuning)
    w13_cands = [{"BLOCK_F": f, "BLOCK_D": d, "num_warps": nw, "num_stages": st}
                 for f, d, nw, st in [(16, 256, 4, 3), (8, 256, 2, 3), (16, 256, 4, 2),
                                      (16, 256, 4, 4), (8, 512, 4, 3), (16, 512, 8, 3),
                                      (4, 512, 2, 3), (8, 256, 4, 4)]]
    w2_cands = [{"BLOCK_D": d, "BLOCK_F": f, "num_warps": nw, "num_stages": st}
                for d, f, nw, st in [(4, 256, 8, 1), (4, 256, 8, 2), (4, 128, 4, 1),
                                     (4, 128, 4, 3), (8, 128, 8, 1), (8, 128, 8, 2),
                                     (2, 256, 4, 2), (1, 256, 4, 1)]]
    for key, cands in [("decode_w13", w13_cands), ("decode_w2", w2_cands)]:
        scored = []
        for cfg in cands:
            tuning[key] = cfg
            us = try_time(lambda: rig.per_layer_us(reps=10)[0])
            print(f"  {key} {cfg}: {us:.1f} us/layer")
            scored.append((us, cfg))
        tuning[key] = min(scored, key=lambda sc: sc[0])[1]
    w13, w2, zero_lo, zero_hi = pool
    prefill_cands = [dict(zip(["BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"], c))
                     for c in [(16, 64, 128, 4, 3), (16, 128, 64, 4, 4), (32, 64, 64, 4, 3),
                               (32, 128, 64, 4, 3), (32, 64, 128, 4, 4), (64, 64, 64, 4, 3),
                               (64, 128, 64, 4, 3), (64, 128, 64, 8, 3), (64, 64, 128, 4, 4),
                               (64, 128, 64, 4, 4), (128, 64, 64, 4, 3), (128, 128, 64, 8, 3),
                               (128, 128, 32, 8, 4), (128, 64, 128, 8, 3)]]
    best = {}
    for T in PREFILL_TOKENS:
        inputs = prefill_inputs(tables, T, zero_lo, count=1)
        scored = []
        for cfg in prefill_cands:
            trial = copy.deepcopy(tuning)
            trial["decode_max_tokens"] = 0
            trial["prefill"] = {"1000000": cfg}
            us = try_time(lambda: 1e3 * graph_time_ms(
                lambda: ge.slot_experts_triton(*inputs[0], w13, w2, zero_lo, zero_hi,
                                               max_distinct=E, tuning=trial), reps=10)[0])
            print(f"  prefill T={T} {cfg}: {us:.1f} us")
            scored.append((us, cfg))
        best[T] = min(scored, key=lambda sc: sc[0])[1]
    bounds = [(a + b) // 2 for a, b in zip(PREFILL_TOKENS, PREFILL_TOKENS[1:])] + [1_000_000]
    tuning["prefill"] = {str(bound): best[T] for bound, T in zip(bounds, PREFILL_TOKENS)}
    tuning["decode_max_tokens"] = tune_crossover(pool, tables, tuning)
    return tuning


def tune_crossover(pool, tables, tuning):
    """Largest T up to which the decode kernels beat prefill's (graph time, all hot)."""
    w13, w2, zero_lo, zero_hi = pool
    last = 0
    for T in CROSSOVER_TOKENS:
        x, s, w = prefill_inputs(tables, T, zero_lo, count=1)[0]
        times = {}
        for path in ("decode", "prefill"):
            trial = copy.deepcopy(tuning)
            trial["decode_max_tokens"] = 10**9 if path == "decode" else 0
            times[path], _ = graph_time_ms(lambda: ge.slot_experts_triton(
                x, s, w, w13, w2, zero_lo, zero_hi, max_distinct=E, tuning=trial), reps=10)
        print(f"  crossover T={T}: decode {1e3 * times['decode']:.1f} us, "
              f"prefill {1e3 * times['prefill']:.1f} us")
        if times["decode"] > times["prefill"]:
            break
        last = T
    return last


def write_tuning(tuning):
    tag = ge.device_tag(torch.device("cuda"))
    path = ge.tuned_path(tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton_version(), "shapes": {"D": D, "F": F, "K": K, "E": E},
            "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "by": "scripts/bench_gpu_experts.py --tune"}
    tuned = {k: tuning[k] for k in TUNED_KEYS}  # the rest keeps following DEFAULT_TUNING
    path.write_text(json.dumps({"_meta": meta, **tuned}, indent=2) + "\n")
    ge.load_tuning.cache_clear()
    ge._tuning_for.cache_clear()
    return path


def triton_version():
    import triton

    return triton.__version__


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=2000, help="pool slots (~9.4 MB each)")
    parser.add_argument("--tune", action="store_true",
                        help="sweep block sizes, write the tuned JSON")
    parser.add_argument("--no-baseline", action="store_true", help="skip the torch baselines")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    torch.manual_seed(0)
    t0 = time.time()
    pool = make_pool(args.slots)
    tables = layer_tables(pool[2])
    copy_bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, pool {args.slots} slots "
          f"({args.slots * EXPERT_BYTES / 1e9:.1f} GB), {len(tables)} layers, "
          f"copy bandwidth {copy_bw:.0f} GB/s")
    if args.tune:
        print(f"wrote {write_tuning(tune(pool, tables))}")
    tag = ge.device_tag(torch.device("cuda"))
    tuning = ge.load_tuning(tag)
    tuned_file = str(ge.tuned_path(tag)) if ge.tuned_path(tag).exists() else None
    errors = check_correctness(pool, tables, tuning)
    print("relative error vs torch oracle:", {k: f"{v:.2e}" for k, v in errors.items()})
    decode = bench_decode(pool, tables, tuning, copy_bw)
    print(f"\ndecode, per layer (graph of {len(tables)} layers)\n hot      us    GB/s  of copy bw")
    for num_hot, row in decode["by_hot"].items():
        print(f"{num_hot:4d} {row['us']:7.1f} {row['GBps']:7.0f} {row['bw_fraction']:8.2f}")
    print(f"eager one layer (8 hot): {decode['eager_us']:.1f} us; "
          f"torch gather+bmm: {decode['torch_gather_bmm_us']:.1f} us")
    prefill = {}
    print("\nprefill, all routes hot\n     T  path     graph_us  eager_us  TFLOP/s  torch_us")
    for T in PREFILL_TOKENS:
        row = bench_prefill(pool, tables, tuning, T, baseline=not args.no_baseline)
        prefill[T] = row
        print(f"{T:6d}  {row['path']:7s} {row['graph_us']:9.1f} {row['eager_us']:9.1f} "
              f"{row['tflops']:8.1f} {row.get('torch_loop_us', float('nan')):9.1f}")
    result = {"bench": "gpu_experts", **source_state(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton_version(),
              "shapes": {"D": D, "F": F, "K": K, "E": E, "slots": args.slots},
              "tuning": tuning, "tuned_file": tuned_file, "copy_GBps": copy_bw,
              "rel_err": errors, "decode": decode, "prefill": prefill,
              "seconds": time.time() - t0}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
