"""How fast can a GPU kernel read page-locked host memory itself, over PCIe, against a copy engine's
memcpy of the same bytes? A question for captured prefill passes (engine/graph.py PassGraphs).

Why: a captured pass of 128-255 tokens waits on the CPU branch (session 38: the worker computed
245 of a 263 ms pass at 255 tokens, results/2026-12-06-h100-s38/), and a captured graph cannot
stage the pass's most-routed cold experts into flex slots as the host-driven split with uploads
does: which experts a pass needs is known on the device only. A kernel could instead read those
experts' blocks where they lie, in the page-locked host copy (layers/moe/pool.py HostExperts),
through the same addresses (UVA), if it reads them near the link's pace. This times that read
alone: a kernel that loads every 4-byte word of a host buffer and sums them (the sums checked
against torch's), for several grid sizes, and two ways of cutting the buffer:
- contiguous: program p reads one contiguous segment (as a tile loop over one expert's rows);
- strided: chunk c goes to program c mod P (the grid-stride loop);
next to the same kernel over a device copy of the buffer (the kernel's own ceiling, in HBM) and a
host-to-device copy of the buffer by the copy engine (torch's copy_, a memcpy node when captured).
Every time is the median of --reps replays of a CUDA graph holding one call.

Usage: python scripts/bench_zero_copy.py [--mib 2.75 86 512] [--programs 132 264 528 1056 2112]
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
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ostinato.bench.report import source_state  # noqa: E402
from ostinato.kernels.triton.handshake import HostPointer  # noqa: E402
from scripts.bench_gpu_experts import replay_times  # noqa: E402


@triton.jit
def _read_sum(src, out, n_chunks, per, CHUNK: tl.constexpr, CONTIGUOUS: tl.constexpr):
    """out[p] = the int32 sum (wrapping) of the `per` chunks of CHUNK words that program p reads
    (those below n_chunks)."""
    p, P = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros((CHUNK,), dtype=tl.int32)
    for i in range(0, per):
        c = p * per + i if CONTIGUOUS else i * P + p
        acc += tl.load(src + c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK), mask=c < n_chunks, other=0)
    tl.store(out + p, tl.sum(acc, axis=0))


def read_sum(src, words: int, out: torch.Tensor, chunk: int, contiguous: bool, warps: int) -> None:
    """Launch _read_sum over `words` int32 words at src (a device tensor or a HostPointer), one
    program per entry of out; words must be a multiple of chunk."""
    n = words // chunk
    _read_sum[(out.numel(),)](src, out, n, triton.cdiv(n, out.numel()), CHUNK=chunk, CONTIGUOUS=contiguous,
                              num_warps=warps)


def wrapped(x: int) -> int:
    """x as a wrapping int32 sum leaves it."""
    return (x + 2**31) % 2**32 - 2**31


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, nargs="+", default=[2.75, 86.0, 512.0],
                    help="buffer sizes: one Q4_K_M expert of Qwen3-30B-A3B, about 30 of them, and more")
    ap.add_argument("--programs", type=int, nargs="+", default=[132, 264, 528, 1056, 2112])
    ap.add_argument("--chunk", type=int, nargs="+", default=[1024, 4096], help="int32 words a load step")
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_zero_copy times CUDA kernels: no GPU here")
    if min(a.programs) < 1 or min(a.chunk) < 1 or min(a.mib) <= 0 or a.reps < 1:
        raise SystemExit("--programs, --chunk, --mib and --reps must be positive")
    dev, rows = "cuda", []
    print(f"zero-copy reads of page-locked host memory, {torch.cuda.get_device_name()}")
    print(f"{'MiB':>8} {'source':>8} {'cut':>10} {'programs':>8} {'chunk':>6} {'us':>9} {'GB/s':>7}  check")
    for mib in a.mib:
        step = max(a.chunk)
        words = max(step, int(mib * 2**20) // 4 // step * step)
        host = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32).pin_memory()
        device = host.to(dev)
        want = wrapped(int(host.long().sum()))
        nbytes = words * 4
        sink = torch.empty(words, dtype=torch.int32, device=dev)

        def add(source, cut, programs, chunk, ms, ok):
            rows.append({"mib": nbytes / 2**20, "source": source, "cut": cut, "programs": programs, "chunk": chunk,
                         "us": ms * 1e3, "gbps": nbytes / ms / 1e6, "ok": ok})
            r = rows[-1]
            print(f"{r['mib']:8.2f} {source:>8} {cut:>10} {programs:>8} {chunk:>6} {r['us']:9.1f} {r['gbps']:7.2f}  "
                  f"{'ok' if ok else 'WRONG'}")

        times, _ = replay_times(lambda: sink.copy_(host, non_blocking=True), a.reps)
        add("memcpy", "-", 0, 0, statistics.median(times), bool(torch.equal(sink.cpu(), host)))
        for chunk in a.chunk:
            for programs in a.programs:
                out = torch.zeros(programs, dtype=torch.int32, device=dev)
                for source, src in (("host", HostPointer(host)), ("device", device)):
                    for contiguous in (True, False):
                        times, _ = replay_times(lambda: read_sum(src, words, out, chunk, contiguous, a.warps), a.reps)
                        got = wrapped(int(out.long().sum()))
                        add(source, "contiguous" if contiguous else "strided", programs, chunk,
                            statistics.median(times), got == want)
    best = {}
    for r in rows:
        if r["source"] != "device" and r["ok"]:
            key = (r["mib"], r["source"])
            best[key] = max(best.get(key, 0.0), r["gbps"])
    for (mib, source), g in sorted(best.items()):
        print(f"best {source} read of {mib:.2f} MiB: {g:.2f} GB/s")
    print(json.dumps({"bench": "zero_copy", **source_state(), "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "triton": triton.__version__, "warps": a.warps, "reps": a.reps,
                      "rows": rows}))


if __name__ == "__main__":
    main()
