"""Time the handshake's join of the CPU worker's partial (kernels/triton/handshake.py wait_add_rows) on
the GPU: the worker's fp32 rows [T, D] sit in page-locked, device-mapped host memory, and the join
waits for the done flag, copies them into device memory and adds them to the GPU branch's rows.

Per T, a CUDA graph of L joins, each over its own layer's buffers (as in a captured pass: one
join per MoE layer), with the flags set so that nothing spins; us = replay time / L. GB/s: the
partial's bytes (T * D * 4) over that time. Methods:
- join: wait_add_rows (the wait, the copy, the add);
- memcpy: its copy alone, for the link's pace.
The host wrote the partial long before the graph runs, so its lines are in no CPU cache; in a step
the worker stores them just before the join. So each method is timed a second time ("dirty"): a graph
of one join, the host rewriting that layer's partial before every replay (its lines then sit modified
in the CPU's caches, as the worker leaves them), the time per replay.
Session 38 (results/2026-12-06-h100-s38/, an H100) timed the join it replaced, an add kernel reading the
partial in mapped memory: 0.23-0.51 GB/s, 4.3-6.0 ms a layer at 255 rows, where this join took 0.06-0.10 ms.
Prints a table; the last line is one JSON document.
Usage: python scripts/bench_handshake.py [--tokens 1 8 32 64 255] [--hidden 2048] [--layers 48]
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
from ostinato.kernels.triton import handshake as hs  # noqa: E402
from scripts.bench_gpu_experts import replay_times  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 255])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=48)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_handshake times CUDA kernels: no GPU here")
    if min(a.tokens) < 1 or a.hidden < 1 or a.layers < 1:
        raise SystemExit("--tokens, --hidden and --layers must be at least 1")
    D, L, dev = a.hidden, a.layers, "cuda"
    rows = []
    print(f"handshake join, D={D}, {L} layers a graph, {torch.cuda.get_device_name()}")
    print(f"{'T':>5} {'method':>10} {'lines':>6} {'us':>9} {'GB/s':>7} {'err':>8}")
    for T in a.tokens:
        seq = torch.tensor([7], dtype=torch.int32, device=dev)
        count = torch.tensor([T], dtype=torch.int32, device=dev)
        flags = torch.zeros(L, 2, 16, dtype=torch.int32, pin_memory=True)
        flags[:, 0, 0] = 7  # has_cold = seq
        flags[:, 1, 0] = 7  # done = seq: nothing spins
        h_out = torch.randn(L, T, D, pin_memory=True)
        gpu = torch.randn(L, T, D, device=dev)
        y = torch.empty(L, T, D, device=dev, dtype=torch.bfloat16)
        staged = torch.empty(L, T, D, device=dev)
        want = (gpu + h_out.to(dev)).to(torch.bfloat16)
        H = [hs.HostPointer(h_out[i]) for i in range(L)]
        has = [hs.HostPointer(flags[i, 0, :1]) for i in range(L)]
        done = [hs.HostPointer(flags[i, 1, :1]) for i in range(L)]

        joins = [hs.CopyJoin(T, D, dev) for _ in range(L)]

        def join(i):
            hs.wait_add_rows(gpu[i], H[i], has[i], done[i], seq, count, y[i], joins[i])

        def memcpy(i):
            staged[i].copy_(h_out[i], non_blocking=True)

        for name, fn in (("join", join), ("memcpy", memcpy)):
            for lines in ("clean", "dirty"):
                n = L if lines == "clean" else 1  # dirty: one join a replay, its partial rewritten before
                y.zero_()
                times, _ = replay_times(lambda: [fn(i) for i in range(n)], 20,
                                        before=(lambda: h_out[0].mul_(1.0)) if lines == "dirty" else None)
                us = statistics.median(times) * 1e3 / n
                m = slice(0, n)
                got = staged[m].to(torch.bfloat16) if name == "memcpy" else y[m]  # memcpy: into staged
                ref = h_out[m].to(dev).to(torch.bfloat16) if name == "memcpy" else want[m]
                err = (got.float() - ref.float()).abs().max().item()
                gbps = T * D * 4 / us / 1e3
                rows.append(dict(tokens=T, method=name, lines=lines, us=us, gbps=gbps, max_abs_err=err))
                print(f"{T:>5} {name:>10} {lines:>6} {us:>9.2f} {gbps:>7.2f} {err:>8.1e}")
    print(json.dumps({"bench": "handshake_join", **source_state(), "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "triton": triton.__version__, "hidden": D, "layers": L,
                      "rows": rows}))


if __name__ == "__main__":
    main()
