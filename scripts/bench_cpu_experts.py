"""Microbenchmark of the CPU branch (cold experts) at Qwen3-30B-A3B shapes.

Legend: T tokens, r cold routes of one token, E experts, D hidden, F expert FFN size.

Measures, on the native kernels and beside them torch's own bf16 CPU path:
  - host read bandwidth (torch sum over a large fp32 tensor), the bound;
  - decode: one token with r = 0..8 cold routes; medians, the cost model fit
    C(0) = gamma0, C(r) = alpha + beta * r, and the read bandwidth achieved;
  - prefill: T tokens with top-k routing, every route cold (or --hot-fraction removed).
Weights rotate over --layers layers of E experts so that caches do not hold them (the
default takes enough layers to exceed the last-level cache 8 times, within half the
free memory). Prints a table, and last one JSON line.

  python scripts/bench_cpu_experts.py --layers 4          # a small machine
  python scripts/bench_cpu_experts.py                     # the 16-core GPU host
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as nnf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout, not installed

from ostinato.bench.report import source_state
from ostinato.threads import Topology
from ostinato.layers.moe.cpu_experts import CpuExperts, torch_reference
from ostinato.layers.moe.types import ExpertWeights


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None, help="layers of experts to rotate over")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="pool workers (default: physical cores - 1)")
    p.add_argument("--isa", default="auto", choices=["auto", "avx512", "avx512_bf16", "amx"])
    p.add_argument("--spin-us", type=int, default=2000)
    p.add_argument("--iters", type=int, default=200, help="decode calls per r")
    p.add_argument("--prefill", default="32,128,512", help="prefill token counts")
    p.add_argument("--prefill-iters", type=int, default=3)
    p.add_argument("--hot-fraction", type=float, default=0.0, help="share of prefill routes removed")
    p.add_argument("--bw-gib", type=float, default=4.0, help="size of the bandwidth probe")
    p.add_argument("--no-torch", action="store_true", help="skip the torch bf16 baseline")
    p.add_argument("--no-prefetch", action="store_true", help="turn the kernels' software prefetch off")
    p.add_argument("--skip-decode", action="store_true", help="prefill only")
    p.add_argument("--amx-min-tokens", type=int, default=4, help="fewest routes of an expert for AMX")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def l3_bytes() -> int:
    try:
        for idx in sorted(os.listdir("/sys/devices/system/cpu/cpu0/cache")):
            base = f"/sys/devices/system/cpu/cpu0/cache/{idx}"
            if open(f"{base}/level").read().strip() == "3":
                size = open(f"{base}/size").read().strip()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
                return int(size.rstrip("KMG")) * mult
    except OSError:
        pass
    return 64 << 20


def hardware() -> dict:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    topo = Topology.read()
    return {"cpu": model, "physical_cores": len(topo.cores()), "logical_cpus": len(topo.cpus),
            "l3_mib": l3_bytes() >> 20, "mem_available_gib": round(meminfo_bytes("MemAvailable") / 2**30, 1)}


def read_bandwidth(gib: float) -> float:
    """GB/s of torch's fp32 sum over a tensor much larger than the caches (best of 5)."""
    gib = min(gib, meminfo_bytes("MemAvailable") / 4 / 2**30)
    t = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    t.sum()
    best = min(timed(t.sum) for _ in range(5))
    n = t.numel() * 4
    del t
    return n / best / 1e9


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_layers(n: int, E: int, D: int, F: int, gen: torch.Generator) -> list[ExpertWeights]:
    """Random bf16 experts; one random expert per layer copied E times (values do not matter
    for timing, only that every byte is real memory)."""
    layers = []
    for _ in range(n):
        b13 = (torch.randn(2 * F, D, generator=gen) / math.sqrt(D)).bfloat16()
        b2 = (torch.randn(D, F, generator=gen) / math.sqrt(F)).bfloat16()
        w13 = torch.empty(E, 2 * F, D, dtype=torch.bfloat16)
        w2 = torch.empty(E, D, F, dtype=torch.bfloat16)
        w13.copy_(b13.expand(E, -1, -1))
        w2.copy_(b2.expand(E, -1, -1))
        layers.append(ExpertWeights(w13, w2))
    return layers


def torch_bf16_experts(w: ExpertWeights, x, tok, ids, wts, out):
    """The plain torch CPU path in the model's dtype: bf16 linears per expert."""
    F = w.w2.shape[2]
    res = out[: x.shape[0]]
    res.zero_()
    tok, ids = tok.long(), ids.long()
    for e in torch.unique(ids).tolist():
        sel = (ids == e).nonzero().squeeze(1)
        t = tok[sel]
        gu = nnf.linear(x[t], w.w13[e])
        y = nnf.linear(nnf.silu(gu[:, :F]) * gu[:, F:], w.w2[e])
        res.index_add_(0, t, y.float() * wts[sel, None])
    return out


def topk_routes(T: int, E: int, k: int, hot_fraction: float, gen: torch.Generator):
    logits = torch.randn(T, E, generator=gen)
    wts, ids = torch.topk(logits.softmax(-1), k)
    wts = wts / wts.sum(-1, keepdim=True)
    tok = torch.arange(T)[:, None].expand(T, k)
    keep = torch.rand(T, k, generator=gen) >= hot_fraction
    return tok[keep].int(), ids[keep].int(), wts[keep].float()


def fit_line(rs: list[int], ys: list[float]) -> tuple[float, float]:
    n, sx, sy = len(rs), sum(rs), sum(ys)
    sxx, sxy = sum(r * r for r in rs), sum(r * y for r, y in zip(rs, ys))
    beta = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return (sy - beta * sx) / n, beta


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_decode(ce, layers, args, gen, expert_bytes):
    E, D, k = args.experts, args.hidden, args.topk
    out = torch.empty(1, D, dtype=torch.float32)
    x = torch.randn(1, D, generator=gen).bfloat16()
    tok_all = torch.zeros(k, dtype=torch.int32)
    rows = []
    for r in range(k + 1):
        native, python, ref = [], [], []
        for it in range(args.iters + 10):
            layer = it % len(layers)
            ids = torch.randperm(E, generator=gen)[:r].int()
            wts = torch.rand(r, generator=gen)
            tok = tok_all[:r]
            a = ce._fill_args(layer, x, tok, ids, wts, out)
            tn = ce._native.timed_forward(a) if ce._native is not None else float("nan")
            layer2 = (it + len(layers) // 2) % len(layers)
            tp = timed(lambda: ce.forward(layer2, x, tok, ids, wts, out))
            if it >= 10:
                native.append(tn)
                python.append(tp)
        if not args.no_torch and r in (1, k):
            for it in range(min(args.iters, 30)):
                ids = torch.randperm(E, generator=gen)[:r].int()
                wts = torch.rand(r, generator=gen)
                ref.append(timed(lambda: torch_bf16_experts(layers[it % len(layers)], x, tok_all[:r], ids, wts, out)))
        rows.append({"r": r, "median_ms": statistics.median(native) * 1e3, "p90_ms": pct(native, 0.9) * 1e3,
                     "python_median_ms": statistics.median(python) * 1e3,
                     "gbps": r * expert_bytes / statistics.median(native) / 1e9 if r else 0.0,
                     "torch_bf16_ms": statistics.median(ref) * 1e3 if ref else None})
    return rows


def bench_prefill(ce, layers, args, gen, expert_bytes, T: int, isa: str):
    E, D, F, k = args.experts, args.hidden, args.ffn, args.topk
    x = torch.randn(T, D, generator=gen).bfloat16()
    out = torch.empty(T, D, dtype=torch.float32)
    tok, ids, wts = topk_routes(T, E, k, args.hot_fraction, gen)
    ce.set_isa(isa)
    times = []
    for it in range(args.prefill_iters + 1):
        t = timed(lambda: ce.forward(it % len(layers), x, tok, ids, wts, out))
        if it:
            times.append(t)
    stats = ce.last_stats()
    ref = []
    if not args.no_torch:
        for it in range(max(1, args.prefill_iters // 2)):
            ref.append(timed(lambda: torch_bf16_experts(layers[it % len(layers)], x, tok, ids, wts, out)))
    ms = statistics.median(times) * 1e3
    distinct = int(torch.unique(ids).numel())
    ends = [e / 1e3 for e in stats.get("phase_end_us", ())]  # ms from submit, -1: no such phase
    phases, last = [], 0.0
    for e in ends:
        phases.append(round(e - last, 3) if e >= 0 else 0.0)
        last = e if e >= 0 else last
    return {"T": T, "isa": stats.get("isa"), "routes": int(tok.numel()), "experts": distinct,
            "phase_ms": phases,
            "amx_experts": stats.get("amx_experts"), "ms": ms,
            "gbps": distinct * expert_bytes / (ms / 1e3) / 1e9,
            "tflops": 6 * D * F * tok.numel() / (ms / 1e3) / 1e12,
            "torch_bf16_ms": statistics.median(ref) * 1e3 if ref else None}


def accuracy(ce, layers, gen, args) -> dict:
    res = {}
    for T in (1, 32):
        x = torch.randn(T, args.hidden, generator=gen).bfloat16()
        tok, ids, wts = topk_routes(T, args.experts, args.topk, 0.0, gen)
        got = ce.forward(0, x, tok, ids, wts)
        ref = torch_reference(layers[0].w13, layers[0].w2, x, tok, ids, wts)
        res[f"rel_err_T{T}"] = float((got - ref).norm() / ref.norm())
    return res


def main() -> None:
    args = parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    hw = hardware()
    E, D, F = args.experts, args.hidden, args.ffn
    expert_bytes = 3 * D * F * 2
    layer_bytes = E * expert_bytes
    if args.layers is None:
        want = math.ceil(8 * l3_bytes() / layer_bytes)
        fit = int(0.5 * meminfo_bytes("MemAvailable") // layer_bytes)
        args.layers = max(2, min(want, fit))
    threads = args.threads or max(1, hw["physical_cores"] - 1)
    torch.set_num_threads(threads + 1)

    bw = read_bandwidth(args.bw_gib)
    layers = make_layers(args.layers, E, D, F, gen)
    ce = CpuExperts(layers, num_threads=threads, backend="auto", isa=args.isa, spin_us=args.spin_us,
                    amx_min_tokens=args.amx_min_tokens)
    if ce.backend == "native":
        for a in ce._args.values():
            a.prefetch = not args.no_prefetch
    if ce.backend != "native":
        print(f"native kernels unavailable ({ce.fallback_reason}); timing the torch fallback")
    feats = ce.cpu_features
    print(f"{hw['cpu']}: {hw['physical_cores']} cores, L3 {hw['l3_mib']} MiB, features {feats}")
    print(f"read bandwidth {bw:.1f} GB/s; {args.layers} layers x {E} experts = "
          f"{args.layers * layer_bytes / 2**30:.1f} GiB; {threads} workers + the waiting thread")

    acc = accuracy(ce, layers, gen, args)
    t_max = max(int(t) for t in args.prefill.split(","))
    ce.reserve(max_routes=args.topk * t_max, max_tokens=t_max)
    floor_ms = expert_bytes / (bw * 1e9) * 1e3
    dec, gamma0, alpha, beta = [], float("nan"), float("nan"), float("nan")
    if not args.skip_decode:
        dec = bench_decode(ce, layers, args, gen, expert_bytes)
        gamma0 = dec[0]["median_ms"]
        alpha, beta = fit_line([d["r"] for d in dec[1:]], [d["median_ms"] for d in dec[1:]])

    print(f"\ndecode, 1 token (expert {expert_bytes / 1e6:.1f} MB; bandwidth floor {floor_ms:.3f} ms/expert)")
    print(f"{'r':>3} {'native ms':>10} {'p90 ms':>8} {'python ms':>10} {'GB/s':>7} {'of bw':>6} {'torch bf16 ms':>14}")
    for d in dec:
        tb = f"{d['torch_bf16_ms']:.3f}" if d["torch_bf16_ms"] else "-"
        print(f"{d['r']:>3} {d['median_ms']:>10.3f} {d['p90_ms']:>8.3f} {d['python_median_ms']:>10.3f} "
              f"{d['gbps']:>7.1f} {d['gbps'] / bw:>6.0%} {tb:>14}")
    print(f"fit: gamma0 = {gamma0:.4f} ms, alpha = {alpha:.4f} ms, beta = {beta:.4f} ms/route")

    pre = []
    isas = [args.isa]
    if feats.get("amx") and args.isa in ("auto", "amx"):
        isas.append("avx512_bf16")
    for T in [int(t) for t in args.prefill.split(",")]:
        for isa in isas:
            pre.append(bench_prefill(ce, layers, args, gen, expert_bytes, T, isa))
    ce.set_isa(args.isa)
    print(f"\nprefill, all routes cold (hot fraction {args.hot_fraction})")
    print(f"{'T':>5} {'isa':>12} {'routes':>7} {'experts':>8} {'amx':>4} {'ms':>9} {'GB/s':>7} {'TFLOP/s':>8} "
          f"{'torch bf16 ms':>14}  phases ms (prepare, gate/up, down, reduce)")
    for p in pre:
        tb = f"{p['torch_bf16_ms']:.1f}" if p["torch_bf16_ms"] else "-"
        print(f"{p['T']:>5} {p['isa']:>12} {p['routes']:>7} {p['experts']:>8} {p['amx_experts']:>4} {p['ms']:>9.2f} "
              f"{p['gbps']:>7.1f} {p['tflops']:>8.2f} {tb:>14}  {p['phase_ms']}")
    print(f"accuracy vs fp32 torch oracle: {acc}")

    print(json.dumps({
        "bench": "cpu_experts", **source_state(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware": {**hw, "features": feats, "read_gbps": round(bw, 2)},
        "config": {"experts": E, "hidden": D, "ffn": F, "topk": args.topk, "layers": args.layers,
                   "threads": threads, "isa": args.isa, "backend": ce.backend, "spin_us": args.spin_us,
                   "iters": args.iters, "hot_fraction": args.hot_fraction, "torch": torch.__version__,
                   "prefetch": not args.no_prefetch, "amx_min_tokens": args.amx_min_tokens},
        "decode": {"rows": dec, "gamma0_ms": gamma0, "alpha_ms": alpha, "beta_ms": beta,
                   "floor_ms_per_expert": floor_ms},
        "prefill": pre, "accuracy": acc,
    }))


if __name__ == "__main__":
    main()
