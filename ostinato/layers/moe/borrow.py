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
        pool; apply finished copies."""
        self._apply_finished()
        scores = self.scores.cpu()
        in_flight = {(l, e) for _, l, e, _ in self.pending}
        best = [c for g in self.layers for c in self._best(g, scores, in_flight, max_replace)]
        if not best:
            return
        best.sort(key=lambda c: -c[0])  # stable: one pool keeps its argsort order
        done = set()  # pools whose slots no weaker candidate can take now
        for score, l, e in best:
            g = self.group[l]
            if g in done:
                continue
            free = self.free_slots(g)
            if not free:
                mine = [s for s in self.owner if s[0] == g]
                if max_replace == 0 or not mine:  # every slot taken by a copy in flight
                    done.add(g)
                    continue
                weakest = min(mine, key=lambda s: scores[self.owner[s]])
                if score < self.margin * scores[self.owner[weakest]]:
                    done.add(g)
                    continue
                max_replace -= 1
                self._return(weakest)
                self.counters["replaced"] += 1
                free = [weakest]
            self._start_copy(free[0], l, e)
        if self.wait_copies:
            if self.copy_stream is not None:
                self.copy_stream.synchronize()
            self._apply_finished()

    def _best(self, group: int, scores: torch.Tensor, in_flight: set, max_replace: int) -> list[tuple]:
        """(score, layer, expert) of pool `group`'s best-scored cold experts not being copied, as
        many as its free slots and max_replace could take, best first."""
        layers = self.layers[group]
        if not layers:
            return []
        cold = torch.zeros_like(scores, dtype=torch.bool)
        cold[layers] = self.pools.groups[group].table_host[layers] < 0
        cold &= scores > 0
        for l, e in in_flight:
            cold[l, e] = False
        if not cold.any():
            return []
        flat = torch.where(cold, scores, torch.zeros_like(scores)).flatten()
        order = torch.argsort(flat, descending=True)[:len(self.free_slots(group)) + max_replace]
        return [(float(flat[i]), *divmod(i, scores.shape[1])) for i in order.tolist() if flat[i] > 0]

    def _start_copy(self, slot: tuple[int, int], layer: int, expert: int) -> None:
        pool = self.pools.groups[slot[0]]
        event = None
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(pool.device))  # slot no longer read
            with torch.cuda.stream(self.copy_stream):
                pool.upload([slot[1]], self.host, layer, [expert])
                event = torch.cuda.Event()
                event.record()
        else:
            pool.upload([slot[1]], self.host, layer, [expert])
        self.pending.append((slot, layer, expert, event))

    def _apply_finished(self) -> None:
        still = []
        for slot, layer, expert, event in self.pending:
            if event is not None and not event.query():
                still.append((slot, layer, expert, event))
                continue
            self._switch(layer, expert, slot[1])
            self.owner[slot] = (layer, expert)
            self.counters["borrowed"] += 1
        self.pending = still

    def _switch(self, layer: int, expert: int, slot: int) -> None:
        """Both branches at once (HybridExperts.switch): slot >= 0 borrows, COLD returns the expert
        to the CPU."""
        self.hybrid.switch(layer, expert, slot)
        self.hybrid.publish()
        if self.on_switch is not None:
            self.on_switch(layer, self.host.compact[layer])

    def _return(self, slot: tuple[int, int]) -> None:
        layer, expert = self.owner.pop(slot)
        self._switch(layer, expert, COLD)
        self.counters["returned"] += 1

    def release_all(self) -> None:
        """Before a prefill: every borrowed expert back to the CPU, every slot free."""
        if self.copy_stream is not None and self.pending:
            self.copy_stream.synchronize()
        self.pending = []
        for slot in list(self.owner):
            self._return(slot)

    def stats(self) -> dict[str, float]:
        return {**self.counters, "borrowed_now": len(self.owner), "borrowed_hits": int(self.hits)}
