"""Small bit-level helpers shared by the block codecs: fp16 fields, rounding as ggml rounds.

ggml's reference quantizers round in two ways: `roundf` (half away from zero, Q8_0) and
`nearest_int` (adding 1.5 * 2^23, so half to even: `torch.round`). Both are kept exact here,
because a code one step off changes the bytes.

Legend: B blocks, W a field's width in bytes.
"""
from __future__ import annotations

import torch


def fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [B, 1] -> its fp16 value as little-endian bytes, uint8 [B, 2]."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def fp16_field(b: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 2] (a slice of a block) -> the fp16 it holds, as float32 [B, 1]."""
    return b.contiguous().view(torch.float16).float()


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C `roundf`: halves go away from zero. `floor(|x| + 0.5)` would round 0.49999997 up,
    so the fraction is compared instead (it is exact)."""
    a = x.abs()
    whole = a.floor()
    return torch.copysign(whole + (a - whole >= 0.5), x)


def div(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c correctly rounded on every device. CUDA divides by a host number as x * (1 / c),
    which can be one ulp off the quotient that ggml's reference (and the CPU) computes; a
    divisor on x's own device is divided exactly."""
    return x / torch.tensor(c, dtype=x.dtype, device=x.device)
