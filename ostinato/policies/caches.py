"""Baselines that cache experts on the GPU: expert-cache (LRU) and decaying-cache.

Both keep every expert in page-locked host memory and use the budget (less the K zero
slots and one layer of staging slots, or where a layer's do not fit, engine/experts.py
baseline_staging's, filled in waves) as a cache of expert slots shared by the MoE layers
of the GPU (an entry is a (layer, expert) copy). Experts keep their format (engine/experts.py),
so there is a pool per format group, and a cache per pool: each pool has its own K zero and E
staging slots, and the bytes left after them are split over the groups in proportion to their
MoE layers (a Q4_K_M file's Q6_K-down layers get as many bytes per layer as its Q4_K ones, so
fewer slots); a group's entries evict only entries of the same group, whose slots have their
size. A float model is one group: one cache of (budget slots - K - E) slots, as before.

Both run on Ostinato's executor (HybridExperts, layers/moe/hybrid.py) as an `Admission`: a
residency that the passes they admit change. A cached expert is served from its slot in every
pass (the GPU branch's index table and the CPU branch's compact table switch together), any
other on the CPU; a pass of at least the offload threshold uploads each uncached expert it uses
once into the staging slots and computes the layer on the GPU (llama.cpp's op-offload rule).
Decode steps replay as graph segments cut at each MoE layer (layers/moe/segmented.py).

* `expert-cache` (llama.cpp's MoE cache, FreeToken's LRU): passes of at most
  `cache_max_tokens` (32) tokens admit. For each expert the pass routes to in a layer (in
  ascending id): a hit is served from its slot and becomes most recently used; a miss is
  uploaded into a free slot, or into the slot of the least recently used entry (evicted), and
  computed on the GPU, so the pass waits for the whole transfer. Entries used by the current
  pass are never evicted by it; a miss that finds no such slot (a cache smaller than one pass's
  experts) is computed on the CPU. The cache starts empty.
* `decaying-cache` (buun): only decode steps (1 token) admit. Every use adds 1 to
  the (layer, expert) score, and every score is multiplied by `decay` after each decode
  step. A routed expert in the cache is a hit; a miss is admitted when there is a free
  slot or when its score (after this use) exceeds the lowest score in the cache (that
  entry is evicted), then uploaded and computed on the GPU; otherwise the CPU computes it.
  Warm start from the development profile: score = decode routes per decode token /
  (1 - decay) (its steady state), and the cache holds the highest-scored experts before
  the first request.

The host-side state is numpy (HybridExperts.table_row: views of the index table): a decode step
admits once per MoE layer between two graph segments, and torch's per-op overhead on tensors of a
few elements would be most of that host time.

Legend: E experts per layer, C cache slots, T tokens of a pass.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

import numpy as np
import torch

from ostinato.layers.moe.hybrid import Admission, HybridExperts
from ostinato.layers.moe.pool import COLD
from ostinato.engine.experts import ModelExperts, baseline_staging, build_parts, check_fits, pools_bytes


def cache_slots(spec: ModelExperts, budget: int, name: str) -> tuple[dict, int]:
    """(cache slots per format group (qtypes -> slots), staging slots per group) from `budget` bytes:
    the cache has what is left after every group's K zero and staging slots (E, else
    baseline_staging's), split over the groups by their share of the MoE layers."""
    staging = baseline_staging(spec, budget)
    staging = spec.num_experts if staging is None else staging
    fixed = pools_bytes(spec, {}, staging)  # K zero + the staging slots per group
    check_fits(spec, fixed, budget, name, "the zero and staging slots")
    L = len(spec.moe_layers)
    return {qt: (budget - fixed) * len(layers) // L // spec.expert_size(layers[0])
            for qt, layers in spec.groups().items()}, staging


def cache_executor(spec: ModelExperts, cache: dict, staging: int, settings) -> HybridExperts:
    """The executor of a cache: every expert in host memory, nothing resident, each pool's flex
    region the cache's slots and then its staging slots (hybrid.staging)."""
    every = list(range(spec.num_experts))
    flex = {qt: n + staging for qt, n in cache.items()}
    pools, host, cpu = build_parts(spec, {}, {l: every for l in spec.moe_layers}, flex, settings.cpu_backend)
    return HybridExperts(pools, host, cpu, settings.offload_threshold, spec.max_tokens)


class _Cache(Admission):
    def __init__(self, hybrid: HybridExperts, cache_slots: dict):
        """cache_slots: per format group (qtypes) of the executor's pools. Becomes its admission."""
        self.hybrid = hybrid
        hybrid.admission = self
        pools = hybrid.pools.groups
        self.E = pools[0].table_host.shape[1]
        # per group g (index into the pools): its first cache slot, its slots, its free slots
        self.group = {l: g for g, p in enumerate(pools) for l in p.layers}
        self.cache_lo = [p.flex_lo for p in pools]
        self.sizes = [cache_slots[p.qtypes] for p in pools]
        self.free = [list(range(lo, lo + n)) for lo, n in zip(self.cache_lo, self.sizes)]
        self.counters: Counter = Counter()

    def resident_experts(self) -> int:
        return sum(self.sizes)

    def entries(self, pool) -> int:
        return self.sizes[self.hybrid.pools.groups.index(pool)]

    def stats(self) -> dict[str, float]:
        return dict(self.counters)

    def cached(self, layer: int) -> list[int]:
        return np.flatnonzero(self.hybrid.table_row(layer) >= 0).tolist()

    def _evict(self, layer_expert: tuple[int, int]) -> int:
        l, e = layer_expert
        slot = int(self.hybrid.table_row(l)[e])
        self.hybrid.switch(l, e, COLD)
        self.counters["evictions"] += 1
        return slot


class ExpertCache(_Cache):
    name = "expert-cache"

    @classmethod
    def build(cls, spec: ModelExperts, budget: int, settings, counts=None) -> HybridExperts:
        cache, staging = cache_slots(spec, budget, cls.name)
        hybrid = cache_executor(spec, cache, staging, settings)
        cls(hybrid, cache, settings.cache_max_tokens)
        return hybrid

    def __init__(self, hybrid, cache_slots, cache_max_tokens: int):
        super().__init__(hybrid, cache_slots)
        self.cache_max_tokens = cache_max_tokens
        # per group: least recently used first
        self.lru: list[OrderedDict[tuple[int, int], None]] = [OrderedDict() for _ in self.sizes]

    def admits(self, T: int) -> bool:
        return T <= self.cache_max_tokens

    def admit(self, layer: int, ids: np.ndarray) -> list[tuple[int, int]]:
        used = np.unique(ids).tolist()
        row = self.hybrid.table_row(layer)
        g = self.group[layer]
        lru, free = self.lru[g], self.free[g]
        misses = []
        for e in used:
            if row[e] >= 0:
                lru.move_to_end((layer, e))
            else:
                misses.append(e)
        uploads = []
        now = {(layer, e) for e in used}
        for e in misses:
            if free:
                s = free.pop()
            elif lru and next(iter(lru)) not in now:
                s = self._evict(lru.popitem(last=False)[0])
            else:  # every cached entry serves this pass: its other misses run on the CPU
                break
            self.hybrid.switch(layer, e, s)
            lru[(layer, e)] = None
            uploads.append((e, s))
        return uploads


class DecayingCache(_Cache):
    name = "decaying-cache"

    @classmethod
    def build(cls, spec: ModelExperts, budget: int, settings, counts=None) -> HybridExperts:
        cache, staging = cache_slots(spec, budget, cls.name)
        hybrid = cache_executor(spec, cache, staging, settings)
        policy = cls(hybrid, cache, settings.decay)
        if counts is not None:
            policy.warm(counts)
        return hybrid

    def __init__(self, hybrid, cache_slots, decay: float):
        super().__init__(hybrid, cache_slots)
        self.decay = decay
        L = hybrid.pools.groups[0].table_host.shape[0]
        # score = stored / gain: a step multiplies gain by 1/decay instead of every score by decay
        self.stored = np.zeros((L, self.E), dtype=np.float64)
        self.gain = 1.0
        self._last_layer = None
        # per group: the (layer * E + expert) each cache slot holds (-1: free): the eviction candidates
        self._owner = [np.full(n, -1, dtype=np.int64) for n in self.sizes]

    def admits(self, T: int) -> bool:
        return T == 1

    def score(self, layer: int, expert: int) -> float:
        return float(self.stored[layer, expert]) / self.gain

    def _place(self, layer: int, expert: int, slot: int) -> None:
        self.hybrid.switch(layer, expert, slot)
        g = self.group[layer]
        self._owner[g][slot - self.cache_lo[g]] = layer * self.E + expert

    def warm(self, counts) -> None:
        """Scores from the development profile's decode routes; the cache filled with the top ones."""
        tokens = max(1, counts.tokens.get("decode", 0))
        moe = sorted(self.group)
        for l in moe:
            self.stored[l] = counts.decode[l].to(torch.float64).numpy() / tokens / max(1e-9, 1.0 - self.decay)
        order = np.argsort(-self.stored.reshape(-1), kind="stable")
        h = self.hybrid
        for i in order.tolist():
            if not any(self.free):
                break
            l, e = divmod(i, self.E)
            if l not in self.group or self.stored[l, e] <= 0 or not self.free[self.group[l]]:
                continue
            s = self.free[self.group[l]].pop()
            self._place(l, e, s)
            h.pools.of(l).upload([s], h.host, l, [e])
        h.publish()

    def _step(self, layer: int) -> None:
        """A call to a layer at or before the previous one starts a new decode step."""
        if self._last_layer is not None and layer <= self._last_layer:
            self.gain /= self.decay
            if self.gain > 1e100:
                self.stored /= self.gain
                self.gain = 1.0
        self._last_layer = layer

    def admit(self, layer: int, ids: np.ndarray) -> list[tuple[int, int]]:
        self._step(layer)
        used = np.unique(ids).tolist()
        self.stored[layer, used] += self.gain
        row = self.hybrid.table_row(layer)
        uploads = []
        for e in used:
            if row[e] >= 0:
                continue
            s = self._admit(layer, e, keep=used)
            if s is not None:
                uploads.append((e, s))
        return uploads

    def _admit(self, layer: int, expert: int, keep: list[int]) -> int | None:
        g = self.group[layer]
        if self.free[g]:
            s = self.free[g].pop()
        elif not self.sizes[g]:  # this group has no cache slots
            return None
        else:  # every slot of the group holds an entry: the lowest-scored one not serving this pass goes
            owner = self._owner[g]
            scores = self.stored.reshape(-1)[owner]
            mine = self.hybrid.table_row(layer)[keep]
            scores[mine[mine >= 0] - self.cache_lo[g]] = np.inf  # the entries serving this pass stay
            low = scores.min()
            if not self.stored[layer, expert] > low:
                return None
            victim = int(owner[scores == low].min())  # ties: the lowest (layer, expert)
            s = self._evict(divmod(victim, self.E))
        self._place(layer, expert, s)
        return s
