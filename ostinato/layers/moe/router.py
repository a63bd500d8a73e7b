"""Top-k routing, exactly as each family's reference implementation does it: softmax top-k
(Qwen3-MoE), the sigmoid, bias-corrected, group-limited top-k of DeepSeek-V3, and gpt-oss's
top-k of the logits with a softmax over the chosen.

Legend: T tokens, E experts, K experts per token.
"""
from __future__ import annotations

import torch

from ostinato.kernels.triton import fused_dense
from ostinato.layers.moe.types import TopKOutput


def route(logits: torch.Tensor, k: int, norm_topk_prob: bool, dtype: torch.dtype) -> TopKOutput:
    """logits [T, E] -> top-k ids and weights [T, K].

    Softmax in fp32, top-k, optional renormalisation; the weights are then rounded to the
    activations' dtype (the reference multiplies expert outputs by weights in that dtype)
    and handed on as fp32 so every backend sees identical values. On CUDA in one launch
    (kernels/triton/route.py).
    """
    if logits.is_cuda and logits.stride(-1) == 1 and fused_dense():
        from ostinato.kernels.triton.route import route_softmax_topk

        return TopKOutput(*route_softmax_topk(logits, k, norm_topk_prob, dtype))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return TopKOutput(ids, weights.to(dtype).float())


def route_grouped(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
                  norm_topk_prob: bool, scaling: float) -> TopKOutput:
    """DeepSeek-V3's router, in the order of operations of its reference (transformers'
    DeepseekV3TopkRouter): logits [T, E] fp32, bias [E] fp32 -> top-k ids and weights [T, K].

    Scores are sigmoid(logits); the bias (`e_score_correction_bias`) only chooses: a group's
    score is the sum of its two best biased scores, the topk_group best groups are eligible,
    and the k best biased scores among their experts are selected. The weights are the
    unbiased scores of the selected experts, renormalised if norm_topk_prob, times `scaling`.
    They stay fp32: the reference multiplies the experts' outputs by fp32 weights (a backend
    rounds them to its compute dtype, an error within bf16's rounding)."""
    T, E = logits.shape
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    groups = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    eligible = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
    choice = choice.masked_fill(~eligible.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return TopKOutput(ids, weights * scaling)


def route_topk_softmax(logits: torch.Tensor, k: int, dtype: torch.dtype) -> TopKOutput:
    """gpt-oss's router (transformers' GptOssTopKRouter): logits [T, E] (its linear's, bias
    included) -> the k largest logits' ids and the softmax over those k, in fp32, rounded to the
    activations' dtype (the reference's softmax returns that dtype) and handed on as fp32."""
    values, ids = torch.topk(logits, k, dim=-1)
    return TopKOutput(ids, torch.softmax(values.float(), dim=-1).to(dtype).float())
