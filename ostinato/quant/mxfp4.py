"""MXFP4 as GGUF stores it: 32 values in 17 bytes, an E8M0 exponent byte e then 16 bytes of
4-bit e2m1 codes (low nibble value i, high nibble value i + 16).

ggml keeps the e2m1 table doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives) and the
scale halved, 2^(e - 128), so every product is exact. The encoder follows ggml's
reference: e = floor(log2(amax)) + 125, then each value takes the nearest table entry, ties
to the smaller magnitude (ggml's first-minimum search). Because the scale is a power of two,
that search is the same as comparing |x| / scale with the midpoints between entries, which
is what `torch.bucketize` does here, without materialising 16 errors per value.

Legend: B blocks.
"""
from __future__ import annotations

import torch

BLOCK_SIZE = 32
BLOCK_BYTES = 1 + BLOCK_SIZE // 2

# Doubled e2m1 values, indexed by the 4-bit code (bit 3 is the sign).
KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# Midpoints between consecutive magnitudes 0, 1, 2, 3, 4, 6, 8, 12.
_MIDPOINTS = (0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0)


def half_scale(e: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> 2^(e - 128) as float32 (ggml's GGML_E8M0_TO_FP32_HALF; e < 2 gives
    the subnormals 2^-128 and 2^-127)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 * (e + 1), (e - 1) << 23)
    return bits.view(torch.float32)


def encode(x: torch.Tensor) -> torch.Tensor:
    """float32 [B, 32] -> uint8 [B, 17]."""
    amax = x.abs().amax(dim=1, keepdim=True)
    # log2 in float64 and rounded to float32: the correctly rounded float32 log2 that
    # ggml's log2f gives, on any device (CUDA's float32 log2 may be an ulp off).
    exp = torch.log2(amax.double()).float().floor()
    e = torch.where(amax > 0, (exp + 125).clamp(0, 255), 0).to(torch.uint8)
    midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    magnitude = torch.bucketize(x.abs() / half_scale(e), midpoints)  # ties -> lower entry
    code = (magnitude + 8 * ((x < 0) & (magnitude > 0))).to(torch.uint8)
    qs = code[:, :16] | (code[:, 16:] << 4)
    return torch.cat([e, qs], dim=1)


def decode(b: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 17] -> float32 [B, 32]."""
    qs = b[:, 1:]
    code = torch.cat([qs & 0x0F, qs >> 4], dim=1)
    table = torch.tensor(KVALUES, dtype=torch.float32, device=b.device)
    return table[code.long()] * half_scale(b[:, :1])
