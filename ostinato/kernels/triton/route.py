"""Qwen3-MoE's router after its linear, in one launch ([Q]): layers/moe/router.py `route`.

Per token row of logits [T, E]: the softmax in fp32 (max, exp, sum, quotient), the K largest
probabilities (largest first; among equal ones the lowest expert id first), their sum if the
weights are renormalised, each weight divided by it, rounded to the activations' dtype and
handed on in fp32. The torch expression is seven launches (softmax, top-k's two kernels, sum,
quotient, two casts): 336 of the 3300 launches of Qwen3-30B-A3B's captured decode step on the
H200 (results/2026-12-01-h200-s10/q_profile_all/profile.md). The exponential is libdevice's
(as torch's expf); the sums run in another order than torch's, so a weight can differ from the
torch expression's in its last fp32 place before the rounding to the activations' dtype, and
rarely after it.

Grid (T,): one program per token, the row of E logits in registers (BLOCK_E = E to the next
power of two), K rounds of argmax.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, stride_t, E,
                  K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                  ROUND: tl.constexpr, LIBDEVICE: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_t + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    if LIBDEVICE:
        p = libdevice.exp(x - tl.max(x, axis=0))
    else:  # Triton's interpreter (the tests on a CPU) has no libdevice
        p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    koffs = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(K):
        best = tl.max(p, axis=0)
        j = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)  # the lowest id among the largest
        ids = tl.where(koffs == i, j.to(tl.int64), ids)
        w = tl.where(koffs == i, best, w)
        p = tl.where(offs == j, -1.0, p)  # below every probability: never chosen again
    if NORM:
        w = w / tl.sum(w, axis=0)
    w = w.to(ROUND).to(tl.float32)
    tl.store(ids_ptr + t * K + koffs, ids, mask=koffs < K)
    tl.store(w_ptr + t * K + koffs, w, mask=koffs < K)


def route_softmax_topk(logits: torch.Tensor, k: int, norm_topk_prob: bool,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (rows read through their stride) -> ids [T, K] int64, weights [T, K] fp32."""
    T, E = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("route_softmax_topk reads rows of contiguous logits")
    if not 0 < k <= E:
        raise ValueError(f"route_softmax_topk: top-{k} of {E} experts")
    ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    rounding = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
    if T:
        _route_kernel[(T,)](logits, ids, weights, logits.stride(0), E, K=k, BLOCK_E=triton.next_power_of_2(E),
                            BLOCK_K=triton.next_power_of_2(k), NORM=norm_topk_prob, ROUND=rounding,
                            LIBDEVICE=os.environ.get("TRITON_INTERPRET") != "1", num_warps=4 if E >= 512 else 1)
    return ids, weights


@triton.jit(do_not_specialize=["N"])
def _lookup_slots_kernel(table_ptr, ids_ptr, count_ptr, out_ptr, zero_lo, N, K, BLOCK: tl.constexpr,
                         COUNTED: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    slot = tl.load(table_ptr + tl.load(ids_ptr + offs, mask=mask, other=0), mask=mask, other=0)
    use = slot >= 0
    if COUNTED:  # the routes of rows at or past the count (a captured pass's padding) go to the zero slots
        use = use & (offs < tl.load(count_ptr) * K)
    tl.store(out_ptr + offs, tl.where(use, slot, zero_lo + offs % K), mask=mask)


def lookup_slots(table: torch.Tensor, ids: torch.Tensor, zero_lo: int, count: torch.Tensor | None = None) -> torch.Tensor:
    """The pool's index table after the router, in one launch (layers/moe/pool.py slots_in; the
    gather, the test and the choice were three): table [E] int32 (a layer's row: slot, or < 0 for a
    cold expert), ids [T, K] -> slots [T, K] int32, a cold route the zero slot of its top-k place
    (zero_lo + k); count [1] int32 on the device: the rows from it on get the zero slots too."""
    if table.dtype != torch.int32 or not table.is_contiguous():
        raise ValueError("lookup_slots reads a contiguous int32 table row")
    if count is not None and (count.dtype != torch.int32 or count.numel() != 1):
        raise ValueError("lookup_slots reads the row count as one int32")
    ids = ids.contiguous()
    out = torch.empty(ids.shape, dtype=torch.int32, device=ids.device)
    n = ids.numel()
    if n:
        # two block sizes, whatever n: a decode step's and a prefill pass's (each block size is a compile
        # of its own, and a size first met in a measured turn is paid for there; load.warm_up)
        block = 256 if n <= 256 else 1024
        _lookup_slots_kernel[(triton.cdiv(n, block),)](table, ids, table if count is None else count, out, zero_lo,
                                                       n, ids.shape[-1], BLOCK=block, COUNTED=count is not None,
                                                       num_warps=1 if block <= 256 else 4)
    return out

