"""The synthetic models' counter-based generator (synth/hashrand.py) in one launch on CUDA.

The torch expression of synth/hashrand.py is the definition: per element, a hash of (tensor key, element
index) in 32-bit arithmetic held in int64, turned into a uniform float, then scaled and rounded to the
tensor's dtype. As torch ops it makes about thirty int64 temporaries of a chunk's size. A synthetic
gpt-oss-120b draws 115 G float values for its MXFP4 experts, and its loads took 161-195 s for them on an
H200 (results/2026-12-06-h200-s46/): about 0.6-0.7 G values a second, what the loads of the bf16 30B shape
imply too. That the generator is the larger part of it is inferred, not yet timed alone
(scripts/bench_synth_load.py times each step). Here each element is computed in registers and written once. The arithmetic is the same int64 arithmetic with the same masks, and the float steps the same
fp32 operations, so the values are bit for bit those of the torch expression
(tests/test_hashrand.py, under Triton's interpreter and on CUDA).

Grid (ceil(n / BLOCK),): each program BLOCK consecutive elements of one segment, a run of elements within
which the index's high word is constant (the caller passes that word's hash, `hi`).

The two 32-bit words (the key's low word and `hi`) travel as signed int32 and are masked back to unsigned
in the kernel. Triton types a Python int of 2**31 or more as int64 and one below as int32, and compiles a
kernel per signature: passed as they are, random words need up to four compiles in a process's first
calls. Session 47's step-by-step timing (scripts/bench_synth_load.py, on an H100) gave the generator 30 ms
an expert's gate_up where the loader's whole expert took 11 ms; with one signature, session 48's gave
0.45 ms on the same machine kind (results/2026-12-07-h100-s48/).
"""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _mix(h):
    h = (((h >> 16) ^ h) * 0x45D9F3B) & 0xFFFFFFFF
    h = (((h >> 16) ^ h) * 0x45D9F3B) & 0xFFFFFFFF
    return (h >> 16) ^ h


@triton.jit(do_not_specialize=["n", "first", "key_lo", "hi"])
def _uniform_kernel(out_ptr, n, first, key_lo, hi, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    idx = first.to(tl.int64) + offs  # the element's index, its high word `hi`'s
    key = key_lo.to(tl.int64) & 0xFFFFFFFF  # the words as unsigned (they come as int32)
    h = (((idx & 0xFFFFFFFF) ^ key) + 0x9E3779B9) & 0xFFFFFFFF
    h = _mix(_mix(h) ^ (hi.to(tl.int64) & 0xFFFFFFFF))
    u = (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
    tl.store(out_ptr + offs, ((u - 0.5) * scale).to(out_ptr.dtype.element_ty), mask=mask)


def uniform_(flat, first: int, key_lo: int, hi: int, scale: float) -> None:
    """flat[i] = ((u(first + i) - 0.5) * scale) in flat's dtype, for a contiguous 1-D tensor whose
    indices first .. first + numel - 1 share one high word (hashrand.fill_uniform_ passes segments of 2**30)."""
    n = flat.numel()
    if n:
        _uniform_kernel[(triton.cdiv(n, BLOCK),)](flat, n, first, _int32(key_lo), _int32(hi), scale, BLOCK=BLOCK)


def _int32(word: int) -> int:
    """A 32-bit word as the signed int32 of the same bits: one kernel signature for every word."""
    return word - (1 << 32) if word >= 1 << 31 else word
