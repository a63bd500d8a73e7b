"""What the engine's parts weigh in bytes: the dense weights (whole, or per decoder layer, embedding
and head), one expert as its pool slot holds it (per MoE layer, in its GGUF blocks where it keeps
them) and the KV cache. Pure functions of the config, the compute dtype and the formats kept,
counted on a meta-device build of the model; the layer assignment (engine/assign.py) and the capacity test
(planner/capacity.py) both count with them.

Legend: D hidden, F expert FFN.
"""
from __future__ import annotations

import torch

from ostinato.config import ModelConfig
from ostinato.engine.kv_cache import KVCache
from ostinato.layers.moe.pool import expert_nbytes
from ostinato.layers.quant_linear import DEQUANT_BYTES, QuantLinear, keep_quantized_, quantized_bytes
from ostinato.loader.build import host_embedding
from ostinato.models.registry import new_model, param_bytes


# A quarter of the pool's bytes: the most a plan gives its flex slots (planner/capacity.py flex_bound, whose
# default share this is) and a baseline its staging where one layer's does not fit (experts.baseline_staging).
FLEX_SHARE = 0.25


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dense_weight_bytes(cfg: ModelConfig, dtype: torch.dtype, quantized: dict[str, str] | None = None) -> int:
    """Every parameter of the model (experts are not parameters) in the compute dtype (those the
    model keeps in fp32, a router say, in fp32), the linear weights named in `quantized` in their
    blocks (loader/build.py dense_formats), but the embedding table where it stays in host memory
    (loader/build.py host_embedding: a GPU runner's, unless tied to the head)."""
    model = keep_quantized_(new_model(cfg), quantized or {})
    total = param_bytes(model, dtype) + quantized_bytes(model)
    if host_embedding(cfg, "cuda"):
        total -= param_bytes(model, dtype, model.model.embed_tokens.named_parameters())
    return total


def dense_dequant_bytes(cfg: ModelConfig, dtype: torch.dtype, quantized: dict[str, str] | None = None) -> int:
    """The most a pass holds of a block-format linear weight dequantized into the compute dtype at once
    (layers/quant_linear.py: DEQUANT_BYTES at a time, whole rows); 0 without such weights. Linears of
    one module with one input size count as one weight (the q/k/v a FusedProjections concatenates)."""
    b = itemsize(dtype)
    rows: dict[tuple[int, int], int] = {}  # (module, input size) -> output rows
    for parent in keep_quantized_(new_model(cfg), quantized or {}).modules():
        for m in parent.children():
            if isinstance(m, QuantLinear):
                key = (id(parent), m.in_features)
                rows[key] = rows.get(key, 0) + m.out_features
    return max((min(N, max(1, DEQUANT_BYTES // (n * b))) * n * b for (_, n), N in rows.items()), default=0)


def expert_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One pool slot: w13 [2F, D] and w2 [D, F] in the compute dtype (and fp32 biases, gpt-oss)."""
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    return expert_nbytes((2 * F, D), (D, F), None, dtype, cfg.expert_bias)


def expert_sizes(cfg: ModelConfig, dtype: torch.dtype, formats: dict | None = None) -> dict[int, tuple[str, int]]:
    """Each MoE layer's pool group and one expert's bytes there: its GGUF blocks (formats[layer] =
    (qt13, qt2), from loader.build.expert_formats) as row_bytes counts them, or the compute dtype."""
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    out = {}
    for l in cfg.moe_layers:
        qt = (formats or {}).get(l)
        name = str(dtype).removeprefix("torch.") if qt is None else "/".join(qt)
        out[l] = (name, expert_nbytes((2 * F, D), (D, F), qt, dtype, cfg.expert_bias))
    return out


def kv_bytes(cfg: ModelConfig, tokens: int, dtype: torch.dtype, layers: int | None = None) -> int:
    """The KV cache of `layers` decoder layers (default: all) for `tokens` tokens."""
    return KVCache.bytes_needed(cfg, tokens, dtype, layers)


def dense_parts(cfg: ModelConfig, dtype: torch.dtype,
                quantized: dict[str, str] | None = None) -> tuple[list[int], int, int]:
    """(dense bytes of each decoder layer, embedding bytes on the first GPU (none where the table
    stays in host memory: host_embedding), final norm + lm_head bytes), the linear weights named in
    `quantized` in their blocks."""
    model = keep_quantized_(new_model(cfg), quantized or {})
    size = lambda m: param_bytes(model, dtype, m.named_parameters()) + quantized_bytes(m)  # noqa: E731
    layers = [size(layer) for layer in model.model.layers]
    head = size(model.model.norm) + (size(model.lm_head) if isinstance(model.lm_head, QuantLinear) else
                                     model.lm_head.weight.numel() * itemsize(dtype))  # a copy of its own when tied
    return layers, 0 if host_embedding(cfg, "cuda") else size(model.model.embed_tokens), head
