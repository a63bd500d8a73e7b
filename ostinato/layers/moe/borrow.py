"""Borrowed memory: during decode, the flex slots (reserved for the largest prefill's
uploads) hold the cold experts that decode keeps sending to the CPU.

Every cold route raises its expert's score by one and scores decay every step, so the score
tracks recent CPU use. Between tokens the engine asks for a rebalance: the best-scored cold
experts are copied from page-locked memory into free flex slots on a side stream; a full
set of slots admits a newcomer only when it scores `margin` times the weakest borrowed
expert (no thrashing). Each expert pool (one per format: layers/moe/pool.py) lends its own
flex slots to the layers it serves only, so a newcomer replaces the weakest of its own pool;
one score table covers every layer. A finished copy takes effect at a token boundary, where
the device index table (GPU branch) and the host compact table (CPU branch, and the graph
worker's) switch together. A prefill calls `release_all` first: its upload path needs the slots.

Scores and hits are device tensors. The synchronous path updates them with `observe`; inside
a captured decode step the handshake's post kernel (kernels/triton/handshake.py) does the same
arithmetic on the routing it already loads, so scoring adds no kernel to the graph (as torch
ops it added about 300 launches a step: borrowing then cost more than it saved).

Legend: L layers (model indexing), E experts per layer.
"""
from __future__ import annotations

import numpy as np
import torch

from ostinato.layers.moe.pool import COLD


class Borrowing:
    def __init__(self, hybrid, decay: float = 0.9, margin: float = 2.0, every: int = 4, wait_copies: bool = False,
                 on_switch=None):
        """every: steps between rebalances; wait_copies: apply copies at the boundary they start
        at (deterministic; tests), instead of when they finish; on_switch(layer, compact_table)
        tells another consumer of the host tables (the graph worker) about a switch."""
        pools = hybrid.pools
        self.hybrid, self.pools, self.host = hybrid, pools, hybrid.host
        self.decay, self.margin, self.every, self.wait_copies = decay, margin, every, wait_copies
        self.on_switch = on_switch
        self.steps = 0
        L, E = pools.groups[0].table.shape
        self.scores = torch.zeros((L, E), dtype=torch.float32, device=pools.device)
        self.hits = torch.zeros((), dtype=torch.int64, device=pools.device)  # routes served by borrowed slots
        # the MoE layers this backend serves (a dense layer, or another device's, is never borrowed for), by pool
        group = {id(p): g for g, p in enumerate(pools.groups)}
        self.group = {l: group[id(pools.of(l))] for l in hybrid.has_cold}  # layer -> index in pools.groups
        self.layers = {g: [l for l in self.group if self.group[l] == g] for g in range(len(pools.groups))}
        # a slot is (pool index, slot in that pool): the slots of two pools never collide
        self.slots = [(g, s) for g, p in enumerate(pools.groups) for s in range(p.flex_lo, p.num_slots)]
        self.owner: dict[tuple[int, int], tuple[int, int]] = {}  # slot -> (layer, expert) borrowed there
        self.pending: list[tuple[tuple[int, int], int, int, object]] = []  # (slot, layer, expert, copy-done event)
        self.copy_stream = torch.cuda.Stream(pools.device) if pools.device.type == "cuda" else None
        self.counters = {"borrowed": 0, "returned": 0, "replaced": 0}

    def observe(self, layer: int, ids: torch.Tensor) -> None:
        """Routing of a decode step's layer (ids [1, K]): score cold uses, count borrowed hits."""
        pool = self.pools.of(layer)
        slot = pool.table[layer][ids[0]]
        self.scores[layer].index_add_(0, ids[0], (slot < 0).to(torch.float32))
        self.hits += (slot >= pool.flex_lo).sum()

    def forget(self) -> None:
        """Scores and hits back to zero (what was observed was not decode, e.g. warm-up steps)."""
        self.scores.zero_()
        self.hits.zero_()

    def end_step(self) -> None:
        """After every decode step (a token boundary)."""
        self.scores.mul_(self.decay)
        self.steps += 1
        if self.steps % self.every == 0:
            self.rebalance()

    def free_slots(self, group: int | None = None) -> list[tuple[int, int]]:
        """The slots neither borrowed nor being copied into: of pool `group`, or of every pool."""
        busy = set(self.owner) | {p[0] for p in self.pending}
        return [s for s in self.slots if s not in busy and (group is None or s[0] == group)]

    def rebalance(self, max_replace: int = 4) -> None:
        """Between tokens: start copies for the best-scored cold experts, into every free slot of
        their layer's pool (after a prefill returned them all, the first rebalance refills them at
        once) and in place of at most max_replace (over all pools) weaker borrowed ones of the same
        pool; apply finished copies.

        It runs on the host between two decode steps, so every step waits for it: the scores are read
        once into a numpy array, each pool's free slots and weakest borrowed experts are listed once,
        the copies go out one upload per layer under one event, and the tables are published once.
        scripts/bench_borrow_host.py times it at the 30B file's shape."""
        self._apply_finished()
        scores = self.scores.cpu().numpy()
        in_flight = {(l, e) for _, l, e, _ in self.pending}
        free = {g: self.free_slots(g) for g in self.layers}
        weak = {g: sorted((s for s in self.owner if s[0] == g), key=lambda s: scores[self.owner[s]])
                for g in self.layers}  # each pool's borrowed experts, weakest first
        best = [c for g in self.layers for c in self._best(g, scores, in_flight, len(free[g]) + max_replace)]
        best.sort(key=lambda c: -c[0])  # stable: one pool keeps its own order
        starts, returned, done = [], set(), set()  # done: pools whose slots no weaker candidate can take now
        for score, l, e in best:
            g = self.group[l]
            if g in done:
                continue
            if free[g]:
                starts.append((free[g].pop(0), l, e))
                continue
            if max_replace == 0 or not weak[g] or score < self.margin * scores[self.owner[weak[g][0]]]:
                done.add(g)  # every slot in flight, or the newcomer not clearly better than the weakest
                continue
            max_replace -= 1
            slot = weak[g].pop(0)
            returned.add(self._return(slot))
            self.counters["replaced"] += 1
            starts.append((slot, l, e))
        self._publish(returned)  # before the copies: no kernel queued after this reads a returned slot
        self._start_copies(starts)
        if self.wait_copies:
            if self.copy_stream is not None:
                self.copy_stream.synchronize()
            self._apply_finished()

    def _best(self, group: int, scores, in_flight: set, n: int) -> list[tuple]:
        """(score, layer, expert) of pool `group`'s n best-scored cold experts not being copied (scores:
        the numpy array of every layer's), best first."""
        layers = self.layers[group]
        if not layers or n <= 0:
            return []
        cold = np.where(self.pools.groups[group].table_host[layers].numpy() < 0, scores[layers], 0.0)
        row = {l: i for i, l in enumerate(layers)}
        for l, e in in_flight:
            if l in row:
                cold[row[l], e] = 0.0
        flat = cold.ravel()
        order = np.argsort(-flat, kind="stable")[:n]
        E = cold.shape[1]
        return [(float(flat[i]), layers[i // E], int(i % E)) for i in order.tolist() if flat[i] > 0]

    def _start_copies(self, starts: list[tuple[tuple[int, int], int, int]]) -> None:
        """Copy each (slot, layer, expert) of starts from page-locked memory, one upload per layer of a
        pool, on the copy stream after the work queued so far (which may still read the slots), with
        one event for them all."""
        if not starts:
            return
        by_layer: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for (g, s), l, e in starts:
            by_layer.setdefault((g, l), []).append((s, e))

        def issue():
            for (g, l), pairs in by_layer.items():
                self.pools.groups[g].upload([s for s, _ in pairs], self.host, l, [e for _, e in pairs])

        event = None
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.pools.device))
            with torch.cuda.stream(self.copy_stream):
                issue()
                event = torch.cuda.Event()
                event.record()
        else:
            issue()
        self.pending += [(slot, l, e, event) for slot, l, e in starts]

    def _apply_finished(self) -> None:
        ready: dict[int, bool] = {}  # an event's query, once (the copies of one rebalance share it)
        still, switched = [], set()
        for slot, layer, expert, event in self.pending:
            if event is not None:
                if id(event) not in ready:
                    ready[id(event)] = event.query()
                if not ready[id(event)]:
                    still.append((slot, layer, expert, event))
                    continue
            self.hybrid.switch(layer, expert, slot[1])
            self.owner[slot] = (layer, expert)
            self.counters["borrowed"] += 1
            switched.add(layer)
        self.pending = still
        self._publish(switched)

    def _publish(self, layers: set[int]) -> None:
        """The switched layers' tables to both branches at once (HybridExperts.switch, publish), and to
        another consumer of the host tables (on_switch: the graph worker), once a layer."""
        if not layers:
            return
        self.hybrid.publish()
        if self.on_switch is not None:
            for layer in sorted(layers):
                self.on_switch(layer, self.host.compact[layer])

    def _return(self, slot: tuple[int, int]) -> int:
        """The expert borrowed at slot back to the CPU (the tables switched, not yet published); -> its layer."""
        layer, expert = self.owner.pop(slot)
        self.hybrid.switch(layer, expert, COLD)
        self.counters["returned"] += 1
        return layer

    def release_all(self) -> None:
        """Before a prefill: every borrowed expert back to the CPU, every slot free."""
        if self.copy_stream is not None and self.pending:
            self.copy_stream.synchronize()
        self.pending = []
        self._publish({self._return(slot) for slot in list(self.owner)})

    def stats(self) -> dict[str, float]:
        return {**self.counters, "borrowed_now": len(self.owner), "borrowed_hits": int(self.hits)}
