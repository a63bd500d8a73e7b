"""Softmax top-k routing, exactly as Qwen3-MoE's reference implementation does it.

Legend: T tokens, E experts, K experts per token.
"""
from __future__ import annotations

import torch

from ostinato.layers.moe.types import TopKOutput


def route(logits: torch.Tensor, k: int, norm_topk_prob: bool, dtype: torch.dtype) -> TopKOutput:
    """logits [T, E] -> top-k ids and weights [T, K].

    Softmax in fp32, top-k, optional renormalisation; the weights are then rounded to the
    activations' dtype (the reference multiplies expert outputs by weights in that dtype)
    and handed on as fp32 so every backend sees identical values.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return TopKOutput(ids, weights.to(dtype).float())
