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
   from its page-locked host stack (pool.py HostExperts, the upload path's source) into its flex slot, on
   the default grid (a program per 64 KiB of each expert) or on OSTINATO_STAGE_PROGRAMS programs. Both copy
   at the link's pace, but the grid slowed GPU work on another stream 1.51x (12 experts of the 30B shape) and
   2.01x (24), 64 programs 1.23x and 1.42x (scripts/bench_stage_copy.py, one H100, results/2026-12-08-h100-s57/
   l_bench_stage_copy.txt), and that work is step 3's. In a replay neither has been measured against the other:
   the grid stays the default until one is.
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

Prefetching the next layer (OSTINATO_PREFETCH, a count P of experts a layer; 0: off): the CPU branch
of a layer is the longer side of most captured passes, and the PCIe link idles while it runs. So a
captured pass of at least OSTINATO_PREFETCH_FROM rows also copies, while a layer runs, the next layer's
P cold experts of most routes in the passes before it (`observe`: each layer's routes per expert over
the real rows, decayed by PREFETCH_DECAY a pass; agent sessions route stably), into a region of P flex
slots at the top of the pool's flex region (two regions, the layers taking them in turn, so a layer's
copies never overwrite what the layer before it still reads). The next layer treats them as staged:
its plan leaves them out, its worker leaves their routes out, and its GPU branch over the staged row
computes them. An expert prefetched and not routed cost its copy and nothing else; which experts run
where never changes what the layer computes. The copies of the next layer go after this layer's own
on a stream of their own, by a few programs (OSTINATO_PREFETCH_PROGRAMS, default 64: kernels/triton/
stage.py copy_experts' `programs`), and the next layer's staged branch waits for both its own copies
and those (`landed`).

A pass of fewer than OSTINATO_PREFETCH_FULL_FROM real rows (default 88) copies P // 2: P copies take about
P * 57 us a layer at the link's 50 GB/s, longer than a short pass's layer, so a short pass waits for them.

The defaults, P = 24 and half of it below 88 rows, are session 57's (one H100 machine, the quantized GPU
kernels of 7c5ca7c, which took a layer's Q4_K prefill at 256 tokens from 1066 to 589 us, and their tuning;
8 held-out sessions, one replay each; results/2026-12-08-h100-s57/): the median TTFT after tool outputs was
101.9 ms at P = 12 and 91.7 at P = 24. By new tokens, P = 24 took 0.92-0.93x as long from 64 to 511 tokens
(median per-turn ratios, 36 turns), but every turn of 33-79 tokens took 70-75 ms at P = 24 (one 106) against
47-71 at P = 12 (the copies' floor: 24 experts a layer over 48 layers is 66 ms at 50 GB/s), and from 95 tokens on
every turn up to 138 was faster at P = 24. 88 lies between: the rule itself has not been replayed.

Before it, P = 12 was measured on the Q4_K_M 30B shape under 12 GiB on one H100 machine, replaying the
held-out sessions (results/2026-12-07-h100-s54/, three calls): the median TTFT after tool outputs was
141.4, 142.5, 148.1 and 136.0 ms with P = 0, 129.6 and 119.0 with P = 12, 127.5, 127.1 and 120.1 with P = 24;
against the same call's P = 0, the turns of 64-255 new tokens took 0.80-0.85x as long at P = 12 and 24 in
both calls that ran both (median ratio per band), those of 256-511 0.83-0.87x in one and 0.97-0.99x in the
other. P = 24 left the GPU side the longer one (a 253-token turn: the worker's wait for the GPU 15 ms at P = 0,
17 at P = 12, 47 at P = 24). As first built (one copy stream, the copies on the default grid) it was slower:
147.3 ms at P = 12 and 200.0 at P = 24 against 111.5 (results/2026-12-07-h100-s53/). P = 24 on 132 programs
(session 56, one H200, 4 held-out sessions, both replays steady) took 156.9 ms against 124.2 at the default: it
left 353-538 more experts a pass to the GPU and cut the worker's compute by 7-33 ms, but the worker's wait for
the GPU grew by 42-64 ms a pass (results/2026-12-07-h200-s56/).

Legend: B rows of a captured pass, n of them real, K top-k, E experts of a layer.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ostinato.config import ConfigError, env_count
from ostinato.layers.moe.backend import StepRows


ROW_KERNELS_STAGE_ROUTES = 12  # default_stage_routes: the cold experts on the CPU's row kernels
TILED_STAGE_ROUTES = 16  # and with the int8 tiles taking their larger groups of routes
BALANCE = "balance"
MEAN = "mean"
DEFAULT_PREFETCH = 24  # OSTINATO_PREFETCH's default: experts a layer (the module docstring's figures)
DEFAULT_PREFETCH_FROM = 64  # OSTINATO_PREFETCH_FROM's: the fewest rows of a captured pass that prefetches
DEFAULT_PREFETCH_FULL_FROM = 88  # OSTINATO_PREFETCH_FULL_FROM's: fewer real rows copy half of P (docstring)
DEFAULT_PREFETCH_PROGRAMS = 64  # OSTINATO_PREFETCH_PROGRAMS': the prefetch copies' programs (P = 24 on 132: slower)
DEFAULT_STAGE_PROGRAMS = 0  # OSTINATO_STAGE_PROGRAMS': a layer's own staging copies on the default grid (docstring)
PREFETCH_DECAY = 0.75  # a layer's route history, each pass: about the last four passes count (not tuned)


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


def env_prefetch() -> int:
    """OSTINATO_PREFETCH: the cold experts a captured pass copies for each next layer (0: none)."""
    return env_count("OSTINATO_PREFETCH", DEFAULT_PREFETCH, "experts a layer")


def env_prefetch_from() -> int:
    """OSTINATO_PREFETCH_FROM: the fewest rows of a captured pass that prefetches."""
    n = env_count("OSTINATO_PREFETCH_FROM", DEFAULT_PREFETCH_FROM, "rows")
    if n < 2:
        raise ConfigError(f"OSTINATO_PREFETCH_FROM must be at least 2 rows (a decode step never prefetches), not {n}")
    return n


def env_prefetch_full_from() -> int:
    """OSTINATO_PREFETCH_FULL_FROM: the fewest real rows of a pass that copies all P experts a layer; fewer copy
    P // 2 (0: every prefetching pass copies P)."""
    return env_count("OSTINATO_PREFETCH_FULL_FROM", DEFAULT_PREFETCH_FULL_FROM, "rows")


def prefetch_limit(count: int, full_from: int, n: torch.Tensor) -> torch.Tensor:
    """The experts a pass of n real rows (n [1] int32, on the device) copies for each next layer: count, or
    count // 2 in a pass of fewer than full_from rows (0: count always). No host sync: capturable."""
    if not full_from:
        return torch.full_like(n, count)
    half = count // 2  # arithmetic, not torch.where on Python numbers: plainly capturable
    return half + (count - half) * (n >= full_from).to(n.dtype)


def top_cold(score: torch.Tensor, count: int, limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts to prefetch by score [E] (0 where resident or never routed): the `limit` best (limit [1],
    at most count) of positive score, as pick [E] bool and rank [E] int32 (a picked expert's place among the
    count best, its slot in the region)."""
    top = torch.topk(score, count)
    keep = (top.values > 0) & (torch.arange(count, device=score.device) < limit)
    pick = torch.zeros_like(score, dtype=torch.bool).scatter_(0, top.indices, keep)
    rank = torch.zeros_like(score, dtype=torch.int32).scatter_(
        0, top.indices, torch.arange(count, dtype=torch.int32, device=score.device))
    return pick, rank


def env_prefetch_programs() -> int:
    """OSTINATO_PREFETCH_PROGRAMS: the programs the prefetch's copies run on (kernels/triton/stage.py)."""
    n = env_count("OSTINATO_PREFETCH_PROGRAMS", DEFAULT_PREFETCH_PROGRAMS, "programs")
    if n < 1:
        raise ConfigError("OSTINATO_PREFETCH_PROGRAMS must be at least 1 program")
    return n


def env_stage_programs() -> int | None:
    """OSTINATO_STAGE_PROGRAMS: the programs a layer's own staging copies run on (kernels/triton/stage.py); None
    (0, the default): the default grid."""
    return env_count("OSTINATO_STAGE_PROGRAMS", DEFAULT_STAGE_PROGRAMS, "programs") or None


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
         flex_lo: int, host=None, programs: int | None = None) -> None:
    """dst[flex_lo + rank[e]] = src[rows[e]] for each staged expert e (pick [E]); src [Ec, ...] a layer's
    host stack, dst [slots, ...] a pool tensor, of the same dtype and shape past the first dimension;
    rows [E] int32 (an expert's row in src). On CUDA one kernel with no host sync, reading src through
    `host` (its HostPointer, as a byte view: kernels/triton/stage.py; programs: on that many, leaving the
    SMs to other work, else the default grid); elsewhere torch's indexing."""
    if dst.device.type != "cuda":
        e = pick.nonzero().flatten()
        dst[flex_lo + rank[e].long()] = src[rows[e].long()]
        return
    from ostinato.kernels.triton.stage import copy_experts

    copy_experts(host, as_bytes(dst), rows, pick, rank, flex_lo, programs)


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


def joined(a: Staged | None, b: Staged | None) -> Staged | None:
    """Two disjoint sets of a layer's staged experts as one (the prefetched and the layer's own): a row
    over both, either's pick; a rank only where one is None (the copies took each set's own)."""
    if a is None or b is None:
        return a if b is None else b
    return Staged(torch.where(a.row >= 0, a.row, b.row), a.pick | b.pick, a.rank)


class PassStaging:
    """The staging of a HybridExperts' captured passes (the module docstring): per layer with cold
    experts, its host stacks and pool tensors paired, and the experts' host rows on the device; the
    copies on the executor's copy stream (HybridExperts.on_copy_stream); with `prefetch`, the next
    layer's experts too."""

    def __init__(self, hybrid, rule: int | MeanRoutes | StageCosts, prefetch: int = 0):
        """rule: plan's, a count m >= 1, MeanRoutes over one, or the calibrated costs; prefetch: the experts
        a pass copies for each next layer (at most a third of its pool's flex slots; 0: none)."""
        if least_routes(rule) < 1:
            raise ValueError(f"the staging rule's count must be at least 1, not {least_routes(rule)}")
        self.rule, self.pools, self.hybrid, self.device = rule, hybrid.pools, hybrid, hybrid.device
        self.layers = [l for l, cold in hybrid.has_cold.items() if cold]
        self.index = {l: i for i, l in enumerate(self.layers)}
        self.rows, self.pairs = {}, {}
        for layer in self.layers:
            pool, w = hybrid.pools.of(layer), hybrid.host.layers[layer]
            self.rows[layer] = hybrid.host.rows[layer].to(hybrid.device)
            tensors = [(w.w13, pool.w13), (w.w2, pool.w2)]
            if pool.b13 is not None:
                tensors += [(w.b13, pool.b13), (w.b2, pool.b2)]
            self.pairs[layer] = [(src, dst, host_pointer(src) if dst.is_cuda else None) for src, dst in tensors]
        # bytes staged over all replays, on the device (a replay cannot count on the host); those prefetched
        # among them
        self.staged_bytes = torch.zeros((), dtype=torch.int64, device=hybrid.device)
        self.prefetched_bytes = torch.zeros((), dtype=torch.int64, device=hybrid.device)
        # prefetching: each pool's count (its two regions at the top of its flex region), each layer's route
        # history [layers, E], and the experts copied for a layer still to come in this pass
        self.prefetch = {id(p): min(prefetch, (p.num_slots - p.flex_lo) // 3) for p in self.pools.groups}
        E = self.pools.groups[0].table.shape[1]
        self.history = torch.zeros((len(self.layers), E), dtype=torch.float32, device=hybrid.device)
        self.pending: dict[int, tuple[Staged, object]] = {}  # layer -> its experts and their copies' event
        self.programs = env_prefetch_programs()
        self.stage_programs = env_stage_programs()
        self.full_from = env_prefetch_full_from()
        self.limits: dict[int, torch.Tensor] = {}  # each pool's prefetch count in this pass (start_pass)
        # the prefetch's own stream: a layer's staging copies must not queue behind the next layer's prefetch
        self.stream = torch.cuda.Stream(hybrid.device) if hybrid.on_cuda and self.prefetches else None

    @property
    def prefetches(self) -> bool:
        return any(self.prefetch.values())

    def cap(self, layer: int) -> int:
        """The flex slots a layer's own staging takes (from flex_lo): those below the prefetch regions."""
        pool = self.pools.of(layer)
        return pool.num_slots - pool.flex_lo - 2 * self.prefetch[id(pool)]

    def choose(self, layer: int, ids: torch.Tensor, rows: StepRows, prefetched: Staged | None = None) -> Staged | None:
        """The layer's experts this pass of `rows` stages, by the rule, on the current stream (no host sync:
        on CUDA one kernel, kernels/triton/stage.py plan_experts; elsewhere `plan`), less those `prefetched`
        for it; None for a pool without flex slots (its plan dropped the upload path), which stages nothing."""
        pool = self.pools.of(layer)
        cap = self.cap(layer)
        if cap <= 0:
            return None
        table = pool.table[layer]
        if prefetched is not None:  # already in flex slots: not cold to the rule
            table = torch.where(prefetched.pick, 0, table)
        if ids.is_cuda:
            from ostinato.kernels.triton.stage import plan_experts

            return Staged(*plan_experts(ids, rows.count, table, cap, pool.flex_lo, pool.expert_bytes,
                                        self.staged_bytes, **kernel_rule(self.rule)))
        staged = Staged(*plan(ids, rows.valid, table, self.rule, cap, pool.flex_lo))
        self.staged_bytes += staged.pick.sum() * pool.expert_bytes
        return staged

    def stage(self, layer: int, staged: Staged) -> None:
        """Copy the layer's chosen experts into its flex slots (from the pool's flex_lo) on the executor's copy
        stream, after all of the current stream's work so far (the flex slots' earlier readers among it). The
        GPU branch reads them over staged.row once the copies have landed (`landed`)."""
        self._copy(layer, staged, self.pools.of(layer).flex_lo)

    def _copy(self, layer: int, staged: Staged, flex_lo: int, prefetch: bool = False) -> None:
        """`stage`'s copies from flex slot flex_lo, on OSTINATO_STAGE_PROGRAMS' programs (None: the default grid);
        with prefetch, on the prefetch's own stream by a few programs (OSTINATO_PREFETCH_PROGRAMS), since they run
        beside the work they do not feed."""
        with self.hybrid.on_copy_stream(stream=self.stream if prefetch else None):
            if staged.pick.is_cuda:  # read on the copy stream: the allocator must not hand them out before
                for t in (staged.pick, staged.rank):
                    t.record_stream(torch.cuda.current_stream(self.device))
            for src, dst, host in self.pairs[layer]:
                copy(src, dst, self.rows[layer], staged.pick, staged.rank, flex_lo, host,
                     self.programs if prefetch else self.stage_programs)

    def landed(self, stream=None):
        """An event after the copies issued so far on the copy stream (or `stream`), for the current stream to
        wait on (HybridExperts.copies_landed); None off CUDA, where they ran in order."""
        stream = self.hybrid.copy_stream if stream is None else stream
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def start_pass(self, rows: StepRows | None = None) -> None:
        """A pass begins: nothing is prefetched for it yet. A captured pass's rows set, once for all its layers,
        how many experts each pool prefetches (prefetch_limit)."""
        self.pending.clear()
        if rows is not None and self.prefetches:
            self.limits = {pid: prefetch_limit(count, self.full_from, rows.count)
                           for pid, count in self.prefetch.items() if count}

    def observe(self, layer: int, ids: torch.Tensor, rows: StepRows) -> None:
        """Fold this pass's routes of `layer` over its real rows into the layer's history (capturable)."""
        h = self.history[self.index[layer]]
        h.mul_(PREFETCH_DECAY)
        h.scatter_add_(0, ids.reshape(-1).long(), rows.valid.to(h.dtype)[:, None].expand(ids.shape).reshape(-1))

    def prefetched(self, layer: int) -> tuple[Staged | None, object]:
        """The experts this pass copied for `layer` while the layer before it ran, and the event after their
        copies ((None, None): none; the event None off CUDA)."""
        return self.pending.pop(layer, (None, None))

    def prefetch_next(self, layer: int) -> None:
        """Copy the next layer's cold experts of most routes by its history (at most its pool's count, half
        of it in a pass of fewer than full_from real rows; those with some history) into the next layer's
        region, on the prefetch's own stream, by a few programs (no host sync). Its region is the one the
        layer before this one read: the copies wait for all of the current stream's work, which holds that
        layer's GPU branch."""
        i = self.index[layer] + 1
        if i == len(self.layers):
            return
        nxt = self.layers[i]
        pool = self.pools.of(nxt)
        count = self.prefetch[id(pool)]
        if not count:
            return
        lo = pool.num_slots - (2 - i % 2) * count  # two regions, the layers taking them in turn
        score = torch.where(pool.table[nxt] < 0, self.history[i], 0.0)
        pick, rank = top_cold(score, count, self.limits[id(pool)])
        staged = Staged(torch.where(pick, rank + lo, -1).to(torch.int32), pick, rank)
        moved = pick.sum() * pool.expert_bytes
        self.staged_bytes += moved
        self.prefetched_bytes += moved
        self._copy(nxt, staged, lo, prefetch=True)
        self.pending[nxt] = staged, self.landed(self.stream)
