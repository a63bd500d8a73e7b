"""MXFP4 as GGUF stores it: 32 values in 17 bytes, an E8M0 exponent byte e then 16 bytes of
4-bit e2m1 codes (low nibble value i, high nibble value i + 16).

ggml keeps the e2m1 table doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives) and the
scale halved, 2^(e - 128), so every product is exact. The encoder follows ggml's
reference: e = floor(log2(amax)) + 125, then each value takes the nearest table entry, ties
to the smaller magnitude (ggml's first-minimum search). Because the scale is a power of two,
that search is the same as comparing |x| / scale with the midpoints between entries, which
is what `torch.bucketize` does here, without materialising 16 errors per value.

Hugging Face's MXFP4 (gpt-oss checkpoints) has the same codes and scale bytes, stored apart
(`*_blocks`, `*_scales`) and with even / odd elements in the low / high nibbles: `from_hf` and
`to_hf` repack between the two without changing a bit of what they mean.

Legend: B blocks, G blocks of a row.
"""
from __future__ import annotations

import functools

import torch

BLOCK_SIZE = 32
BLOCK_BYTES = 1 + BLOCK_SIZE // 2

# Doubled e2m1 values, indexed by the 4-bit code (bit 3 is the sign).
KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# Midpoints between consecutive magnitudes 0, 1, 2, 3, 4, 6, 8, 12.
_MIDPOINTS = (0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0)


@functools.lru_cache(maxsize=None)
def _constant(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A small float32 table on `device`, made once: building it per call is a copy from
    pageable host memory, which waits for the device's queue."""
    return torch.tensor(values, dtype=torch.float32, device=device)


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
    magnitude = torch.bucketize(x.abs() / half_scale(e), _constant(_MIDPOINTS, x.device))  # ties -> lower entry
    code = (magnitude + 8 * ((x < 0) & (magnitude > 0))).to(torch.uint8)
    qs = code[:, :16] | (code[:, 16:] << 4)
    return torch.cat([e, qs], dim=1)


def decode(b: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 17] -> float32 [B, 32]."""
    qs = b[:, 1:]
    code = torch.cat([qs & 0x0F, qs >> 4], dim=1)
    return _constant(KVALUES, b.device)[code.long()] * half_scale(b[:, :1])


def from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Hugging Face MXFP4 (gpt-oss checkpoints) -> GGUF blocks.

    blocks uint8 [..., G, 16]: byte i of a 32-value block holds element 2i in its low nibble
    and 2i + 1 in its high one; scales uint8 [..., G]: E8M0, the block is 2^(s - 127) times the
    e2m1 values. -> uint8 [..., G * 17], GGUF's layout (the scale byte, then element i in the
    low nibble and i + 16 in the high one of byte i). The e2m1 codes are the same, and GGUF's
    doubled table with 2^(e - 128) is the same value as 2^(s - 127) times the plain one, so
    the scale byte is kept as it is: a lossless repack.
    """
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32] natural order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scales[..., None], qs), dim=-1).flatten(-2)


def to_hf(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF blocks uint8 [..., G * 17] -> Hugging Face (blocks [..., G, 16], scales [..., G]):
    from_hf's inverse."""
    b = rows.unflatten(-1, (-1, BLOCK_BYTES))  # [..., G, 17]
    qs = b[..., 1:]
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [..., G, 32] natural order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), b[..., 0].contiguous()
