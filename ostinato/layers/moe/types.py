"""Typed hand-offs between the MoE seams: router -> dispatch -> experts -> combine.

Legend: T tokens, K experts per token (top-k), E experts per layer, D hidden size,
F expert FFN size (moe_intermediate_size), S hot slots in a pool.

Expert weights of one layer are stacked, in the checkpoint's own row-major layout:
  w13[E, 2F, D]  gate_proj rows [0, F) then up_proj rows [F, 2F)
  w2 [E, D, F]   down_proj
One expert computes  y = w2 @ (silu(w13[:F] @ x) * (w13[F:] @ x)).

Quantized experts (QuantExpertWeights) keep the same rows in GGUF block formats
(ostinato/quant/formats.py), blocks along the input dimension:
  w13 uint8 [E, 2F, row_bytes(qt13, D)]   w2 uint8 [E, D, row_bytes(qt2, F)]
gate and up share qt13; the down projection may have another type (Q4_K_M gives some
layers Q6_K down projections).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class TopKOutput(NamedTuple):
    """Routing of T tokens in one MoE layer."""

    ids: torch.Tensor  # [T, K] int64 expert ids, in the router's top-k order
    weights: torch.Tensor  # [T, K] float32 routing weights (renormalised if norm_topk_prob)


class ExpertWeights(NamedTuple):
    """The routed experts of one MoE layer, stacked."""

    w13: torch.Tensor  # [E, 2F, D]
    w2: torch.Tensor  # [E, D, F]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def expert_bytes(self) -> int:
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()


class QuantExpertWeights(NamedTuple):
    """The routed experts of one MoE layer, stacked, in GGUF block formats (bytes)."""

    qt13: str  # e.g. "Q4_K"
    w13: torch.Tensor  # uint8 [E, 2F, row_bytes(qt13, D)]
    qt2: str  # e.g. "Q6_K"
    w2: torch.Tensor  # uint8 [E, D, row_bytes(qt2, F)]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:  # D
        return self.w2.shape[1]

    @property
    def ffn(self) -> int:  # F
        return self.w13.shape[1] // 2

    @property
    def expert_bytes(self) -> int:
        return self.w13[0].numel() + self.w2[0].numel()


def expert_views(layer: int, w13: torch.Tensor, w2: torch.Tensor, first: int = 0):
    """(checkpoint tensor name, view into the stacks) for experts [first, first + n) of a layer:
    the Hugging Face per-expert names mapped onto the stacked layout above."""
    F = w2.shape[-1]
    p = f"model.layers.{layer}.mlp.experts."
    for i in range(w13.shape[0]):
        e = first + i
        yield f"{p}{e}.gate_proj.weight", w13[i, :F]
        yield f"{p}{e}.up_proj.weight", w13[i, F:]
        yield f"{p}{e}.down_proj.weight", w2[i]
