"""The plain-PyTorch MoE: every expert on one device, one loop over the routed experts.

This is the oracle every faster path is tested against, and the backend of
`ostinato generate` without a residency on the CPU. It computes in the weights' dtype the way the
Hugging Face implementation does (biases and activation as the experts carry them), so
whole-model logits match `transformers`.

Legend: T tokens, K experts per token, D hidden, F expert FFN size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ostinato.layers.moe.backend import MoEBackend
from ostinato.config import SILU, ExpertAct
from ostinato.layers.moe.types import ExpertWeights, TopKOutput


def expert_forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None,
                   b2: torch.Tensor | None = None, act: ExpertAct = SILU) -> torch.Tensor:
    """One expert: x [n, D], w13 [2F, D], w2 [D, F], optional b13 [2F], b2 [D] -> [n, D]."""
    b13 = None if b13 is None else b13.to(x.dtype)
    b2 = None if b2 is None else b2.to(x.dtype)
    gate, up = F.linear(x, w13, b13).chunk(2, dim=-1)
    return F.linear(act(gate, up), w2, b2)


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
        b13, b2 = (None, None) if experts.b13 is None else (experts.b13[e], experts.b2[e])
        y = expert_forward(x[tok], experts.w13[e], experts.w2[e], b13, b2, experts.act)
        w = topk.weights.reshape(-1)[sel].to(x.dtype)
        out.index_add_(0, tok, y * w[:, None])
    return out


class ReferenceExperts(MoEBackend):
    """Experts backend holding every layer's stacked experts on one device."""

    def __init__(self, layers: dict[int, ExpertWeights]):
        self.layers = layers

    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        return moe_forward(x, topk, self.layers[layer])

    def resident_experts(self) -> int:
        """Every expert when its device is a GPU, none on the CPU."""
        return sum(w.num_experts for w in self.layers.values() if w.w13.device.type == "cuda")
