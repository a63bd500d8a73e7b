"""Baselines that cache experts on the GPU: expert-cache (LRU) and decaying-cache.

Both keep every expert in page-locked host memory and use the budget (less the K zero
slots and one layer of staging slots) as a cache of expert slots shared by the MoE layers
of the GPU (an entry is a (layer, expert) copy). Experts keep their format (policies/base.py),
so there is a pool per format group, and a cache per pool: each pool has its own K zero and E
staging slots, and the bytes left after them are split over the groups in proportion to their
MoE layers (a Q4_K_M file's Q6_K-down layers get as many bytes per layer as its Q4_K ones, so
fewer slots); a group's entries evict only entries of the same group, whose slots have their
size. A float model is one group: one cache of (budget slots - K - E) slots, as before.
Passes the cache does not serve follow the `layers` rule for host experts: below the
offload threshold the CPU computes every routed expert; at or above it each expert the
pass uses is uploaded once into the staging slots and the layer runs on the GPU, cached
copies notwithstanding (llama.cpp's op-offload copies the weights of the whole op).

* `expert-cache` (llama.cpp's MoE cache, FreeToken's LRU): passes of at most
  `cache_max_tokens` (32) tokens use the cache. For each expert the pass routes to in a
  layer (in ascending id): a hit is served from its slot and becomes most recently used;
  a miss is uploaded into a free slot, or into the slot of the least recently used entry
  (evicted), and computed on the GPU, so the pass waits for the whole transfer. Entries
  used by the current pass are never evicted by it; a miss that finds no such slot (a
  budget smaller than one pass's experts) is uploaded into staging, not cached. The cache
  starts empty.
* `decaying-cache` (buun): only decode steps (1 token) use the cache. Every use adds 1 to
  the (layer, expert) score, and every score is multiplied by `decay` after each decode
  step. A routed expert in the cache is a hit; a miss is admitted when there is a free
  slot or when its score (after this use) exceeds the lowest score in the cache (that
  entry is evicted), then uploaded and computed on the GPU; otherwise the CPU computes it.
  Warm start from the development profile: score = decode routes per decode token /
  (1 - decay) (its steady state), and the cache holds the highest-scored experts before
  the first request.

The host-side state is numpy (views of the torch tensors the tests and reports read): a
decode step plans once per MoE layer between two graph segments, and torch's per-op
overhead on tensors of a few elements would be most of that host time.

Legend: E experts per layer, C cache slots, T tokens of a pass.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ostinato.policies.base import CPU, ModelExperts, PassPlan, SlotExperts, build_parts, check_fits, pools_bytes


def cache_slots(spec: ModelExperts, budget: int, name: str) -> dict:
    """Cache slots per format group (qtypes -> slots) from `budget` bytes: what is left after every
    group's K zero and E staging slots, split over the groups by their share of the MoE layers."""
    fixed = pools_bytes(spec, {}, spec.num_experts)  # K zero + E staging slots per group
    check_fits(spec, fixed, budget, name, "the zero and staging slots")
    L = len(spec.moe_layers)
    return {qt: (budget - fixed) * len(layers) // L // spec.expert_size(layers[0])
            for qt, layers in spec.groups().items()}


def _all_on_host(spec: ModelExperts, cache: dict, settings):
    every = list(range(spec.num_experts))
    flex = {qt: n + spec.num_experts for qt, n in cache.items()}  # the cache, then one layer of staging
    return build_parts(spec, {}, {l: every for l in spec.moe_layers}, flex, settings.cpu_backend)


class _CachePolicy(SlotExperts):
    def __init__(self, spec, pools, host, cpu, cache_slots: dict, offload_threshold: int):
        """cache_slots: per format group (qtypes) of `pools`, in the same order."""
        super().__init__(spec, pools, host, cpu)
        self.offload_threshold = offload_threshold
        self.capacity = sum(cache_slots.values())
        # per group g (index into pools.groups): its first cache slot and its free slots
        self.group = {l: g for g, p in enumerate(pools.groups) for l in p.layers}
        self.cache_lo = [p.flex_lo for p in pools.groups]
        self.sizes = [cache_slots[p.qtypes] for p in pools.groups]
        self.slot_of = torch.full((spec.num_layers, spec.num_experts), CPU, dtype=torch.int32)  # cached copies
        self._slot = self.slot_of.numpy()  # the same memory
        self.free = [list(range(lo, lo + n)) for lo, n in zip(self.cache_lo, self.sizes)]
        self._cpu = self.all_cpu_plan()

    def resident_experts(self) -> int:
        return self.capacity

    def cached(self, layer: int) -> list[int]:
        return np.flatnonzero(self._slot[layer] >= 0).tolist()

    def uses_cache(self, T: int) -> bool:
        raise NotImplementedError

    def static_plan(self, layer: int, T: int) -> PassPlan | None:
        if self.uses_cache(T) or T >= self.offload_threshold:
            return None
        return self._cpu

    def plan(self, layer: int, T: int, ids: torch.Tensor) -> PassPlan:
        if self.uses_cache(T):
            return self.cache_plan(layer, ids)
        return self.staging_plan(layer, ids)

    def _evict(self, layer_expert: tuple[int, int]) -> int:
        l, e = layer_expert
        slot = int(self._slot[l, e])
        self._slot[l, e] = CPU
        self.counters["evictions"] += 1
        return slot


class ExpertCachePolicy(_CachePolicy):
    name = "expert-cache"

    @classmethod
    def build(cls, spec: ModelExperts, budget: int, settings, counts=None) -> "ExpertCachePolicy":
        cache = cache_slots(spec, budget, cls.name)
        pool, host, cpu = _all_on_host(spec, cache, settings)
        return cls(spec, pool, host, cpu, cache, settings.offload_threshold, settings.cache_max_tokens)

    def __init__(self, spec, pool, host, cpu, cache_slots, offload_threshold, cache_max_tokens):
        super().__init__(spec, pool, host, cpu, cache_slots, offload_threshold)
        self.cache_max_tokens = cache_max_tokens
        # per group: least recently used first
        self.lru: list[OrderedDict[tuple[int, int], None]] = [OrderedDict() for _ in self.sizes]

    def uses_cache(self, T: int) -> bool:
        return T <= self.cache_max_tokens

    def cache_plan(self, layer: int, ids: torch.Tensor) -> PassPlan:
        used = sorted(set(ids.flatten().tolist()))
        row = self._slot[layer]
        g = self.group[layer]
        lru, free = self.lru[g], self.free[g]
        misses = []
        for e in used:
            if row[e] >= 0:
                lru.move_to_end((layer, e))
            else:
                misses.append(e)
        slot = row.copy()
        uploads = []
        staging = self.pools.of(layer).num_slots - self.spec.num_experts
        now = {(layer, e) for e in used}
        for e in misses:
            if free:
                s = free.pop()
            elif lru and next(iter(lru)) not in now:
                s = self._evict(lru.popitem(last=False)[0])
            else:  # every cached entry serves this pass: stage the expert without caching it
                s, staging = staging, staging + 1
                uploads.append((e, s))
                slot[e] = s
                continue
            row[e] = s
            lru[(layer, e)] = None
            uploads.append((e, s))
            slot[e] = s
        return self.plan_of(torch.from_numpy(slot), uploads)


class DecayingCachePolicy(_CachePolicy):
    name = "decaying-cache"

    @classmethod
    def build(cls, spec: ModelExperts, budget: int, settings, counts=None) -> "DecayingCachePolicy":
        cache = cache_slots(spec, budget, cls.name)
        pool, host, cpu = _all_on_host(spec, cache, settings)
        policy = cls(spec, pool, host, cpu, cache, settings.offload_threshold, settings.decay)
        if counts is not None:
            policy.warm(counts)
        return policy

    def __init__(self, spec, pool, host, cpu, cache_slots, offload_threshold, decay: float):
        super().__init__(spec, pool, host, cpu, cache_slots, offload_threshold)
        self.decay = decay
        # score = stored / gain: a step multiplies gain by 1/decay instead of every score by decay
        self.stored = torch.zeros((spec.num_layers, spec.num_experts), dtype=torch.float64)
        self._stored = self.stored.numpy()  # the same memory
        self.gain = 1.0
        self._last_layer = None
        # per group: the (layer * E + expert) each cache slot holds (-1: free): the eviction candidates
        self._owner = [np.full(n, -1, dtype=np.int64) for n in self.sizes]

    def uses_cache(self, T: int) -> bool:
        return T == 1

    def score(self, layer: int, expert: int) -> float:
        return float(self._stored[layer, expert]) / self.gain

    def _place(self, layer: int, expert: int, slot: int) -> None:
        self._slot[layer, expert] = slot
        g = self.group[layer]
        self._owner[g][slot - self.cache_lo[g]] = layer * self.spec.num_experts + expert

    def warm(self, counts) -> None:
        """Scores from the development profile's decode routes; the cache filled with the top ones."""
        tokens = max(1, counts.tokens.get("decode", 0))
        for l in self.spec.moe_layers:
            self.stored[l] = counts.decode[l].to(torch.float64) / tokens / max(1e-9, 1.0 - self.decay)
        order = torch.argsort(-self.stored.flatten(), stable=True)
        moe = set(self.spec.moe_layers)
        for i in order.tolist():
            if not any(self.free):
                break
            l, e = divmod(i, self.spec.num_experts)
            if l not in moe or self.stored[l, e] <= 0 or not self.free[self.group[l]]:
                continue
            s = self.free[self.group[l]].pop()
            self._place(l, e, s)
            self.pools.of(l).upload(s, self.host, l, e)

    def _step(self, layer: int) -> None:
        """A call to a layer at or before the previous one starts a new decode step."""
        if self._last_layer is not None and layer <= self._last_layer:
            self.gain /= self.decay
            if self.gain > 1e100:
                self._stored /= self.gain
                self.gain = 1.0
        self._last_layer = layer

    def cache_plan(self, layer: int, ids: torch.Tensor) -> PassPlan:
        self._step(layer)
        used = sorted(set(ids.flatten().tolist()))
        self._stored[layer, used] += self.gain
        row = self._slot[layer]
        slot = row.copy()
        uploads = []
        for e in used:
            if row[e] >= 0:
                continue
            s = self._admit(layer, e, keep=used)
            if s is not None:
                uploads.append((e, s))
                slot[e] = s
        return self.plan_of(torch.from_numpy(slot), uploads)

    def _admit(self, layer: int, expert: int, keep: list[int]) -> int | None:
        g = self.group[layer]
        if self.free[g]:
            s = self.free[g].pop()
        elif not self.sizes[g]:  # this group has no cache slots
            return None
        else:  # every slot of the group holds an entry: the lowest-scored one not serving this pass goes
            owner = self._owner[g]
            scores = self._stored.reshape(-1)[owner]
            mine = self._slot[layer, keep]
            scores[mine[mine >= 0] - self.cache_lo[g]] = np.inf  # the entries serving this pass stay
            low = scores.min()
            if not self._stored[layer, expert] > low:
                return None
            victim = int(owner[scores == low].min())  # ties: the lowest (layer, expert)
            s = self._evict(divmod(victim, self.spec.num_experts))
        self._place(layer, expert, s)
        return s
