"""Capacity test: how many hot experts a GPU memory budget holds (DESIGN.md, "Offline").

    hot slots = (budget - dense - kv - activations - margin) / expert_bytes - K - flex

* dense: every non-expert tensor of the model in the compute dtype (attention, norms,
  routers, embeddings, head, dense MLPs), counted on a meta-device build of the model, but
  the linear weights a GPU keeps in their GGUF blocks (layers/quant_linear.py) in those;
* kv: the KV cache of the longest development request (the engine preallocates it);
* activations: a conservative bound on the live buffers of the largest forward pass
  (see `activation_bytes`; T tokens of a pass attending to N cached tokens);
* margin: a fixed part (1 GiB) plus a share of the budget (none by default): the CUDA context and
  whatever else the process holds outside torch's allocator (the cap counts the process as
  nvidia-smi does, so the allocator's limit is the budget less that: engine/gpu_memory.py),
  allocator rounding, CUDA workspaces. The share was 5% until session 43, which measured what it
  cost on the 30B Q4_K_M file under 12 GiB on an H100 (results/2026-12-06-h100-s43/): without it
  3007 experts stayed resident instead of 2770; the plan's largest pass (2048 tokens over 8292)
  peaked at 10.4 GiB allocated and 10.7 reserved where the plan expected at most 11.0; the held-out
  replays held 11888 MiB by nvidia-smi (12288 the cap) and answered tool outputs in 101-102 ms
  instead of 109. `ostinato plan` runs that largest pass under the cap wherever it has a GPU;
* K zero slots (cold routes read them) and the flex slots of the upload path: the
  engine allocates max over layers of the layer's cold experts, so flex depends on the
  fill, at most a bound M per format group: flex(s) = min(M, max over layers of the cold
  experts under fill(s)). Since fill(s + 1) adds one expert to fill(s), the most cold
  experts of a layer drop by at most one, and so does their minimum with a constant M:
  s + flex(s) never decreases with s, and the largest s with s + K + flex(s) <= slots is
  found by bisection (the fixed point of "fill, count flex, refill"). M must not depend on
  s: it is fixed before the bisection, from the settings and the pool's bytes.
* the bound M (`flex_bound`): `CapacitySettings.max_flex` slots if given, else a quarter
  (`flex_share`) of the bytes left for the pools, split evenly over the format groups, in
  the largest group's expert bytes. Why a bound: unbounded, a DeepSeek-V3 layer's 256 cold
  experts of 84 MiB (bf16) reserve 21 GiB of staging, more than a 24 GiB cap leaves for the
  whole pool, so not one expert could be resident; with it, an upload-path pass whose
  distinct cold experts outnumber the flex slots uploads them in waves of as many as the
  slots hold (layers/moe/hybrid.py), and a split with uploads uploads the most-routed that
  fit, exact whatever the pass. Why a quarter:
  a flex slot is an expert slot a hot expert cannot take, worth something only to passes
  at or above Np, whereas a hot expert serves its routes in every pass; and it leaves the
  plans of 128-expert models as they were: the plans in results/ (Qwen3-30B-A3B, bf16 at
  32 GiB, Q4_K_M at 12 GiB) give their flex slots 3-9% of the pool's bytes, and even a
  layer with all 128 experts cold stays under a quarter of the pool there (and for
  Qwen3-235B-A22B from 80 GiB, gpt-oss-120b from 24 GiB). Evenly over the groups: a
  layer's upload stages in its own group's pool, and any group may have a layer with
  every expert cold.
* real bytes: a quantized model keeps its experts in their GGUF blocks, one pool per
  format (a Q4_K_M file: Q4_K/Q4_K and Q4_K/Q6_K layers), each with its own K zero slots
  and flex slots; so the pool costs sum over groups g of bytes_g * (hot_g + K + flex_g),
  with bytes_g one expert in g's format (`expert_sizes`, engine/sizes.py). Adding an expert
  adds bytes_g and can lower flex_g by at most one slot of the same size, so the cost still
  never decreases with s and the same bisection runs on bytes. A float model is one group.
* a plan whose upload path does not pay for its flex slots (planner/pipeline.py,
  plan_upload_path) spends their bytes on hot experts instead: `grow_without_flex`, the same
  pool bytes with K zero slots per group and no flex slot.

Everything here is a pure function of the config, the counts and the settings; the
verification (ostinato/verify.py, above the planner and the engine) runs the largest pass of the
longest request in the engine under the cap and reads torch.cuda.max_memory_allocated.

Legend: T tokens of a pass, N KV tokens, D hidden, H / Hkv query / KV heads, Dq / Dv / Dr q-k /
v / rotary head dims, E experts per layer, K top-k, F expert FFN, I dense FFN, V vocabulary,
L MoE layers.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ostinato.config import ConfigError, ModelConfig
from ostinato.engine.sizes import (FLEX_SHARE, dense_dequant_bytes, dense_parts, dense_weight_bytes, expert_bytes,
                                   expert_sizes, itemsize, kv_bytes)
from ostinato.kernels.triton.decode_plan import partials_bytes
from ostinato.loader.build import WeightFormats
from ostinato.models.common import fused_attention_available
from ostinato.models.registry import attention_shape
from ostinato.planner.fill import fill, fill_more

GiB = 2**30


class CapacityError(ConfigError):
    """The budget cannot hold what the engine needs besides the expert pool."""


@dataclass(frozen=True)
class CapacitySettings:
    margin_bytes: int = 1 * GiB  # fixed part of the margin
    margin_fraction: float = 0.0  # plus this share of the budget (the module docstring says why none)
    prefill_chunk: int = 2048  # the runner's chunk: the largest forward pass
    # the prefill's attention counted as torch's math kernel holding this share of a pass's H x T x N scores
    # at once; None: the model's (gpu_score_share: 0 is SDPA's fused kernels, counted as they allocate)
    attention_score_share: float | None = None
    # the upload path's flex slots per format group: at most max_flex; None: flex_share of the pool's
    # bytes, split evenly over the groups (flex_bound; the module docstring says why a quarter)
    max_flex: int | None = None
    flex_share: float = FLEX_SHARE
    # the most tokens of a prefill pass the runner captures as a graph (engine/graph.py PassGraphs),
    # whose private memory pool holds that pass's buffers beside the allocator's; None: the engine's
    # default (engine/graph.py env_pass_rows); 0 or 1: none
    pass_graph_rows: int | None = None

    def __post_init__(self):
        if self.max_flex is not None and self.max_flex < 0:
            raise ConfigError(f"max_flex must be >= 0, got {self.max_flex}")
        if not 0.0 <= self.flex_share <= 1.0:
            raise ConfigError(f"flex_share must be in [0, 1], got {self.flex_share}")
        if self.margin_bytes < 0 or not 0.0 <= self.margin_fraction < 1.0:
            raise ConfigError(f"the margin must be >= 0 bytes plus a share in [0, 1) of the budget, got "
                              f"{self.margin_bytes} bytes and {self.margin_fraction}")


@dataclass(frozen=True)
class Capacity:
    budget: int
    dense_weights: int
    kv_cache: int
    kv_tokens: int
    activations: int
    pass_tokens: int
    margin: int
    expert_bytes: int  # one expert; the mean over the MoE layers where formats differ by layer
    zero_slots: int  # summed over the groups
    flex_slots: int  # summed over the groups
    hot_slots: int
    max_hot_slots: int  # what the budget allows; hot_slots is smaller when a hot fraction chose it
    dtype: str
    activation_parts: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)  # per expert format: layers, expert_bytes, hot, zero, flex, bytes
    max_flex: int | None = None  # the bound on each group's flex slots (flex_bound); None: unbounded

    @property
    def fixed(self) -> int:
        return self.dense_weights + self.kv_cache + self.activations + self.margin

    @property
    def pool_bytes(self) -> int:
        if self.groups:
            return sum(g["bytes"] for g in self.groups.values())
        return (self.hot_slots + self.zero_slots + self.flex_slots) * self.expert_bytes

    @property
    def hot_bytes(self) -> int:
        if self.groups:
            return sum(g["hot"] * g["expert_bytes"] for g in self.groups.values())
        return self.hot_slots * self.expert_bytes

    @property
    def unused(self) -> int:
        return self.budget - self.fixed - self.pool_bytes

    def to_json(self) -> dict:
        return {**asdict(self), "pool_bytes": self.pool_bytes, "unused": self.unused}

    @property
    def _flex_note(self) -> str:
        return "" if self.max_flex is None else f"; flex <= {self.max_flex} a group"

    def table(self) -> list[tuple[str, int]]:
        """(what, bytes) rows for a printed breakdown."""
        rows = [("dense weights", self.dense_weights), (f"KV cache ({self.kv_tokens} tokens)", self.kv_cache),
                (f"activations ({self.pass_tokens}-token pass)", self.activations), ("margin", self.margin),
                (f"hot slots ({self.hot_slots})", self.hot_bytes),
                (f"zero + flex slots ({self.zero_slots} + {self.flex_slots}{self._flex_note})",
                 self.pool_bytes - self.hot_bytes),
                ("unused", self.unused)]
        return rows


def pool_groups(counts: dict[int, torch.Tensor], hot_slots: int, top_k: int, num_experts: int,
                sizes: dict[int, tuple[str, int]], max_flex: int | None = None) -> dict[str, dict]:
    """The pools fill(counts, hot_slots) needs, one per format (hot_groups, flex at most max_flex)."""
    return hot_groups(fill(counts, hot_slots), top_k, num_experts, sizes, max_flex=max_flex)


def hot_groups(hot: dict[int, list[int]], top_k: int, num_experts: int, sizes: dict[int, tuple[str, int]],
               max_flex: int | None = None) -> dict[str, dict]:
    """The pools a residency set needs, one per format, over the layers of `sizes`: layers, expert
    bytes, hot, K zero and flex slots (the group's most cold experts of a layer, at most max_flex;
    0 for a plan without the upload path), bytes."""
    groups: dict[str, dict] = {}
    for l in sorted(sizes):
        name, eb = sizes[l]
        g = groups.setdefault(name, {"layers": 0, "expert_bytes": eb, "hot": 0, "zero": top_k, "flex": 0})
        n = len(hot.get(l, []))
        g["layers"] += 1
        g["hot"] += n
        g["flex"] = max(g["flex"], num_experts - n)
    for g in groups.values():
        if max_flex is not None:
            g["flex"] = min(g["flex"], max_flex)
        g["bytes"] = g["expert_bytes"] * (g["hot"] + g["zero"] + g["flex"])
    return groups


def grow_without_flex(counts: dict[int, torch.Tensor], hot: dict[int, list[int]], limit: int, top_k: int,
                      num_experts: int, sizes: dict[int, tuple[str, int]]) -> dict[int, list[int]]:
    """A plan without the upload path: `hot` and the next experts in the fill order (fill_more), as
    many as fit `limit` bytes of pools with K zero slots per format group and no flex slot. Each
    added expert adds its group's bytes, so the bytes grow with the count and bisection finds it;
    `hot` itself when not even it fits."""
    def need(n: int) -> int:
        return sum(g["bytes"] for g in hot_groups(fill_more(counts, hot, n), top_k, num_experts, sizes, 0).values())

    cold = sum(num_experts - len(hot.get(l, [])) for l in counts)
    return fill_more(counts, hot, max(0, largest_fitting(need, limit, cold)))


def flex_bound(settings: CapacitySettings, pool_bytes: int | None, sizes: dict[int, tuple[str, int]]) -> int | None:
    """M, the most flex slots of a format group (module docstring): settings.max_flex if given, else
    flex_share of `pool_bytes` (what is left for the pools) split evenly over the groups of `sizes`,
    in the largest group's expert bytes; None (unbounded) where no pool budget is known (a pool
    sized by a hot fraction alone)."""
    if settings.max_flex is not None:
        return settings.max_flex
    if pool_bytes is None or not sizes:
        return None
    per_group = {name: b for name, b in sizes.values()}
    return max(0, int(settings.flex_share * pool_bytes) // (len(per_group) * max(per_group.values())))


def least_pool(counts: dict[int, torch.Tensor], top_k: int, num_experts: int, sizes: dict[int, tuple[str, int]],
               settings: CapacitySettings) -> tuple[int, int | None]:
    """The fewest bytes that hold the pools with no hot expert (K zero slots and the flex slots, bounded
    by flex_bound of those very bytes) and that bound: the least P with need(P) <= P, reached from
    below by P <- need(P) (need never decreases in P, so every P that fits lies above each step)."""
    P = 0
    while True:
        bound = flex_bound(settings, P, sizes)
        need = sum(g["bytes"] for g in pool_groups(counts, 0, top_k, num_experts, sizes, bound).values())
        if need <= P:
            return P, bound
        P = need


def max_hot_bytes(counts: dict[int, torch.Tensor], budget: int, top_k: int, num_experts: int,
                  sizes: dict[int, tuple[str, int]], max_flex: int | None = None) -> int:
    """The largest s whose pools (pool_groups, flex at most max_flex) fit `budget` bytes (-1 if not
    even s = 0 fits)."""
    need = lambda s: sum(g["bytes"] for g in pool_groups(counts, s, top_k, num_experts, sizes,  # noqa: E731
                                                         max_flex).values())
    return largest_fitting(need, budget, len(counts) * num_experts)


def largest_fitting(need, limit: int, most: int) -> int:
    """The largest s in [0, most] with need(s) <= limit, need never decreasing in s (bisection);
    -1 if not even s = 0 fits."""
    if need(0) > limit:
        return -1
    lo, hi = 0, most  # need(lo) <= limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if need(mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def gpu_score_share(cfg: ModelConfig, dtype: torch.dtype) -> float:
    """The share of a pass's H x T x N attention scores a GPU holds at once: 0 where the model
    attends in SDPA's fused kernels there (AttentionShape.fused_on_gpu: its prefill attention is
    models/common.causal_attention; in half precision; and, where this process has a GPU, the
    fused kernels take its head dims there: fused_attention_available), else 1 (torch's math
    kernel in fp32, as on an explicit mask)."""
    shape = attention_shape(cfg)
    fused = shape.fused_on_gpu and dtype in (torch.bfloat16, torch.float16)
    if fused and torch.cuda.is_available():
        fused = fused_attention_available(shape.qk_dim, shape.v_dim, dtype, "cuda")
    return 0.0 if fused else 1.0


def activation_bytes(cfg: ModelConfig, T: int, N: int, dtype: torch.dtype, score_share: float | None = None,
                     dequant_scratch: int = 0) -> dict:
    """A conservative bound on the buffers of one forward pass of T tokens attending to N.

    The attention's shape is the model's (models/common.py AttentionShape): H query heads, Hkv
    key/value heads as the kernel reads them, q/k and v head dims Dq, Dv (Qwen3: Hd, Hd; MLA:
    H heads of Dn + Dr and Dv), Dr the rotary dims, X the elements per cached token expanded
    from the cache before attending (MLA's up-projected K/V and assembled K; 0 for Qwen3).
    b = the compute dtype's size; every term counts buffers that can be alive together:
      hidden     6 T D b + 2 T D 4        residual, norm output, branch outputs, sums; fp32 RMSNorm
      qkv        3 T (H Dq + Hkv (Dq + Dv)) b
                                          projections, q/k norm, rotary (rotate-half copy)
      attention  in torch's math kernel (score_share s given, or the model's prefill not fused here):
                 13 s H T N + T N (1 + b) + ((2 H + Hkv) Dq + (H + Hkv) Dv) N 4 + T H (8 Dq + (4 + b) Dv)
                 + N X b
                 A pass after the first chunk carries a mask, and the math kernel (aten
                 _scaled_dot_product_attention_math) runs in fp32: the scores [H, T, N] and,
                 inside _safe_softmax, the softmax, the -inf test (bool) and the where() result
                 coexist: 13 bytes per score. s = the share of the H x T x N scores materialised
                 at once (1, or less if the engine chunks heads or rows); a model that attends in
                 chunks of queries (gpt-oss) caps them at its AttentionShape.max_scores.
                 Then the mask (bool and in the compute dtype), K/V in fp32, expanded to H
                 heads, K scaled; q in fp32, scaled, the fp32 output and its cast; what a
                 prefill expands from a compressed cache.
                 in SDPA's fused kernels (the default where `gpu_score_share` is 0: the model's
                 prefill is models/common.causal_attention, in half precision, and the kernels
                 take its head dims): no scores, no mask (the causal flag or bias):
                 T H (Dq + 2 Dv) b + T H 4 + (H + Hkv) N (Dq + Dv) b + N X b
                 q as the kernel takes it, the output and its reshape, the fp32 log-sum-exp;
                 K/V repeated to H heads (causal_attention's copy where the kernels refuse
                 grouped heads, or a kernel's own) beside the cache window as read; what a
                 prefill expands from a compressed cache. Session 17's verified plan (bf16
                 Qwen3-30B-A3B, 2048 tokens over 8292) peaked 733 MB under the math-kernel bound;
                 this one counts 406 MB less there.
      rope       2 T Dr (4 + b)           cos/sin
      chunk states (N - T) ((2 D + 2 Dr) b + D 4 + K 13)
                                          a longer pass runs layer by layer (engine/devices.py
                                          forward_layer_major), and its chunks' routed experts
                                          in one call per MoE layer: while that call runs (the
                                          waves of an upload pass, HybridExperts.upload_chunks)
                                          each other chunk holds its residual and MLP input
                                          (DecoderLayer.forward_chunks), cos/sin, its routing
                                          (int64 ids, fp32 weights), the upload path's cold mask
                                          and the fp32 sum of its experts; between layers only
                                          its hidden states and cos/sin wait (N > T only)
      router     T E (b + 8) + T K 12     logits, fp32 softmax, top-k ids (int64) and weights;
                 + T E 13 + T D 4         sigmoid routing: fp32 input, scores, biased and masked
                                          scores, the group mask
      experts    T K (2F 4 + D 4 + 8) + T D (3 4 + b)
                                          per route gate/up (fp32), per-route outputs (fp32),
                                          sorted route ids; the fp32 sums of the pool's experts
                                          and of those a pass uploads or stages (a second GPU
                                          branch, hybrid.py split_path, staging.py), their sum,
                                          and its cast
      dequant    given                    quantized experts: a large pass's dequantized chunk
                                          (layers/moe/gpu_quant.py dequant_scratch_bytes), or a
                                          block-format dense weight's (sizes.dense_dequant_bytes)
      shared     3 T S F b                S shared experts' gate, up and product
      dense mlp  3 T I b                  only if the model has dense MLP layers
      logits     V (b + 4)                the last token's logits, then fp32
    """
    D, E, K, F, I, V = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, \
        cfg.intermediate_size, cfg.vocab_size
    shape = attention_shape(cfg)
    H, Hkv, Dq, Dv, Dr, X = shape.heads, shape.kv_heads, shape.qk_dim, shape.v_dim, shape.rope_dim, \
        shape.expanded_per_token
    share = gpu_score_share(cfg, dtype) if score_share is None else score_share
    fused = score_share is None and share == 0.0
    scores = share * H * T * N  # held at once; a model that attends in chunks of queries bounds them
    if shape.max_scores:
        scores = min(scores, shape.max_scores)
    b = itemsize(dtype)
    if fused:
        attention = T * H * (Dq + 2 * Dv) * b + T * H * 4 + (H + Hkv) * N * (Dq + Dv) * b + N * X * b
    else:
        attention = int(13 * scores) + T * N * (1 + b) + ((2 * H + Hkv) * Dq + (H + Hkv) * Dv) * N * 4 \
            + T * H * (8 * Dq + (4 + b) * Dv) + N * X * b
    parts = {
        "hidden": 6 * T * D * b + 2 * T * D * 4,
        "qkv": 3 * T * (H * Dq + Hkv * (Dq + Dv)) * b,
        "attention": attention,
        "rope": 2 * T * Dr * (4 + b),
        "chunk_states": max(0, N - T) * ((2 * D + 2 * Dr) * b + D * 4 + K * 13),
        "router": T * E * (b + 8) + T * K * 12 + (T * E * 13 + T * D * 4 if cfg.scoring_func == "sigmoid" else 0),
        "experts": T * K * (2 * F * 4 + D * 4 + 8) + T * D * (3 * 4 + b),
        "dequant_scratch": dequant_scratch,
        "shared_experts": 3 * T * cfg.n_shared_experts * F * b,
        "dense_mlp": 3 * T * I * b if len(cfg.moe_layers) < cfg.num_hidden_layers else 0,
        "logits": V * (b + 4),
    }
    parts["total"] = sum(parts.values())
    return parts


def pass_bound(cfg: ModelConfig, T: int, N: int, dtype: torch.dtype, formats: WeightFormats = WeightFormats(),
               sizes: dict | None = None, score_share: float | None = None) -> dict:
    """activation_bytes of a T-token pass attending to N tokens as the capacity test counts it, with the
    dequantized paths' scratch of these formats (sizes: the MoE layers' expert sizes, default every
    layer's): what scripts/profile_decode.py --prefill sets beside a measured pass's peak."""
    if sizes is None:
        sizes = expert_sizes(cfg, dtype, formats.experts)
    return activation_bytes(cfg, T, N, dtype, score_share, _dequant_scratch(cfg, T, dtype, formats, sizes))


def pass_graph_bytes(cfg: ModelConfig, settings: CapacitySettings, kv_tokens: int, dtype: torch.dtype,
                     formats: WeightFormats, sizes: dict, split: bool = False) -> int:
    """The private pool of the captured prefill passes (engine/graph.py PassGraphs; B = graph.pass_rows:
    none on one device of a split model): the buffers of the largest, B rows, which the smaller ones
    captured after it reuse. Its attention reads the cache in place (the split-K kernel): the bound of a
    B-token pass attending to its own B tokens (MLA's pass attends in the latent space: its absorbed
    queries, latent outputs and values, B H (3R + Dr + Dv) b, lie within that bound's fp32 K, V and
    query terms over N = B), plus the kernel's fp32 partials over
    any window of the cache (kernels/triton/decode_plan.py partials_bytes: each of the B*G rows of a KV
    head as the kernel reads it, AttentionShape.split_k_heads: Qwen3's Hkv heads of G = H / Hkv, MLA's
    one latent head of G = H, keeps its running max and sum and its Dv sums in each of its splits), plus
    what sliding-window layers attend in torch (gpt-oss's, models/gpt_oss.py): the fp32 scores of B
    tokens over the w + B - 1 rows they gather, and their cast; and the B fp32 rows the CPU worker's
    partial is copied into (kernels/triton/handshake.py CopyJoin)."""
    from ostinato.engine.graph import pass_rows

    B = pass_rows(settings.pass_graph_rows, split, kv_tokens)  # split: one device of a split model, none
    if B < 2:
        return 0
    shape = attention_shape(cfg)
    kv_heads, G, dv = shape.split_k_heads()
    partials = partials_bytes(B, G, kv_heads, dv, kv_tokens)
    w = max(cfg.window_of(i) or 0 for i in range(cfg.num_hidden_layers))
    sliding = shape.heads * B * (w + B - 1) * (4 + itemsize(dtype)) if w else 0
    join_rows = B * cfg.hidden_size * 4
    return pass_bound(cfg, B, B, dtype, formats, sizes, 0.0)["total"] + partials + sliding + join_rows


def _dequant_scratch(cfg: ModelConfig, T: int, dtype: torch.dtype, formats: WeightFormats, sizes: dict) -> int:
    """The dequantized paths' scratch in a T-token pass: the experts' where quantized experts meet a
    pass that path may serve (from the smallest threshold of any tuning: a device's own is not known
    to the plan), or a block-format dense weight's (sizes.dense_dequant_bytes) above the matvec (the
    default's), whichever is larger (one layer's attention and its experts never hold theirs at once)."""
    from ostinato.layers.moe.gpu_quant import DEFAULT_QUANT_TUNING, dequant_scratch_bytes, fewest_dequant_tokens

    quantized = [l for l in sizes if formats.experts.get(l) is not None]
    dense = dense_dequant_bytes(cfg, dtype, formats.dense) if T > DEFAULT_QUANT_TUNING["dense_matvec_max_tokens"] else 0
    if not quantized or T < fewest_dequant_tokens():
        return dense
    return max(dense, dequant_scratch_bytes(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                            itemsize(dtype), max(sizes[l][1] for l in quantized)))


def flex_slots(counts: dict[int, torch.Tensor], slots: int, num_experts: int, max_flex: int | None = None) -> int:
    """The upload path's staging slots under fill(counts, slots): the most cold experts of a layer,
    at most max_flex."""
    hot = fill(counts, slots)
    most = max((num_experts - len(v) for v in hot.values()), default=0)
    return most if max_flex is None else min(most, max_flex)


def max_hot_slots(counts: dict[int, torch.Tensor], slots: int, top_k: int, num_experts: int,
                  max_flex: int | None = None) -> int:
    """The largest s with s + K + flex(s) <= slots (-1 if not even s = 0 fits)."""
    need = lambda s: s + top_k + flex_slots(counts, s, num_experts, max_flex)  # noqa: E731  non-decreasing in s
    return largest_fitting(need, slots, len(counts) * num_experts)


def fmt_bytes(x: float) -> str:
    """3.1 GiB, 512.0 MiB, 96.0 KiB."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:.1f} {unit}"
    return f"{x:.0f} B"


_gib = fmt_bytes


def plan_capacity(cfg: ModelConfig, counts: dict[int, torch.Tensor], budget: int, kv_tokens: int,
                  dtype: torch.dtype, settings: CapacitySettings = CapacitySettings(),
                  slots: int | None = None, *, layers: list[int] | None = None, first: bool = True,
                  last: bool = True, label: str = "", formats: WeightFormats = WeightFormats()) -> Capacity:
    """The capacity test. `slots`: a pool size chosen elsewhere (a hot fraction), checked to fit.
    With `layers`, the test of one device that holds those layers (the embedding if `first`,
    the head if `last`); the activation bound of the largest pass is kept whole. `formats`: the
    block formats the GPU keeps, each MoE layer's experts' and the dense linear weights'
    (loader.build.weight_formats; default: everything in the compute dtype)."""
    if kv_tokens < 1:
        raise CapacityError("the KV cache needs at least one token: give --max-context or a profile "
                            "with max_tokens (profile again with this version of ostinato)")
    T = min(settings.prefill_chunk, kv_tokens)
    if layers is None:
        moe, dense, kv = cfg.moe_layers, dense_weight_bytes(cfg, dtype, formats.dense), kv_bytes(cfg, kv_tokens, dtype)
    else:
        per_layer, embed, head = dense_parts(cfg, dtype, formats.dense)
        moe = [l for l in layers if cfg.is_moe_layer(l)]
        dense = sum(per_layer[l] for l in layers) + (embed if first else 0) + (head if last else 0)
        kv = kv_bytes(cfg, kv_tokens, dtype, len(layers))
    counts = {l: counts.get(l, torch.zeros(cfg.num_experts)) for l in moe}
    who = f"{label}: " if label else ""
    sizes = {l: v for l, v in expert_sizes(cfg, dtype, formats.experts).items() if l in counts}
    act = pass_bound(cfg, T, kv_tokens, dtype, formats, sizes, settings.attention_score_share)
    graphs = pass_graph_bytes(cfg, settings, kv_tokens, dtype, formats, sizes, split=layers is not None)
    if graphs:
        act = {**act, "pass_graphs": graphs, "total": act["total"] + graphs}
    margin = int(settings.margin_bytes + settings.margin_fraction * budget)
    eb = round(sum(b for _, b in sizes.values()) / len(sizes)) if sizes else expert_bytes(cfg, dtype)
    E = cfg.num_experts
    K = cfg.num_experts_per_tok if moe else 0  # a device without MoE layers needs no zero slots
    fixed = dense + kv + act["total"] + margin
    bound = flex_bound(settings, max(0, budget - fixed), sizes)
    best = (max_hot_bytes(counts, budget - fixed, K, E, sizes, bound) if moe else 0) if budget >= fixed else -1
    if best < 0:
        pool0, bound0 = least_pool(counts, K, E, sizes, settings)
        raise CapacityError(
            f"{who}--gpu-memory {_gib(budget)} cannot hold the dense weights ({_gib(dense)}) and the KV cache of "
            f"{kv_tokens} tokens ({_gib(kv)}), with activations of a {T}-token pass ({_gib(act['total'])}), "
            f"the margin ({_gib(margin)}) and the pool's zero and flex slots ({_gib(pool0)}"
            f"{'' if bound0 is None else f', flex at most {bound0} a format group'}): need at least "
            f"{_gib(fixed + pool0)} plus {eb / 2**20:.1f} MiB per hot expert; give a larger --gpu-memory or "
            "a smaller --max-context")
    if slots is not None:
        slots = max(0, min(slots, len(counts) * E))
        if slots > best:
            raise CapacityError(f"{who}{slots} hot experts do not fit --gpu-memory {_gib(budget)}: it holds at most "
                                f"{best} (with {_gib(fixed)} for dense weights, KV cache, activations and margin)")
    hot = best if slots is None else slots
    groups = pool_groups(counts, hot, K, E, sizes, bound)
    zero, flex = sum(g["zero"] for g in groups.values()), sum(g["flex"] for g in groups.values())
    return Capacity(budget, dense, kv, kv_tokens, act["total"], T, margin, eb, zero, flex, hot,
                    best, str(dtype).removeprefix("torch."), act, groups, bound)


def device_capacity(cfg: ModelConfig, counts: dict[int, torch.Tensor], budget: int, kv_tokens: int,
                    dtype: torch.dtype, layers: list[int], first: bool, last: bool,
                    settings: CapacitySettings = CapacitySettings(), slots: int | None = None,
                    name: str = "device", formats: WeightFormats = WeightFormats()) -> Capacity:
    """The capacity test of one device holding `layers` (plan_capacity restricted to them), for a
    model split over the GPUs of one host (engine/assign.py gives each its layers)."""
    return plan_capacity(cfg, counts, budget, kv_tokens, dtype, settings, slots, layers=layers, first=first,
                         last=last, label=name, formats=formats)
