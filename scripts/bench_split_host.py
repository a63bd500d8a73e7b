"""The host's share of a split pass with uploads, per MoE layer: the work between the routing
reaching the host and the branches' launches, while the GPU waits (split_path's upload_plan,
flex_slots, cpu_routes and the CPU experts' count). No GPU is needed: it times the module's own
host functions on a routing shaped like Qwen3-30B-A3B's (128 experts, top-8, half of them cold).
With --uploads N, also the host's time to issue N experts' copies (ExpertPool.upload) between
CPU tensors of a few bytes, so that what is timed is the issuing, not the copying (on CUDA each
copy adds the runtime's own call).

    python scripts/bench_split_host.py [--tokens 64 256 1024] [--experts 128] [--top-k 8] [--uploads 30]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from ostinato.layers.moe.hybrid import MixedPass, cpu_routes, flex_slots, upload_plan

# session 24's calibration of the 30B Q4_K_M file on the H200 machine: upload ms per expert and
# the CPU pass's fit (alpha, per expert, per route)
COSTS = MixedPass(upload_ms=0.056, alpha_ms=0.334, beta_expert_ms=0.0113, beta_route_ms=0.00895)


def host_part(ids: np.ndarray, weights: torch.Tensor, compact: np.ndarray, num_experts: int, flex: int,
              zero: np.ndarray) -> int:
    """What split_path does on the host for one layer before its branches launch; -> the experts uploaded."""
    cid = compact[ids]
    cold = cid >= 0
    up = upload_plan(ids, cold, num_experts, COSTS.choose, flex)
    _, cold = flex_slots(ids, cold, up, range(flex - len(up), flex), zero)
    cpu_routes(cid, cold, weights)
    np.count_nonzero(np.bincount(cid[cold]))
    return len(up)


def upload_us(n: int, experts: int) -> float:
    """Host time (us) an expert of ExpertPool.upload over n experts, median of 9 batches of 100 calls."""
    from ostinato.layers.moe.pool import ExpertPool, HostExperts

    shape13, shape2 = (2, 8), (8, 1)  # a few bytes an expert: the copies themselves cost nothing
    pool = ExpertPool({0: []}, 1, experts, 8, n, shape13, shape2, "cpu", torch.float32)
    host = HostExperts({0: list(range(experts))}, experts, shape13, shape2, torch.float32)
    slots, cold = list(range(pool.flex_lo, pool.flex_lo + n)), list(range(0, 2 * n, 2))
    batches = []
    for i in range(10):
        t0 = time.perf_counter()
        for _ in range(100):
            pool.upload(slots, host, 0, cold)
        if i:  # the first batch makes the views
            batches.append((time.perf_counter() - t0) / 100 / n * 1e6)
    return sorted(batches)[4]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--flex", type=int, default=160, help="flex slots of the layer's pool")
    p.add_argument("--repeats", type=int, default=500)
    p.add_argument("--uploads", type=int, default=0, help="also time issuing this many experts' copies")
    a = p.parse_args()
    if a.uploads:
        print(f"issuing {a.uploads} experts' copies: {upload_us(a.uploads, a.experts):.1f} us per expert on the host")
    rng = np.random.default_rng(0)
    compact = np.full(a.experts, -1, dtype=np.int64)  # every other expert cold
    compact[::2] = np.arange(len(compact[::2]))
    zero = np.arange(a.top_k, dtype=np.int32)
    for t in a.tokens:
        # skewed routing: a Zipf-like preference over the experts, K distinct per token
        pref = 1.0 / np.arange(1, a.experts + 1) ** 0.8
        ids = np.stack([rng.choice(a.experts, a.top_k, replace=False, p=pref / pref.sum()) for _ in range(t)])
        weights = torch.rand(t, a.top_k)
        for _ in range(20):
            k = host_part(ids, weights, compact, a.experts, a.flex, zero)
        batches = []  # the median of 9 batches: this 2-core host's other work moves single means by 30%
        for _ in range(9):
            t0 = time.perf_counter()
            for _ in range(a.repeats // 9 + 1):
                host_part(ids, weights, compact, a.experts, a.flex, zero)
            batches.append((time.perf_counter() - t0) / (a.repeats // 9 + 1) * 1e6)
        us = sorted(batches)[4]
        print(f"{t:5d} tokens: {us:7.1f} us per layer on the host, median of 9 batches ({k} experts uploaded)")


if __name__ == "__main__":
    main()
