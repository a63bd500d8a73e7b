"""The plain-PyTorch MoE: every expert on one device, one loop over the routed experts.

This is the oracle every faster path is tested against, and the backend of
`ostinato generate` without a residency. It computes in the weights' dtype the way the
Hugging Face implementation does, so whole-model logits match `transformers`.

Legend: T tokens, K experts per token, D hidden, F expert FFN size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ostinato.layers.moe.backend import MoEBackend
from ostinato.layers.moe.types import ExpertWeights, TopKOutput


def expert_forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: x [n, D], w13 [2F, D], w2 [D, F] -> [n, D]."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def moe_forward(x: torch.Tensor, topk: TopKOutput, experts: ExpertWeights) -> torch.Tensor:
    """x [T, D] -> sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), [T, D]."""
    out = torch.zeros_like(x)
    flat_ids = topk.ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=experts.num_experts).tolist()
    K = topk.ids.shape[1]
    begin = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[begin:begin + n]
        begin += n
        tok = sel // K
        y = expert_forward(x[tok], experts.w13[e], experts.w2[e])
        w = topk.weights.reshape(-1)[sel].to(x.dtype)
        out.index_add_(0, tok, y * w[:, None])
    return out


class ReferenceExperts(MoEBackend):
    """Experts backend holding every layer's stacked experts on one device."""

    def __init__(self, layers: dict[int, ExpertWeights]):
        self.layers = layers

    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        return moe_forward(x, topk, self.layers[layer])
