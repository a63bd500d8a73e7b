"""A linear layer over GGUF blocks on the GPU: the decode matvec, and the dequantization a larger pass
multiplies with.

Legend: T tokens, N output features (rows of the weight), n input features, B bytes of a row.
The weight is uint8 w[N, row_bytes(qt, n)], blocks along the input dimension, as a GGUF file
stores `attn_q.weight` and `output.weight`; its values are read as lanes (moe_quant.py's docstring:
each payload byte yields two values at element indices the lane knows, 16 lanes share scales).

- _matvec_kernel, grid (N / BLOCK_N, T): BLOCK_N rows of the weight for one token, fp32 products of
  the dequantized values (as gguf.quants computes them) with x, a fixed-shape sum, then the bias;
  memory bound: a decode step reads each weight byte once per token.
- a larger pass dequantizes rows of the weight into its activation dtype (moe_quant.dequantize_rows)
  and multiplies them with torch's GEMM (layers/quant_linear.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.kernels.triton.moe_quant import LANES, _lanes, _rows_at, check_words


@triton.jit
def _matvec_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, n, stride_xt, stride_wr, stride_ot,
                   QT: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                   NUM_STAGES: tl.constexpr, HAS_BIAS: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # rows on axis 0: a head's 151936 exceed axis 1's 65535
    t = tl.program_id(1)
    rows = _rows_at(w_ptr, offs_n[:, None, None], stride_wr, QT)  # [BLOCK_N, 1, 1]
    live = (offs_n < N)[:, None, None]
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    groups = tl.arange(0, GROUPS)[None, :, None]
    i = tl.arange(0, LANES)[None, None, :]
    num_groups = n // 32
    acc = tl.zeros([BLOCK_N, GROUPS, LANES], dtype=tl.float32)
    for g0 in tl.range(0, num_groups, GROUPS, num_stages=NUM_STAGES):
        gg = g0 + groups
        ok = gg < num_groups
        w_lo, w_hi, e_lo, e_hi = _lanes(rows, gg, i, live & ok, QT)
        x_lo = tl.load(x_row + e_lo, mask=ok, other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + e_hi, mask=ok, other=0.0).to(tl.float32)
        acc += w_lo * x_lo + w_hi * x_hi
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def matvec(x: torch.Tensor, w: torch.Tensor, qtype: str, bias: torch.Tensor | None, cfg: dict,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x[T, n] (unit last stride) @ dequantized(w[N, B]).T (+ bias[N]) -> out[T, N] in x's dtype.
    cfg: BLOCK_N, GROUPS, num_warps, num_stages (gpu_quant's "dense_matvec" tuning)."""
    T, n = x.shape
    N = w.shape[0]
    check_words(w, qtype)
    out = torch.empty(T, N, dtype=x.dtype, device=x.device) if out is None else out
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), T)
    _matvec_kernel[grid](x, w, bias if bias is not None else w, out, N, n, x.stride(0), w.stride(0), out.stride(0),
                         QT=qtype, BLOCK_N=cfg["BLOCK_N"], GROUPS=cfg["GROUPS"], NUM_STAGES=cfg["num_stages"],
                         HAS_BIAS=bias is not None, num_warps=cfg["num_warps"])
    return out
