"""Q8_0: 32 values in 34 bytes, an fp16 scale d then 32 int8 codes; w = d * q.

The encoder is ggml's reference quantizer step for step in fp32 (d = amax / 127, codes
x * (1 / d) rounded half away from zero), so its bytes are llama.cpp's and gguf's.

Legend: B blocks.
"""
from __future__ import annotations

import torch

from ostinato.quant.bits import div, fp16_bytes, fp16_field, round_half_away

BLOCK_SIZE = 32
BLOCK_BYTES = 2 + BLOCK_SIZE


def encode(x: torch.Tensor) -> torch.Tensor:
    """float32 [B, 32] -> uint8 [B, 34]."""
    d = div(x.abs().amax(dim=1, keepdim=True), 127)
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = round_half_away(x * inv).to(torch.int8)
    return torch.cat([fp16_bytes(d), q.view(torch.uint8)], dim=1)


def decode(b: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 34] -> float32 [B, 32]."""
    return b[:, 2:].view(torch.int8).float() * fp16_field(b[:, :2])
