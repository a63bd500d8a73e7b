"""The staging copy of a captured prefill pass (layers/moe/staging.py): each staged expert's bytes from
its row of a layer's page-locked host stack, read by the kernel through its UVA address, into its flex
slot of a pool tensor. A kernel reads host memory at 51 GB/s on an H100, 92-94% of a memcpy's pace
(scripts/bench_zero_copy.py, results/2026-12-06-h100-s39/), and it needs no host decision: which
experts, and where, come from the device (staging.plan).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 8192  # bytes a program copies a step
STEPS = 8  # steps of a program, at most: an expert's tensor gets cdiv(bytes, CHUNK * STEPS) programs


@triton.jit
def _stage_kernel(src, dst, rows_ptr, pick_ptr, rank_ptr, flex_lo,
                  NBYTES: tl.constexpr, CHUNK: tl.constexpr, STEPS: tl.constexpr):
    """Program (e, p): if expert e is staged, the steps p, p + P, ... of CHUNK bytes of its NBYTES
    from row rows[e] of src to row flex_lo + rank[e] of dst."""
    e = tl.program_id(0)
    if tl.load(pick_ptr + e) == 0:
        return
    row = tl.load(rows_ptr + e).to(tl.int64)
    slot = (tl.load(rank_ptr + e) + flex_lo).to(tl.int64)
    P = tl.num_programs(1)
    for i in range(STEPS):
        o = (tl.program_id(1) + i * P).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        m = o < NBYTES
        tl.store(dst + slot * NBYTES + o, tl.load(src + row * NBYTES + o, mask=m), mask=m)


def copy_experts(src, dst: torch.Tensor, rows: torch.Tensor, pick: torch.Tensor, rank: torch.Tensor,
                 flex_lo: int) -> None:
    """dst [slots, bytes] uint8: row flex_lo + rank[e] gets row rows[e] of src, for each e with pick[e];
    src: the host stack's bytes [rows, bytes] (a HostPointer on CUDA, a tensor under the interpreter);
    rows, rank [E] int32, pick [E] bool. One launch, no host sync: capturable."""
    nbytes = dst.shape[1]
    _stage_kernel[(pick.shape[0], triton.cdiv(nbytes, CHUNK * STEPS))](src, dst, rows, pick, rank, flex_lo,
                                                                       NBYTES=nbytes, CHUNK=CHUNK, STEPS=STEPS)
