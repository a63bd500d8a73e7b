"""Bandwidth of the quantized CPU experts (GGUF blocks read in place) at Qwen3-30B-A3B shapes.

Legend: r cold routes of one token, E experts, D hidden, F expert FFN size.

The target is decode: one token per expert reads every weight byte once, so the kernels
should run at the memory's speed. The bound is measured by a plain read probe on the same
threads (ColdExperts.read_seconds: the pool's workers plus the waiting thread sum a buffer
in 1 MiB tasks), and the probe and each format's decode alternate round by round, because a
shared host's bandwidth drifts with its neighbours' load: each round's ratio compares
measurements taken seconds apart, and the report gives the median round. Threads are placed
as the engine places them (ostinato/threads.py): workers pinned, the waiting thread on the host
CPUs; left to the scheduler, the waiting thread sometimes shared a pinned worker's core and a
call took twice as long (2-core host).

  decode   one token, r = topk routes (and r = 1), experts cycled through a layer larger
           than the last-level cache so that every call reads from memory; GB/s of weight
           bytes = r * expert bytes / median time;
  prefill  T tokens with top-k routing (compute-bound), about T * topk / E routes an expert; with
           --amx-quant N,..., also with experts of at least N routes on the AMX tiles (their rows
           decoded to bf16 once a call: ColdArgs.amx_quant_min_tokens), against the row kernels,
           and the rate of that decoding on one core (G values a second, the AVX-512 build); with
           --amx-int8 N,..., also with the Q4_K / Q6_K projections of experts of at least N routes on
           the AMX int8 tiles (ColdArgs.amx_int8_min_tokens: the row kernels' integers, 16 x 16 at once);
  accuracy native vs quant_reference (same activation quantization, only summation order
           differs), and vs unquantized activations (the int8 activations' own error).

Prints a table, and last one JSON line.

  python scripts/bench_cpu_quant.py                       # every format, 5 rounds
  python scripts/bench_cpu_quant.py --formats Q4_K,Q4_K/Q6_K --rounds 9
  python scripts/bench_cpu_quant.py --formats Q4_K/Q6_K --rounds 1 --prefill 16,64,128,256,512 --amx-quant 1
  python scripts/bench_cpu_quant.py --formats Q4_K/Q6_K --rounds 1 --prefill 64,256 --amx-int8 2,8
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import mmap
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout, not installed
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cpu_experts import hardware, l3_bytes, meminfo_bytes, topk_routes

from ostinato.bench.report import source_state
from ostinato.threads import claim_host_thread, process_layout
from ostinato.kernels.cpu.build import load_cpu_extension
from ostinato.layers.moe.cpu_experts import QTYPE_CODES, CpuExperts, quant_reference, torch_reference
from ostinato.layers.moe.types import QuantExpertWeights
from ostinato.quant import formats

FORMATS = "Q4_K,Q5_K,Q6_K,Q8_0,MXFP4,Q4_K/Q6_K"  # a/b: gate/up a, down b (Q4_K_M's mix)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default=FORMATS, help="comma-separated qtypes, a/b for gate-up a, down b")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="pool workers (default: physical cores - 1)")
    p.add_argument("--rounds", type=int, default=5, help="probe / decode rounds per format")
    p.add_argument("--iters", type=int, default=40, help="decode calls per round")
    p.add_argument("--probe-mib", type=int, default=1024, help="bytes the read probe sums per call")
    p.add_argument("--prefill", default="32,128", help="prefill token counts ('' for none)")
    p.add_argument("--amx-quant", default="", help="prefill again with these amx_quant_min_tokens (comma-separated; "
                   "needs AMX); 0, the row kernels alone, always runs")
    p.add_argument("--amx-int8", default="", help="prefill again with these amx_int8_min_tokens (comma-separated)")
    p.add_argument("--spin-us", type=int, default=2000)
    p.add_argument("--no-prefetch", action="store_true", help="turn the kernels' software prefetch off")
    p.add_argument("--prefetch-kib", default="1", help="how far ahead of each row stream the kernels prefetch "
                   "(each line, and the next page's head for the hardware prefetcher), to sweep (KiB, "
                   "comma-separated; the engine's default is 1): "
                   "each format's decode is measured at each, rows FORMAT@NKiB")
    p.add_argument("--huge-pages", action="store_true", help="put the experts and the probe's buffer in memory "
                   "advised for transparent huge pages (madvise MADV_HUGEPAGE), to see what the TLB costs")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """t's bytes in an anonymous mapping advised for transparent huge pages (2 MiB aligned), same
    shape and dtype; the mapping lives as long as the tensor (torch.frombuffer keeps it)."""
    n, align = t.numel() * t.element_size(), 2 << 20
    mm = mmap.mmap(-1, n + align)
    mm.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(mm, dtype=torch.uint8)
    off = (-base.data_ptr()) % align
    out = base[off:off + n].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def huge_pages_state() -> str:
    """The kernel's transparent huge page setting (the bracketed word), or 'unknown'."""
    try:
        s = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return s[s.index("[") + 1:s.index("]")] if "[" in s else s.strip()


def random_blocks(qt: str, rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [rows, row_bytes(qt, n)]: random bytes with the block scales set to small sane
    values (random fp16 scales can be inf or NaN; the values do not matter for timing)."""
    K, B = formats.block_size(qt), formats.block_bytes(qt)
    b = torch.randint(0, 256, (rows, n // K, B), dtype=torch.uint8, generator=gen)

    def f16(lo: float, hi: float) -> torch.Tensor:
        return (lo + (hi - lo) * torch.rand(rows, n // K, generator=gen)).half().unsqueeze(-1).view(torch.uint8)

    if qt == "Q8_0":
        b[..., 0:2] = f16(1e-3, 1e-2)
    elif qt in ("Q4_K", "Q5_K"):
        b[..., 0:2] = f16(1e-3, 4e-3)
        b[..., 2:4] = f16(1e-3, 4e-3)
    elif qt == "Q6_K":
        b[..., 208:210] = f16(1e-3, 4e-3)
    elif qt == "MXFP4":
        b[..., 0] = torch.randint(118, 126, (rows, n // K), dtype=torch.uint8, generator=gen)
    return b.view(rows, -1)


def make_layer(qt13: str, qt2: str, E: int, D: int, F: int, gen: torch.Generator) -> QuantExpertWeights:
    w13 = random_blocks(qt13, E * 2 * F, D, gen).view(E, 2 * F, -1)
    w2 = random_blocks(qt2, E * D, F, gen).view(E, D, -1)
    return QuantExpertWeights(qt13, w13, qt2, w2)


def probe_gbps(ce: CpuExperts, buf: torch.Tensor) -> float:
    return buf.numel() * buf.element_size() / ce.read_seconds(buf) / 1e9


def decode_times(ce: CpuExperts, w: QuantExpertWeights, r: int, iters: int, start: int, gen) -> list[float]:
    """Seconds per call of one token with r routes; experts cycle through the layer so that a
    call's experts were last read E / r calls ago (out of every cache)."""
    E, D = w.num_experts, w.hidden
    x = torch.randn(1, D, generator=gen).bfloat16()
    out = torch.empty(1, D)
    tok = torch.zeros(r, dtype=torch.int32)
    wts = torch.rand(r, generator=gen)
    times = []
    for it in range(iters):
        ids = ((start + it) * r + torch.arange(r, dtype=torch.int32)) % E
        times.append(ce._native.timed_forward(ce._fill_args(0, x, tok, ids, wts, out)))
    return times


def bench_format(ce: CpuExperts, w: QuantExpertWeights, probe: torch.Tensor, args, gen) -> dict:
    eb = w.expert_bytes
    r = args.topk
    decode_times(ce, w, r, 10, 0, gen)  # warm-up: pages, workspace
    rounds, start = [], 10
    for _ in range(args.rounds):
        bw = probe_gbps(ce, probe)
        t = statistics.median(decode_times(ce, w, r, args.iters, start, gen))
        start += args.iters
        t1 = statistics.median(decode_times(ce, w, 1, args.iters, start * r, gen))
        start += args.iters
        bw_after = probe_gbps(ce, probe)
        probe_mean = (bw + bw_after) / 2
        rounds.append({"probe_gbps": probe_mean, "ms": t * 1e3, "gbps": r * eb / t / 1e9,
                       "ms_r1": t1 * 1e3, "gbps_r1": eb / t1 / 1e9,
                       "of_probe": r * eb / t / 1e9 / probe_mean, "of_probe_r1": eb / t1 / 1e9 / probe_mean})
    med = sorted(rounds, key=lambda x: x["of_probe"])[len(rounds) // 2]
    return {"expert_mb": eb / 1e6, "rounds": rounds, "median_round": med,
            "of_probe_median": statistics.median(x["of_probe"] for x in rounds),
            "of_probe_r1_median": statistics.median(x["of_probe_r1"] for x in rounds),
            "probe_gbps_median": statistics.median(x["probe_gbps"] for x in rounds),
            "gbps_median": statistics.median(x["gbps"] for x in rounds)}


def bench_prefill(ce: CpuExperts, w: QuantExpertWeights, T: int, amx_min: int, args, gen, int8_min: int = 0) -> dict:
    ce._args[0].amx_quant_min_tokens = amx_min
    ce._args[0].amx_int8_min_tokens = int8_min
    x = torch.randn(T, w.hidden, generator=gen).bfloat16()
    tok, ids, wts = topk_routes(T, w.num_experts, args.topk, 0.0, gen)
    out = torch.empty(T, w.hidden)
    times = []
    for it in range(3):
        t0 = time.perf_counter()
        ce.forward(0, x, tok, ids, wts, out)
        if it:
            times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    experts = int(torch.unique(ids).numel())
    stats = ce.last_stats()
    ce._args[0].amx_quant_min_tokens = ce._args[0].amx_int8_min_tokens = 0
    return {"T": T, "amx_quant_min_tokens": amx_min, "amx_experts": stats["amx_experts"],
            "amx_int8_min_tokens": int8_min, "int8_experts": stats["int8_experts"],
            "routes": int(tok.numel()), "experts": experts, "ms": ms,
            "gbps": experts * w.expert_bytes / (ms / 1e3) / 1e9,
            "tflops": 6 * w.hidden * w.ffn * tok.numel() / (ms / 1e3) / 1e12}


def decode_rate(w: QuantExpertWeights) -> dict:
    """G values a second that the AMX path's decoding (rows to bf16) reaches on this thread, over
    8 experts' rows (from cache after the first pass: the decoding's own speed); without AVX-512,
    dequant.h's portable build."""
    ext = load_cpu_extension()
    avx512 = ext.cpu_features()["avx512"]
    rates = {"build": "avx512" if avx512 else "portable"}
    for name, qt, rows, n in (("w13", w.qt13, w.w13[:8], w.hidden), ("w2", w.qt2, w.w2[:8], w.ffn)):
        src = rows.reshape(-1, rows.shape[-1]).contiguous()
        out = torch.empty(src.shape[0], n, dtype=torch.bfloat16)
        times = []
        for it in range(4):
            t0 = time.perf_counter()
            ext.dequant_rows_bf16(QTYPE_CODES[qt], src.data_ptr(), src.shape[0], n, out.data_ptr(), avx512)
            if it:
                times.append(time.perf_counter() - t0)
        rates[name] = {"qtype": qt, "gvalues_s": out.numel() / statistics.median(times) / 1e9}
    return rates


def accuracy(ce: CpuExperts, w: QuantExpertWeights, args, gen) -> dict:
    """On the first 16 experts (dequantizing the whole layer would take long)."""
    E = min(16, w.num_experts)
    x = torch.randn(8, w.hidden, generator=gen).bfloat16()
    tok, ids, wts = topk_routes(8, E, min(args.topk, E), 0.0, gen)
    got = ce.forward(0, x, tok, ids, wts)
    ref = quant_reference(w, x, tok, ids, wts)
    D, F = w.hidden, w.ffn
    w13 = formats.dequantize(w.w13[:E], w.qt13, D)
    w2 = formats.dequantize(w.w2[:E], w.qt2, F)
    unq = torch_reference(w13, w2, x, tok, ids, wts, h_dtype=torch.bfloat16)
    return {"vs_quant_reference": float((got - ref).norm() / ref.norm()),
            "vs_unquantized_activations": float((got - unq).norm() / unq.norm())}


def main() -> None:
    args = parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    hw = hardware()
    E, D, F = args.experts, args.hidden, args.ffn
    threads = args.threads or max(1, hw["physical_cores"] - 1)
    layout = process_layout(cpu_threads=threads)
    probe_mib = min(args.probe_mib, int(meminfo_bytes("MemAvailable") / 8 / 2**20))
    probe = torch.ones(probe_mib << 18, dtype=torch.float32)  # MiB -> fp32 elements
    if args.huge_pages:
        probe = huge_page_copy(probe)
    results, pre, acc, dec = {}, {}, {}, {}
    ce = None
    for spec in args.formats.split(","):
        qt13, _, qt2 = spec.partition("/")
        qt2 = qt2 or qt13
        w = make_layer(qt13, qt2, E, D, F, gen)
        if args.huge_pages:
            w = w._replace(w13=huge_page_copy(w.w13), w2=huge_page_copy(w.w2))
        if E * w.expert_bytes < 8 * l3_bytes():
            print(f"note: a layer of {spec} ({E * w.expert_bytes / 2**20:.0f} MiB) is less than 8x the L3; "
                  "raise --experts for cold reads")
        ce = CpuExperts([w], backend="native", cpus=layout.workers, spin_us=args.spin_us)
        claim_host_thread(layout)  # the waiting thread on the host CPUs, off the workers' cores, as the engine runs
        ce._args[0].prefetch = not args.no_prefetch
        ce.reserve(max_routes=args.topk * 128, max_tokens=128)
        distances = [int(k) for k in args.prefetch_kib.split(",")]
        for kib in distances:
            ce._args[0].prefetch_bytes = kib << 10
            results[spec if len(distances) == 1 else f"{spec}@{kib}KiB"] = bench_format(ce, w, probe, args, gen)
        ce._args[0].prefetch_bytes = distances[0] << 10
        paths = [(0, 0)] + [(int(n), 0) for n in args.amx_quant.split(",") if n] + \
            [(0, int(n)) for n in args.amx_int8.split(",") if n]
        pre[spec] = [bench_prefill(ce, w, int(T), a, args, gen, i) for T in args.prefill.split(",") if T
                     for a, i in paths]
        acc[spec] = accuracy(ce, w, args, gen)
        if args.amx_quant:
            dec[spec] = decode_rate(w)
        ce.close()
        del w, ce

    print(f"{hw['cpu']}: {hw['physical_cores']} cores, L3 {hw['l3_mib']} MiB; {threads} workers + the waiting thread")
    print(f"\ndecode, 1 token x {args.topk} routes (medians of {args.iters} calls; round = probe, decode, probe)")
    print(f"{'format':>16} {'expert MB':>9} {'probe GB/s':>10} {'GB/s':>7} {'of probe':>8} {'ms':>7} "
          f"{'r=1 GB/s':>8} {'r=1 of probe':>12}   per-round fraction (r = {args.topk})")
    for spec, r in results.items():
        m = r["median_round"]
        fr = " ".join(f"{x['of_probe']:.2f}" for x in r["rounds"])
        print(f"{spec:>16} {r['expert_mb']:>9.2f} {m['probe_gbps']:>10.1f} {m['gbps']:>7.1f} {m['of_probe']:>8.0%} "
              f"{m['ms']:>7.3f} {m['gbps_r1']:>8.1f} {r['of_probe_r1_median']:>12.0%}   {fr}")
    if any(pre.values()):
        print("\nprefill (top-k routing, every route cold)")
        for spec, rows in pre.items():
            for p in rows:
                path = f"AMX from {p['amx_quant_min_tokens']} routes ({p['amx_experts']} experts)" \
                    if p["amx_quant_min_tokens"] else \
                    f"AMX int8 from {p['amx_int8_min_tokens']} routes ({p['int8_experts']} experts)" \
                    if p["amx_int8_min_tokens"] else "row kernels"
                print(f"{spec:>11} T={p['T']:>4} {p['routes']:>5} routes {p['experts']:>4} experts {p['ms']:>8.1f} ms "
                      f"{p['gbps']:>6.1f} GB/s {p['tflops']:>6.3f} TFLOP/s  {path}")
    for spec, r in dec.items():
        print(f"{spec:>11} decoding to bf16 (one core, {r['build']} build): " +
              ", ".join(f"{k} {v['qtype']} {v['gvalues_s']:.2f} G values/s" for k, v in r.items() if k != "build"))
    print("\naccuracy (relative error of the layer output)")
    for spec, a in acc.items():
        print(f"{spec:>11} vs quant_reference {a['vs_quant_reference']:.1e}, "
              f"vs unquantized activations {a['vs_unquantized_activations']:.1e}")

    print(json.dumps({
        "bench": "cpu_quant", **source_state(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "hardware": hw,
        "config": {"experts": E, "hidden": D, "ffn": F, "topk": args.topk, "threads": threads,
                   "rounds": args.rounds, "iters": args.iters, "probe_mib": probe_mib,
                   "prefetch": not args.no_prefetch, "prefetch_kib": args.prefetch_kib, "torch": torch.__version__,
                   "huge_pages": args.huge_pages, "thp": huge_pages_state()},
        "decode": results, "prefill": pre, "accuracy": acc, "amx_decoding": dec,
        "of_probe_min_median": min((r["of_probe_median"] for r in results.values()), default=math.nan),
        "of_probe_r1_min_median": min((r["of_probe_r1_median"] for r in results.values()), default=math.nan),
    }))


if __name__ == "__main__":
    main()
