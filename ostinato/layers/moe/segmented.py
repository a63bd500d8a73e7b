"""A cache's decode step as graph segments (engine/graph.py GraphChain), as llama.cpp runs its
cached layers.

A cache (HybridExperts with an Admission, layers/moe/hybrid.py) must see each layer's routing on
the host before it can say where the layer's experts are. So the captured step cuts at each MoE
layer: the segment ending there copies the routing and activations to page-locked buffers; at
replay the host then synchronises once, lets the cache admit the routing (its uploads and table
switches, HybridExperts.admit), runs the CPU branch over the routes left cold and writes its
partial sum to a static device buffer; the next segment runs the GPU branch from the pool's
index table and adds that sum. The same admission, kernels and order of operations as the
synchronous split path, so a replayed step equals it bit for bit.

Every TIME_EVERY-th step the gaps are timed with events: segment_gap_ms over segment_cuts (from
the end of a segment to the next one's inputs being on the device) and, for the cuts with
nothing to upload or compute on the CPU, sync_gap_ms over sync_cuts: the cost of the sync itself.

Legend: K top-k, D hidden.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from ostinato.layers.moe.hybrid import HybridExperts, HybridWrapper
from ostinato.layers.moe.types import TopKOutput

TIME_EVERY = 8  # decode steps between two timed ones (events around every cut of the step)


@dataclass
class SegmentBuffers:
    """What a captured decode step hands between its segments at one MoE layer (shared by all
    layers: the host finishes with one before the next segment overwrites it)."""

    ids: torch.Tensor  # [1, K] page-locked: the routing, copied by the segment before the cut
    weights: torch.Tensor  # [1, K] page-locked
    x: torch.Tensor  # [1, D] page-locked: the activations, for the CPU branch
    cpu_dev: torch.Tensor  # [1, D] fp32: the CPU branch's partial sum, added by the next segment
    ready: torch.cuda.Event  # recorded after a segment: the host waits for the routing on it
    cpu_dirty: bool = False  # cpu_dev holds a partial sum (zeroed before a layer without one)


class SegmentedExperts(HybridWrapper):
    """A cache's HybridExperts inside a captured decode step (module docstring); every other pass
    goes to it unchanged."""

    segmented = True

    def __init__(self, hybrid: HybridExperts):
        super().__init__(hybrid)
        self.chain = None  # set by the decode graph while it captures a step (engine/graph.py)
        self.frozen = False  # the capture's warm-up: passes leave the cache and the counters alone
        self._seg: SegmentBuffers | None = None
        self._timing_counts: Counter = Counter()
        self._steps = 0  # replayed decode steps, for timing every TIME_EVERY-th
        self._timing: list = []  # this step's (gap start, gap end, quiet) events; read at the next timed step
        self._layer0 = next(iter(hybrid.has_cold))

    def stats(self) -> dict[str, float]:
        self._read_timing()
        return {**self.hybrid.stats(), **self._timing_counts}

    def before_capture(self) -> None:
        """The capture's warm-up must not move the cache; the segments' buffers are made here,
        outside the capture (the router's ids are int64, its weights fp32: layers/moe/router.py)."""
        self.frozen = True
        if self._seg is None:
            h = self.hybrid
            K, D = h.pools.top_k, h.pools.hidden
            pinned = {"device": "cpu", "pin_memory": True}
            self._seg = SegmentBuffers(
                torch.empty((1, K), dtype=torch.int64, **pinned), torch.empty((1, K), dtype=torch.float32, **pinned),
                torch.empty((1, D), dtype=h.pools.dtype, **pinned),
                torch.zeros((1, D), dtype=torch.float32, device=self.device), torch.cuda.Event())

    def after_capture(self) -> None:
        self.frozen = False

    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        if self.chain is not None and x.shape[0] == 1:
            return self._captured(layer, x, topk)
        if not self.frozen:
            return self.hybrid(layer, x, topk)
        h = self.hybrid  # the capture's warm-up: the kernels run, the cache and the counters stay
        saved, admission = h.counters.copy(), h.admission
        h.admission = None
        try:
            return h(layer, x, topk)
        finally:
            h.counters, h.admission = saved, admission

    def _captured(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """Inside the capture of a step: routing and activations to page-locked memory, the cut,
        then (in the next segment) the GPU branch from the pool's index table plus the CPU
        branch's partial sum, both written by the host between the segments."""
        seg = self._seg  # made by before_capture
        seg.ids.copy_(topk.ids, non_blocking=True)
        seg.weights.copy_(topk.weights, non_blocking=True)
        seg.x.copy_(x, non_blocking=True)
        self.chain.cut(lambda: self._between(layer, seg))
        pool = self.hybrid.pools.of(layer)
        gpu = pool.forward(x, pool.slots_for(layer, topk.ids), topk.weights, out_dtype=torch.float32)
        return (gpu + seg.cpu_dev).to(x.dtype)

    def _between(self, layer: int, seg: SegmentBuffers) -> None:
        """At replay, after the segment that ends with this layer's routing was launched: wait
        for it (the per-layer sync), admit, run the CPU branch, hand its partial sum to the next
        segment."""
        h, timed = self.hybrid, None
        if layer == self._layer0:
            self._steps += 1
        if self._steps % TIME_EVERY == 0:
            if layer == self._layer0:
                self._read_timing()
            timed = torch.cuda.Event(enable_timing=True)
            timed.record()
        seg.ready.record()
        seg.ready.synchronize()
        h.counters["routes"] += seg.ids.shape[1]
        uploaded = h.counters["uploaded_experts"]
        cid, cold = h.route_cold(layer, seg.ids)
        out_h = h.submit_cold(layer, seg.x, cid, cold, seg.weights)
        if out_h is not None:
            h.cpu.wait()
            seg.cpu_dev.copy_(out_h, non_blocking=True)
        elif seg.cpu_dirty:
            seg.cpu_dev.zero_()
        seg.cpu_dirty = out_h is not None
        if timed is not None:
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            self._timing.append((timed, done, out_h is None and h.counters["uploaded_experts"] == uploaded))

    def _read_timing(self) -> None:
        """Add the last timed step's gaps to the counters."""
        if self._timing:
            self._timing[-1][1].synchronize()  # long done when a step reads them; stats() may come sooner
        for start, end, quiet in self._timing:
            ms = start.elapsed_time(end)
            self._timing_counts["segment_cuts"] += 1
            self._timing_counts["segment_gap_ms"] += ms
            if quiet:
                self._timing_counts["sync_cuts"] += 1
                self._timing_counts["sync_gap_ms"] += ms
        self._timing = []
