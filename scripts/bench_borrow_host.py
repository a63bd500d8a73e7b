"""Host time of borrowed memory between decode steps (layers/moe/borrow.py), at the 30B Q4_K_M
file's shape: 48 MoE layers of 128 experts in two pools (24 layers each), about half the experts
resident, 75 flex slots a pool. The experts are tiny, so the copies cost next to nothing and what
is timed is the host's work: scoring's decay, the rebalance's choice, the copies' issue and the
switches of both branches' tables.

Each turn is a prefill (every borrowed expert returned) and then STEPS decode steps whose routes
favour a few cold experts a layer; the time of `end_step` is taken at every step. Printed: the
first rebalance after a prefill (it fills the returned slots), the later ones (replacements), and
the mean over all steps, which is what a decode step pays on average.

    python scripts/bench_borrow_host.py [--turns 6] [--steps 64]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ostinato.layers.moe.borrow import Borrowing  # noqa: E402
from ostinato.layers.moe.cpu_experts import CpuExperts  # noqa: E402
from ostinato.layers.moe.hybrid import HybridExperts  # noqa: E402
from ostinato.layers.moe.pool import ExpertPool, ExpertPools, HostExperts  # noqa: E402
from ostinato.layers.moe.types import ExpertWeights  # noqa: E402

L, E, K, D, F = 48, 128, 8, 16, 8


def build(hot_per_layer: int, flex: int, seed: int = 0) -> HybridExperts:
    g = torch.Generator().manual_seed(seed)
    hot = {l: torch.randperm(E, generator=g)[:hot_per_layer].tolist() for l in range(L)}
    cold = {l: sorted(set(range(E)) - set(hot[l])) for l in range(L)}
    halves = [range(0, L // 2), range(L // 2, L)]
    pools = ExpertPools([ExpertPool({l: hot[l] for l in h}, L, E, K, flex, (2 * F, D), (D, F), "cpu", torch.float32)
                         for h in halves])
    host = HostExperts(cold, E, (2 * F, D), (D, F), torch.float32)
    for l in range(L):
        w = ExpertWeights(torch.randn(E, 2 * F, D, generator=g), torch.randn(E, D, F, generator=g))
        pools.fill_layer(l, w)
        host.fill_layer(l, w)
    cpu = CpuExperts(host.layers, num_threads=1, backend="torch")
    return HybridExperts(pools, host, cpu, 10**9, max_tokens=16)


def main(argv: list[str] | None = None) -> dict:
    """-> the borrowing's counters and the timings (ms)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--hot", type=int, default=62, help="resident experts a layer")
    p.add_argument("--flex", type=int, default=75, help="flex slots a pool")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    hybrid = build(a.hot, a.flex)
    b = hybrid.borrow = Borrowing(hybrid)
    g = torch.Generator().manual_seed(1)
    cold = {l: (hybrid.host.compact[l] >= 0).nonzero().flatten() for l in range(L)}
    first, later, every = [], [], []
    for turn in range(a.turns):
        hybrid.before_prefill()
        b.steps = 0
        # each turn favours other cold experts, so replacements keep happening as in a replay
        favour = {l: c[torch.randperm(len(c), generator=g)[:12]] for l, c in cold.items()}
        for step in range(a.steps):
            for l in range(L):
                pick = favour[l][torch.randint(len(favour[l]), (K,), generator=g)]
                b.observe(l, pick.unique()[None])
            t = time.perf_counter()
            hybrid.after_decode_step()
            ms = (time.perf_counter() - t) * 1e3
            every.append(ms)
            if b.steps % b.every == 0:
                (first if b.steps == b.every else later).append(ms)
    c = b.counters
    print(f"{L} layers x {E} experts, two pools of {a.flex} flex slots, {a.hot} resident a layer; "
          f"{a.turns} turns x {a.steps} steps, a rebalance every {b.every}")
    print(f"first rebalance after a prefill: median {statistics.median(first):.3f} ms ({len(first)})")
    print(f"later rebalances: median {statistics.median(later):.3f} ms, max {max(later):.3f} ms ({len(later)})")
    print(f"end_step over every step: mean {statistics.fmean(every):.3f} ms")
    print(f"borrowed {c['borrowed']}, replaced {c['replaced']}, returned {c['returned']}")
    return {**c, "first_ms": first, "later_ms": later, "every_ms": every}


if __name__ == "__main__":
    main()
