"""Cold experts that a captured prefill pass stages itself, by the device's own copies.

A pass captured as a graph (engine/graph.py PassGraphs) takes no host decision, so the split with
uploads (hybrid.py), which picks the pass's most-routed cold experts on the host, is not open to
it: its CPU branch computes every cold route. At 255 tokens that was 245 ms of a 263 ms pass
(results/2026-12-06-h100-s38/). Yet a kernel reads page-locked host memory at 51 GB/s, 92-94% of
a copy engine's memcpy (scripts/bench_zero_copy.py, results/2026-12-06-h100-s39/). So in each MoE
layer of a captured pass of n real rows:

1. `plan`: the device counts each cold expert's routes among the n rows and stages, by the rule, at
   most `cap` of them (the pool's flex slots): expert e into flex slot flex_lo + rank(e), rank being
   its place among them. -> the staged row: those experts' flex slots, every other expert < 0. The
   rule (OSTINATO_STAGE_ROUTES): the cold experts with at least m routes (default_stage_routes: m = 16
   where the CPU's int8 tiles take the quantized experts' larger groups, else 12), or
   "balance": as many of the most-routed as the split with uploads would upload (MixedPass.choose's
   count, by the calibrated costs: the copies against the CPU branch's time), where the placement has
   a calibration (HybridExperts.stage_costs; without one, the default m), or "mean": at least m routes and
   at least the layer's mean expert's in that pass (MeanRoutes). A pass of fewer rows than `stage_from`
   (OSTINATO_STAGE_FROM, by default the rule's m) stages nothing and runs none of this.
2. `copy`: on the executor's copy stream, a kernel copies each staged expert's blocks (and biases)
   from its page-locked host stack (pool.py HostExperts, the upload path's source) into its flex slot.
3. Meanwhile the GPU branch runs over the layer's own index row: the hot routes. Then the stream
   waits for the copies and the GPU branch runs over the staged row, and the two sums add. That is
   the order of the host-driven split with uploads (HybridExperts.split_path): the pool's experts
   never wait for copies they do not read.

In both GPU branches the pass's padding rows (from n on) take the zero slots (pool.py slots_in's
count), so the expert kernels skip them.

The pass posts the staged experts' marks to the CPU worker with its routing (handshake.py post_rows,
GraphHandshake.staged), and the worker leaves their routes out: no expert is computed twice or never,
and the rule lives here alone.

- A layer's copies overwrite the previous layer's flex slots once that layer's GEMM is done: the copy
  stream waits for the current stream's work before each layer's copies. The host's record of which
  experts the flex slots hold (ExpertPool.stage) is forgotten before each such pass (graph_hybrid.py).
- Borrowed experts leave the flex slots before any prefill pass (HybridExperts.before_prefill).
- Decode steps stage nothing: one token routes once to each expert.
- Staged routes run on the GPU's kernels, in bf16 activations, where the CPU's quantized
  kernels would have rounded theirs to int8 blocks: the sum moves by rounding, as it does under
  the split with uploads.

The default rule (default_stage_routes; OSTINATO_STAGE_ROUTES sets another, 0 turns staging off) was first
m = 8, measured on the Q4_K_M 30B shape under 12 GiB on an H100 (results/2026-12-06-h100-s40/): replayed
passes of 128 / 192 / 255 tokens after a 4096-token context took 140.0 / 221.7 / 258.8 ms unstaged, 114.8 /
169.8 / 193.3 with m = 4 (the GPU's copies the longer side), 102.8 / 122.2 / 134.6 with m = 8, and 155.9 /
195.7 / 209.9 with m = 16 (the CPU's side the longer). Session 42 replayed the held-out sessions on one H100
machine, with the order of 3., the padding's zero slots, the posted marks, and 144 more experts resident
(results/2026-12-06-h100-s42/): the median TTFT after tool outputs was 152.7 and 153.3 ms at m = 8, 118.4
at m = 12, 118.3 and 115.9 at m = 12 with the CPU's AMX int8 tiles (cpu_experts.py AMX_INT8_MIN_TOKENS), and
107.8 at m = 16 with the tiles. The turns of 256-511 new tokens took 0.81x as long at m = 12 and 0.69x at
m = 16 with the tiles (the median of the turns' ratios; the sums of the runs of one setting within 1% of
each other there), those of 128-255 0.84-0.87x, those of 64-127 1.04-1.09x; TPOT and the other bands did not
move. Hence m = 16 where the tiles run and 12 where they do not (m = 16 on the row kernels was not replayed).
Session 43, on one H100 machine with 3007 experts resident (results/2026-12-06-h100-s43/): 105.9 ms at m = 12,
101.1 and 102.1 at m = 16, 102.1 at m = 24, with the tiles; so m = 16 stays ("mean", MeanRoutes below, showed
no gain in session 44's replay).

Legend: B rows of a captured pass, n of them real, K top-k, E experts of a layer.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ostinato.config import ConfigError
from ostinato.layers.moe.backend import StepRows


ROW_KERNELS_STAGE_ROUTES = 12  # default_stage_routes: the cold experts on the CPU's row kernels
TILED_STAGE_ROUTES = 16  # and with the int8 tiles taking their larger groups of routes
BALANCE = "balance"
MEAN = "mean"


class MeanRoutes(NamedTuple):
    """The rule "mean": the cold experts with at least max(least, ceil(n K / E)) routes among a pass's n
    real rows, the mean routes of an expert of the layer in that pass. A fixed m stages as many experts of
    a 400-token pass as one of 200 where each has twice the routes, so the CPU's share shrinks as passes
    grow; this keeps it. Why try it (results/2026-12-06-h100-s43/, one held-out replay a setting on one
    H100): the turns of 256-511 new tokens took 1262 ms in all at m = 24 against 1405 at m = 16, and those
    of 128-255 took 953 against 905-907; m = 12 took 1648 and 900. Replayed in session 44 between two runs at
    m = 16 on one H100 (results/2026-12-06-h100-s44/, A/B/A): no gain; it was slower in every band of new tokens,
    those it cannot change too, so it stays an option."""

    least: int


def default_stage_routes() -> int:
    """The default rule's m: TILED_STAGE_ROUTES where the CPU experts use the int8 tiles by default
    (cpu_experts.int8_tiles_by_default), else ROW_KERNELS_STAGE_ROUTES (the module docstring's figures)."""
    from ostinato.layers.moe.cpu_experts import int8_tiles_by_default

    return TILED_STAGE_ROUTES if int8_tiles_by_default() else ROW_KERNELS_STAGE_ROUTES


class StageCosts(NamedTuple):
    """The split with uploads' costs (hybrid.py MixedPass) in whole nanoseconds, so that the device's
    comparisons are exact: an upload per expert; the CPU branch's alpha, per distinct expert, per route."""

    upload: int
    alpha: int
    expert: int
    route: int

    @classmethod
    def of(cls, mixed) -> "StageCosts":
        return cls(*(round(v * 1e6) for v in (mixed.upload_ms, mixed.alpha_ms, mixed.beta_expert_ms,
                                             mixed.beta_route_ms)))


def env_stage_routes() -> int | str:
    """The rule: OSTINATO_STAGE_ROUTES, a count m (0: no staging), "balance" (the split with uploads'
    choice, by the calibrated costs: `plan`) or "mean" (MeanRoutes, at least default_stage_routes()), else
    default_stage_routes()."""
    rule = _env_rule()
    return default_stage_routes() if rule is None else rule


def least_routes(rule: int | MeanRoutes | StageCosts) -> int:
    """The fewest routes with which the rule stages an expert: m, MeanRoutes' least, 1 under the costs."""
    if isinstance(rule, StageCosts):
        return 1
    return rule.least if isinstance(rule, MeanRoutes) else rule


def env_stage_from() -> int | None:
    """OSTINATO_STAGE_FROM, the fewest rows of a captured pass that stages (None: unset, stage_from's default)."""
    v = os.environ.get("OSTINATO_STAGE_FROM")
    if v is not None and (not v.isdigit() or int(v) < 1):
        raise ConfigError(f"OSTINATO_STAGE_FROM must be a count of rows, at least 1, not {v!r}")
    return None if v is None else int(v)


def stage_from(rule: int | MeanRoutes | StageCosts) -> int:
    """The fewest rows of a captured pass that stages (GraphHybridExperts): OSTINATO_STAGE_FROM, else the rule's
    least_routes, since a pass of fewer rows cannot give an expert that many. Passes of fewer rows run no
    staging kernel: the plan, the copies, the wait and the second GPU branch."""
    n = env_stage_from()
    return least_routes(rule) if n is None else n


def stages() -> bool:
    """Whether captured passes stage cold experts at all (OSTINATO_STAGE_ROUTES unset or not 0), without
    resolving the default's m (which loads the CPU extension to ask for its tiles)."""
    return _env_rule() != 0


def _env_rule() -> int | str | None:
    v = os.environ.get("OSTINATO_STAGE_ROUTES")
    if v is None or v in (BALANCE, MEAN):
        return v
    if not v.isdigit():
        raise ConfigError(f"OSTINATO_STAGE_ROUTES must be a count of routes (0: off), {BALANCE!r} or {MEAN!r}, "
                          f"not {v!r}")
    return int(v)


def resolve(rule: int | str, costs) -> int | MeanRoutes | StageCosts:
    """A rule as `plan` takes it: "balance" by the calibrated costs (the placement's MixedPass; without
    them the default m), "mean" as MeanRoutes over the default m, a count as it is."""
    if rule == BALANCE:
        return StageCosts.of(costs) if costs is not None else default_stage_routes()
    if rule == MEAN:
        return MeanRoutes(default_stage_routes())
    return rule


def describe(rule: int | str) -> str:
    """The rule in words, as a report says which cold experts a captured pass stages."""
    if rule == BALANCE:
        return "as many of its most-routed cold experts as the calibrated costs balance against the CPU branch"
    if rule == MEAN:
        return ("its cold experts of at least as many routes as the layer's mean expert in that pass, and at least "
                "the default count")
    return f"its cold experts of at least {rule} routes"


def kernel_rule(rule: int | MeanRoutes | StageCosts) -> dict:
    """`plan`'s rule as the plan kernel (kernels/triton/stage.py plan_experts) takes it, in plain values."""
    if isinstance(rule, StageCosts):
        return {"costs": tuple(rule)}
    return {"least": least_routes(rule), "mean": isinstance(rule, MeanRoutes)}


def plan(ids: torch.Tensor, real: torch.Tensor, table: torch.Tensor, rule: int | MeanRoutes | StageCosts,
         cap: int, flex_lo: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The staging rule on the device, with no host sync (capturable). ids [B, K] of a pass whose real
    rows `real` [B] bool marks (a captured pass's StepRows.valid); table [E] int32, the layer's index
    row (< 0: cold). The rule:
      m (int)     the cold experts with at least m routes among the real rows, the first `cap` in expert
                  order;
      MeanRoutes  likewise with m = max(least, ceil(n K / E)) for the n real rows;
      StageCosts  the split with uploads' choice (MixedPass.choose): of the cold experts routed, the k
                  most routed (a tie: the lower id), k of least cost max(k upload, alpha + expert (n - k)
                  + route * their routes left) over k <= min(n, cap) (the uploads alone at k = n), the
                  smallest k on a tie.
    -> (staged [E] int32: a staged expert's flex slot, -1 for every other expert; pick [E] bool: staged;
    rank [E] int32: a staged expert's place among them)."""
    B, K = ids.shape
    E = table.shape[0]
    routes = torch.zeros(E, dtype=torch.int32, device=ids.device)
    routes.scatter_add_(0, ids.reshape(-1).long(), real.to(torch.int32)[:, None].expand(B, K).reshape(-1))
    if isinstance(rule, StageCosts):
        routes = torch.where(table < 0, routes, 0).long()
        experts = torch.arange(E, device=ids.device)
        order = torch.argsort(routes * (E + 1) + (E - experts), descending=True)  # keys distinct: one order
        rank = torch.empty_like(experts)
        rank[order] = experts
        left = routes.sum() - torch.cat([routes.new_zeros(1), torch.cumsum(routes[order], 0)])  # [E + 1]
        n = (routes > 0).sum()
        k = torch.arange(E + 1, device=ids.device)
        up = k * rule.upload
        cost = torch.where(k >= n, up, torch.maximum(up, rule.alpha + rule.expert * (n - k) + rule.route * left))
        cost = torch.where(k <= torch.clamp(n, max=cap), cost, torch.iinfo(torch.int64).max)
        pick = rank < torch.argmin(cost)  # argmin: the first of equal costs
        rank = rank.to(torch.int32)
    else:
        m = rule
        if isinstance(rule, MeanRoutes):
            m = torch.clamp((real.sum() * K + E - 1) // E, min=rule.least)
        pick = (table < 0) & (routes >= m)
        rank = torch.cumsum(pick.to(torch.int32), 0, dtype=torch.int32) - 1
        pick &= rank < cap
    return torch.where(pick, rank + flex_lo, -1).to(torch.int32), pick, rank


def copy(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor, pick: torch.Tensor, rank: torch.Tensor,
         flex_lo: int, host=None) -> None:
    """dst[flex_lo + rank[e]] = src[rows[e]] for each staged expert e (pick [E]); src [Ec, ...] a layer's
    host stack, dst [slots, ...] a pool tensor, of the same dtype and shape past the first dimension;
    rows [E] int32 (an expert's row in src). On CUDA one kernel with no host sync, reading src through
    `host` (its HostPointer, as a byte view: kernels/triton/stage.py); elsewhere torch's indexing."""
    if dst.device.type != "cuda":
        e = pick.nonzero().flatten()
        dst[flex_lo + rank[e].long()] = src[rows[e].long()]
        return
    from ostinato.kernels.triton.stage import copy_experts

    copy_experts(host, as_bytes(dst), rows, pick, rank, flex_lo)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, one row per entry of its first dimension: [N, bytes]."""
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def host_pointer(t: torch.Tensor):
    """A page-locked host stack's bytes as a CUDA kernel's pointer (its UVA address)."""
    from ostinato.kernels.triton.handshake import HostPointer

    return HostPointer(as_bytes(t))


class Staged(NamedTuple):
    """A layer's staged experts in a pass (plan's three tensors, on the device)."""

    row: torch.Tensor  # [E] int32: a staged expert's flex slot, -1 for every other expert
    pick: torch.Tensor  # [E] bool: staged
    rank: torch.Tensor  # [E] int32: a staged expert's place among them


class PassStaging:
    """The staging of a HybridExperts' captured passes (the module docstring): per layer with cold
    experts, its host stacks and pool tensors paired, and the experts' host rows on the device; the
    copies on the executor's copy stream (HybridExperts.on_copy_stream)."""

    def __init__(self, hybrid, rule: int | MeanRoutes | StageCosts):
        """rule: plan's, a count m >= 1, MeanRoutes over one, or the calibrated costs."""
        if least_routes(rule) < 1:
            raise ValueError(f"the staging rule's count must be at least 1, not {least_routes(rule)}")
        self.rule, self.pools, self.hybrid, self.device = rule, hybrid.pools, hybrid, hybrid.device
        self.layers = [l for l, cold in hybrid.has_cold.items() if cold]
        self.rows, self.pairs = {}, {}
        for layer in self.layers:
            pool, w = hybrid.pools.of(layer), hybrid.host.layers[layer]
            self.rows[layer] = hybrid.host.rows[layer].to(hybrid.device)
            tensors = [(w.w13, pool.w13), (w.w2, pool.w2)]
            if pool.b13 is not None:
                tensors += [(w.b13, pool.b13), (w.b2, pool.b2)]
            self.pairs[layer] = [(src, dst, host_pointer(src) if dst.is_cuda else None) for src, dst in tensors]
        # bytes staged over all replays, on the device (a replay cannot count on the host)
        self.staged_bytes = torch.zeros((), dtype=torch.int64, device=hybrid.device)

    def choose(self, layer: int, ids: torch.Tensor, rows: StepRows) -> Staged | None:
        """The layer's experts this pass of `rows` stages, by the rule, on the current stream (no host sync:
        on CUDA one kernel, kernels/triton/stage.py plan_experts; elsewhere `plan`); None for a pool without
        flex slots (its plan dropped the upload path), which stages nothing."""
        pool = self.pools.of(layer)
        cap = pool.num_slots - pool.flex_lo
        if not cap:
            return None
        if ids.is_cuda:
            from ostinato.kernels.triton.stage import plan_experts

            return Staged(*plan_experts(ids, rows.count, pool.table[layer], cap, pool.flex_lo, pool.expert_bytes,
                                        self.staged_bytes, **kernel_rule(self.rule)))
        staged = Staged(*plan(ids, rows.valid, pool.table[layer], self.rule, cap, pool.flex_lo))
        self.staged_bytes += staged.pick.sum() * pool.expert_bytes
        return staged

    def stage(self, layer: int, staged: Staged) -> None:
        """Copy the chosen experts into their flex slots on the executor's copy stream, after all of the
        current stream's work so far (the flex slots' earlier readers among it). The GPU branch reads them
        over staged.row once the copies have landed (HybridExperts.copies_landed)."""
        flex_lo = self.pools.of(layer).flex_lo
        with self.hybrid.on_copy_stream():
            if staged.pick.is_cuda:  # read on the copy stream: the allocator must not hand them out before
                for t in (staged.pick, staged.rank):
                    t.record_stream(torch.cuda.current_stream(self.device))
            for src, dst, host in self.pairs[layer]:
                copy(src, dst, self.rows[layer], staged.pick, staged.rank, flex_lo, host)
