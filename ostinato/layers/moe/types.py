"""Typed hand-offs between the MoE seams: router -> dispatch -> experts -> combine.

Legend: T tokens, K experts per token (top-k), E experts per layer, D hidden size,
F expert FFN size (moe_intermediate_size), S hot slots in a pool.

Expert weights of one layer are stacked, in the checkpoint's own row-major layout:
  w13[E, 2F, D]  gate_proj rows [0, F) then up_proj rows [F, 2F)
  w2 [E, D, F]   down_proj
  b13[E, 2F], b2[E, D]  optional biases (gpt-oss), fp32 in the pools and host copies
One expert computes  y = w2 @ act(w13[:F] @ x + b13[:F], w13[F:] @ x + b13[F:]) + b2,
act the model's (config.ExpertAct): silu(g) * u by default; without biases the b terms are absent.
A checkpoint that interleaves gate and up (gpt-oss: even columns gate, odd up) is
de-interleaved at load, so every kernel keeps the [gate; up] layout.

Quantized experts (QuantExpertWeights) keep the same rows in GGUF block formats
(ostinato/quant/formats.py), blocks along the input dimension:
  w13 uint8 [E, 2F, row_bytes(qt13, D)]   w2 uint8 [E, D, row_bytes(qt2, F)]
gate and up share qt13; the down projection may have another type (Q4_K_M gives some
layers Q6_K down projections).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ostinato.config import SILU, ExpertAct

class TopKOutput(NamedTuple):
    """Routing of T tokens in one MoE layer."""

    ids: torch.Tensor  # [T, K] int64 expert ids, in the router's top-k order
    weights: torch.Tensor  # [T, K] float32 routing weights (renormalised if norm_topk_prob)


class ExpertWeights(NamedTuple):
    """The routed experts of one MoE layer, stacked."""

    w13: torch.Tensor  # [E, 2F, D]
    w2: torch.Tensor  # [E, D, F]
    b13: torch.Tensor | None = None  # [E, 2F] gate then up biases, or None
    b2: torch.Tensor | None = None  # [E, D] down bias, or None
    act: ExpertAct = SILU

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def expert_bytes(self) -> int:
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size() + bias_bytes(self)


class QuantExpertWeights(NamedTuple):
    """The routed experts of one MoE layer, stacked, in GGUF block formats (bytes)."""

    qt13: str  # e.g. "Q4_K"
    w13: torch.Tensor  # uint8 [E, 2F, row_bytes(qt13, D)]
    qt2: str  # e.g. "Q6_K"
    w2: torch.Tensor  # uint8 [E, D, row_bytes(qt2, F)]
    b13: torch.Tensor | None = None  # [E, 2F] float biases, or None
    b2: torch.Tensor | None = None  # [E, D]
    act: ExpertAct = SILU

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
        return self.w13[0].numel() + self.w2[0].numel() + bias_bytes(self)


def bias_bytes(w: ExpertWeights | QuantExpertWeights) -> int:
    """Bytes of one expert's biases (0 without)."""
    return sum(b[0].numel() * b.element_size() for b in (w.b13, w.b2) if b is not None)


def check_biases(w: ExpertWeights | QuantExpertWeights, E: int, F: int, D: int, what: str = "experts") -> None:
    """ValueError unless b13 and b2 are both None or [E, 2F] and [E, D] float tensors beside the weights."""
    if (w.b13 is None) != (w.b2 is None):
        raise ValueError(f"{what}: b13 and b2 go together (got only one)")
    if w.b13 is None:
        return
    for name, b, want in (("b13", w.b13, (E, 2 * F)), ("b2", w.b2, (E, D))):
        if tuple(b.shape) != want or not b.is_floating_point() or b.device != w.w13.device:
            raise ValueError(f"{what}: {name} must be a float tensor {list(want)} on {w.w13.device}, "
                             f"got {b.dtype} {list(b.shape)} on {b.device}")


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
