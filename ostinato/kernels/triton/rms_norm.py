"""RMSNorm of each row in one launch ([Q]: the GPU side of a decode step).

As models/common.py RMSNorm computes it, in the same order: the row in fp32, its mean square,
rsqrt(mean + eps), the product; then either cast to the input's dtype and multiplied by the
weight (rounded in that dtype: Qwen3, DeepSeek), or multiplied by the weight in fp32 and cast
(gpt-oss). The torch expression is eight launches (cast, square, mean, add, rsqrt, multiply,
cast, weight), and a decode step of Qwen3-30B-A3B has four norms in each of 48 layers: of
the 3300 launches of the captured step on the H200, 1536 were these
(results/2026-12-01-h200-s10/q_profile_all/profile.md), at a few microseconds each, for rows
of 2048 or 128 values.

With a residual, the sum x + r is formed first (rounded to the dtype, as torch's add rounds it, and
returned), then normed: the decoder layer's residual add before its second norm, one launch fewer.

Grid (rows,): one program per row, the row whole in registers (BLOCK = the row's length to
the next power of two). The reduction's order differs from torch's, so the mean square can
differ in its last fp32 bit and, rarely, a result by one unit in bf16's last place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, stride_x, stride_r, stride_out, N, eps,
                     BLOCK: tl.constexpr, FP32_WEIGHT: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # the residual sum first, rounded as torch's x + r is, and kept
        x = (x + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
        tl.store(sum_ptr + row * stride_out + offs, x, mask=mask)
        x = x.to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if FP32_WEIGHT:
        out = w * y
    else:
        out = w * y.to(dt).to(tl.float32)  # rounded before the weight, as torch does
    tl.store(out_ptr + row * stride_out + offs, out.to(dt), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_weight: bool = False,
             residual: torch.Tensor | None = None):
    """x [..., N] (rows read through their stride), weight [N] -> x's shape and dtype. With
    `residual` (x's shape and dtype): (x + residual, the norm of that sum), in one launch."""
    N = x.shape[-1]

    def rows_of(t):
        r = t.reshape(-1, N)
        return r if r.stride(-1) == 1 else r.contiguous()

    rows = rows_of(x)
    res = rows_of(residual) if residual is not None else rows
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    if rows.shape[0]:
        block = triton.next_power_of_2(N)
        _rms_norm_kernel[(rows.shape[0],)](rows, res, weight, total, out, rows.stride(0), res.stride(0), out.stride(0),
                                           N, eps, BLOCK=block, FP32_WEIGHT=fp32_weight, ADD=residual is not None,
                                           num_warps=8 if block >= 4096 else 4, enable_fp_fusion=False)
    if residual is None:
        return out.view(x.shape)
    return total.view(x.shape), out.view(x.shape)
