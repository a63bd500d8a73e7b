"""Borrowed memory: during decode, the flex slots (reserved for the largest prefill's
uploads) hold the cold experts that decode keeps sending to the CPU.

Every cold route raises its expert's score by one and scores decay every step, so the score
tracks recent CPU use. Between tokens the engine asks for a rebalance: the best-scored cold
experts are copied from page-locked memory into free flex slots on a side stream; a full
set of slots admits a newcomer only when it scores `margin` times the weakest borrowed
expert (no thrashing). A finished copy takes effect at a token boundary, where the device
index table (GPU branch) and the host compact table (CPU branch, and the graph worker's)
switch together. A prefill calls `release_all` first: its upload path needs the slots.

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
        pool = hybrid.pools.single("borrowed memory (--borrow)")
        self.hybrid, self.pool, self.host = hybrid, pool, hybrid.host
        self.decay, self.margin, self.every, self.wait_copies = decay, margin, every, wait_copies
        self.on_switch = on_switch
        self.steps = 0
        L, E = pool.table.shape
        self.scores = torch.zeros((L, E), dtype=torch.float32, device=pool.device)
        self.hits = torch.zeros((), dtype=torch.int64, device=pool.device)  # routes served by borrowed slots
        self.slots = list(range(pool.flex_lo, pool.num_slots))
        self.owner: dict[int, tuple[int, int]] = {}  # slot -> (layer, expert) borrowed there
        self.pending: list[tuple[int, int, int, object]] = []  # (slot, layer, expert, copy-done event)
        self.copy_stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        self.counters = {"borrowed": 0, "returned": 0, "replaced": 0}

    def observe(self, layer: int, ids: torch.Tensor) -> None:
        """Routing of a decode step's layer (ids [1, K]): score cold uses, count borrowed hits."""
        slot = self.pool.table[layer][ids[0]]
        self.scores[layer].index_add_(0, ids[0], (slot < 0).to(torch.float32))
        self.hits += (slot >= self.pool.flex_lo).sum()

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

    def free_slots(self) -> list[int]:
        busy = set(self.owner) | {p[0] for p in self.pending}
        return [s for s in self.slots if s not in busy]

    def rebalance(self, max_replace: int = 4) -> None:
        """Between tokens: start copies for the best-scored cold experts, into every free slot
        (after a prefill returned them all, the first rebalance refills them at once) and in
        place of at most max_replace weaker borrowed ones; apply finished copies."""
        self._apply_finished()
        scores = self.scores.cpu()
        table = self.pool.table_host
        cold = (table < 0) & (scores > 0)
        for l, e in {(l, e) for _, l, e, _ in self.pending}:
            cold[l, e] = False
        if not cold.any():
            return
        flat = torch.where(cold, scores, torch.zeros_like(scores)).flatten()
        order = torch.argsort(flat, descending=True)[:len(self.free_slots()) + max_replace]
        for i in order.tolist():
            l, e = divmod(i, scores.shape[1])
            if flat[i] <= 0:
                break
            free = self.free_slots()
            if not free:
                if max_replace == 0 or not self.owner:  # every slot taken by a copy in flight
                    break
                max_replace -= 1
                weakest = min(self.owner, key=lambda s: scores[self.owner[s]])
                if flat[i] < self.margin * scores[self.owner[weakest]]:
                    break
                self._return(weakest)
                self.counters["replaced"] += 1
                free = [weakest]
            self._start_copy(free[0], l, e)
        if self.wait_copies:
            if self.copy_stream is not None:
                self.copy_stream.synchronize()
            self._apply_finished()

    def _start_copy(self, slot: int, layer: int, expert: int) -> None:
        event = None
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.pool.device))  # slot no longer read
            with torch.cuda.stream(self.copy_stream):
                self.pool.upload([slot], self.host, layer, [expert])
                event = torch.cuda.Event()
                event.record()
        else:
            self.pool.upload([slot], self.host, layer, [expert])
        self.pending.append((slot, layer, expert, event))

    def _apply_finished(self) -> None:
        still = []
        for slot, layer, expert, event in self.pending:
            if event is not None and not event.query():
                still.append((slot, layer, expert, event))
                continue
            self._switch(layer, expert, slot)
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

    def _return(self, slot: int) -> None:
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
