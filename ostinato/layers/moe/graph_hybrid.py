"""The hybrid backend inside a captured decode step: the CPU branch joined through mapped
memory instead of a host sync, so the whole step replays as one CUDA graph.

Per MoE layer of a graph step: `post` (routing and activations to the shared buffers, flag
up), the GPU branch from the pool (the same slot kernel as the synchronous path), then
`wait_add_rows` (wait for the native worker's done flag if the layer has cold routes, copy its
fp32 partial into device memory, add it, round once: three operations, whose device buffers
every layer shares in stream order). The native worker (layers/moe/graph_worker.py) computes
the cold routes with the same CPU kernel as the synchronous path, so a graph step equals the
same step run with HybridExperts.split_path bit for bit.

A short prefill pass captured as a graph (engine/graph.py PassGraphs) is a step of B rows, n of
them real (`StepRows`, on the device): `post_rows` sends the B rows' routing, the n real rows' activations and n,
the worker computes the cold routes of the n rows, and `wait_add_rows` joins them; the rows past n
are padding that nothing reads. With a staging rule (OSTINATO_STAGE_ROUTES, layers/moe/staging.py; on
by default, for Ostinato's placements) such a pass also copies its most-routed cold experts into flex
slots and computes them on the GPU; their marks go to the worker with the routing, and it leaves them
out. Other passes and steps outside a graph go to the wrapped HybridExperts unchanged.

Legend: K top-k, D hidden, B rows of a captured pass.
"""
from __future__ import annotations

import atexit

import torch

from ostinato.layers.moe.backend import StepRows
from ostinato.layers.moe.graph_worker import GraphHandshake, GraphWorker
from ostinato.layers.moe.hybrid import HybridExperts, HybridWrapper
from ostinato.layers.moe.segmented import SegmentedExperts
from ostinato.layers.moe.staging import (PassStaging, env_prefetch, env_prefetch_from, env_stage_routes, joined,
                                         resolve, stage_from)
from ostinato.layers.moe.types import TopKOutput


class GraphHybridExperts(HybridWrapper):
    capturable = True

    def __init__(self, hybrid: HybridExperts, core: int = -1, max_rows: int = 1, stage_routes: int | str | None = None):
        """core: the CPU of this GPU's poller (the thread layout's, ostinato/threads.py; -1 unpinned);
        max_rows: the most rows a captured pass posts (1: decode steps only); stage_routes: the staging rule
        for captured passes, a count m, "balance" or "mean" (0: none; None: env_stage_routes), where the hybrid's
        placement stages (HybridExperts.stage_passes: Ostinato's, not a baseline's, which keep their own
        rules)."""
        from ostinato.kernels.triton import handshake as hs

        super().__init__(hybrid)
        self.hs = hs
        pools = hybrid.pools
        # only layers with cold experts post a step: the worker waits at each of its layers
        layers = [l for l, cold in hybrid.has_cold.items() if cold]
        self.index = {l: i for i, l in enumerate(layers)}  # model layer -> handshake row
        rule = resolve(env_stage_routes() if stage_routes is None else stage_routes, hybrid.stage_costs)
        stages = rule and max_rows > 1 and hybrid.stage_passes  # Ostinato's placements only
        self.shared = GraphHandshake(len(layers), pools.top_k, pools.hidden, x_dtype=pools.dtype, tokens=max_rows,
                                     staged_experts=pools.groups[0].table.shape[1] if stages else 0)
        self.worker = GraphWorker(self.shared, hybrid.cpu, hybrid.host.compact, layers, core=core)
        self.seq = torch.zeros(1, dtype=torch.int32, device=hybrid.device)
        # the join's device rows (max_rows x D fp32: 2 MiB for Qwen3-30B-A3B's 256-row passes) and the count of
        # a decode step's one row
        self.join = hs.CopyJoin(max_rows, pools.hidden, hybrid.device)
        self.one = torch.ones(1, dtype=torch.int32, device=hybrid.device)
        P = hs.HostPointer
        sh, S = self.shared, 16  # flag stride (int32 elements)
        self.views = {i: (P(sh.ids[i]), P(sh.weights[i]), P(sh.x[i]), P(sh.has_cold[i, :1]),
                          P(sh.post_flag[i, :1]), P(sh.out[i]), P(sh.done_flag[i, :1]), P(sh.tokens[i, :1]))
                      for i in range(len(layers))}
        self.staged_views = {i: P(sh.staged[i]) for i in range(len(layers))} if sh.staged is not None else None
        assert sh.post_flag.stride(0) == S
        self.in_step = False
        if hybrid.borrow is not None:  # table switches reach the worker at the next step
            hybrid.borrow.on_switch = lambda layer, table: self.worker.set_compact(layer, table)
        self.staging = PassStaging(hybrid, rule, env_prefetch()) if stages else None
        self.prefetch_from = env_prefetch_from()  # the fewest rows of a pass that prefetches (staging.py)
        # passes of fewer rows stage nothing (staging.stage_from); they post these zero marks, so that the worker
        # does not leave out the experts an earlier pass staged
        self.stage_from = stage_from(rule) if stages else 0
        self.no_marks = torch.zeros(sh.staged.shape[1], dtype=torch.uint8, device=hybrid.device) if stages else None
        self.worker.start(1)
        atexit.register(self.stop)

    @property
    def max_rows(self) -> int:
        return self.shared.max_tokens

    def captures_pass(self, T: int) -> bool:
        """A pass the handshake's rows hold, that the wrapped executor runs split without uploads in
        every layer (HybridExperts.splits): the captured pass computes what it computes. Where captured
        passes stage (self.staging), also the passes that the executor would run with uploads: a captured
        pass then moves its own most-routed cold experts over PCIe."""
        return (1 < T <= self.max_rows and self.hybrid.admission is None
                and (self.staging is not None or self.hybrid.splits(T)))

    def before_prefill(self) -> None:
        """Before every prefill pass (the runner's call, on the host): where captured passes stage,
        any of them may overwrite the flex slots, so the upload path's record of what they hold goes."""
        if self.staging is not None:
            self.hybrid.forget_staged()
        self.hybrid.before_prefill()

    def before_step(self, rows: StepRows | None = None) -> None:
        """First thing of a graph step: the device-side step number moves on."""
        self.hs.bump(self.seq)
        self.in_step = True
        if self.staging is not None:
            self.staging.start_pass(rows)
        self.hybrid.before_step(rows)  # the pass's real rows are the executor's step_rows

    def after_step(self) -> None:
        self.in_step = False
        self.hybrid.after_step()

    def after_capture(self) -> None:
        """The warm-up steps before a capture ran on token 0 at position 0: they are not decode."""
        if self.hybrid.borrow is not None:
            self.hybrid.borrow.forget()

    def stop(self) -> None:
        """Stop the worker: the hybrid it wraps stays as it is (to serve host-driven, or to be
        wrapped again); at exit, this is all that is done."""
        atexit.unregister(self.stop)  # the registration holds this backend, and so its pool, alive
        if self.hybrid.borrow is not None:
            self.hybrid.borrow.on_switch = None  # no cycle through the closed worker
        if self.worker.running:
            if self.hybrid.on_cuda:  # no replay may be left waiting on the worker
                torch.cuda.synchronize(self.device)
            self.worker.stop()

    def close(self) -> None:
        """Stop the worker, then close the hybrid (its CPU pool, its page-locked host experts)."""
        self.stop()
        self.hybrid.close()

    def stats(self) -> dict[str, float]:
        out = dict(self.hybrid.stats())
        # the counters only: a turn's figures are differences of two reads (bench/metrics.py placement_delta)
        worker = self.worker.stats()
        out |= {f"graph_{k}": worker[k] for k in self.worker.COUNTERS}
        out["cpu_experts"] = out.get("cpu_experts", 0) + worker["cold_experts"]  # the captured steps' and passes'
        if self.staging is not None:  # staged experts crossed PCIe as uploads do
            out["uploaded_experts"] = out.get("uploaded_experts", 0) + worker["staged_experts"]
            out["bytes_uploaded"] = out.get("bytes_uploaded", 0) + int(self.staging.staged_bytes)
            if self.staging.prefetches:  # those among them copied for a next layer, routed there or not
                out["bytes_prefetched"] = int(self.staging.prefetched_bytes)
        return out

    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        T, rows = x.shape[0], self.hybrid.step_rows  # rows: a captured pass's (None: a decode step)
        if not (self.in_step and self.hybrid.has_cold[layer] and (T == 1 or rows is not None)):
            return self.hybrid(layer, x, topk)
        if T > self.max_rows:
            raise ValueError(f"a captured pass of {T} rows exceeds the handshake's {self.max_rows}")
        pool = self.hybrid.pools.of(layer)
        if self.hybrid.on_cuda and torch.cuda.is_current_stream_capturing():
            self.hybrid.count_captured(layer, topk.ids)
        h_ids, h_w, h_x, h_has, h_post, h_out, h_done, h_tokens = self.views[self.index[layer]]
        staged = prefetched = both = pre_landed = None
        if rows is not None:  # a captured prefill pass: never scored for borrowing (decode only)
            count = rows.count
            marks = (None, None)
            if self.staging is not None:  # chosen first: the worker reads the marks with the routing
                prefetched, pre_landed = self.staging.prefetched(layer)  # copied while the layer before ran
                if T >= self.stage_from:
                    staged = self.staging.choose(layer, topk.ids, rows, prefetched)  # None: no flex slots
                both = joined(prefetched, staged)
                # nothing staged posts zero marks: none of an earlier pass's stays
                marks = (both.pick.view(torch.uint8) if both is not None else self.no_marks,
                         self.staged_views[self.index[layer]])
            self.hs.post_rows(topk.ids, topk.weights, x, pool.table[layer], self.seq, count, h_ids, h_w, h_x,
                              h_has, h_post, h_tokens, *marks)
            if staged is not None:  # the copies run beside the GPU branch over the pool's own experts
                self.staging.stage(layer, staged)
        else:
            count = None
            borrow = self.hybrid.borrow  # the post kernel scores the routes as borrow.observe would
            score = (borrow.scores[layer], borrow.hits, pool.flex_lo) if borrow is not None else None
            self.hs.post(topk.ids, topk.weights, x, pool.table[layer], self.seq, h_ids, h_w, h_x, h_has, h_post,
                         h_tokens, score)
        # this layer's copies, before the next layer's prefetch; those prefetched for it
        landed = [e for e in (self.staging.landed() if staged is not None else None, pre_landed) if e is not None]
        if rows is not None and self.staging is not None and self.staging.prefetches and T >= self.prefetch_from:
            self.staging.observe(layer, topk.ids, rows)
            self.staging.prefetch_next(layer)  # the next layer's copies, on their own stream while this one runs
        # a pass's padding rows (from count on) compute no expert
        gpu = pool.forward(x, pool.slots_in(pool.table[layer], topk.ids, count), topk.weights, out_dtype=torch.float32)
        if both is not None:
            for event in landed:
                self.hybrid.copies_landed(event)
            gpu = gpu + pool.forward(x, pool.slots_in(both.row, topk.ids, count), topk.weights, out_dtype=torch.float32)
        y = torch.empty_like(x)
        self.hs.wait_add_rows(gpu, h_out, h_has, h_done, self.seq, count if count is not None else self.one, y,
                              self.join)
        return y


def for_graphs(backend, core: int = -1, max_rows: int = 1):
    """The backend a decode graph can capture: a cache (HybridExperts with an admission) is cut
    into graph segments at each MoE layer (layers/moe/segmented.py); a HybridExperts with cold
    experts gets the mapped-memory handshake (native CPU backend only), its poller on `core`, for
    captured passes of up to max_rows rows; any other backend as it is."""
    if isinstance(backend, HybridExperts) and backend.admission is not None:
        return SegmentedExperts(backend) if backend.on_cuda else backend
    if isinstance(backend, HybridExperts) and not backend.capturable and backend.cpu.backend == "native":
        return GraphHybridExperts(backend, core, max_rows)
    return backend
