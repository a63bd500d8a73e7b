"""Q4_K, Q5_K and Q6_K: super-blocks of 256 values in ggml's byte layout (ggml-common.h).

Q4_K (144 bytes) and Q5_K (176): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc and mins m
for eight sub-blocks of 32, [Q5_K: qh, 32 bytes of fifth bits], qs, 128 bytes of low
nibbles; w = d * sc * q - dmin * m. Each 32-byte run of qs holds sub-block 2j in its low
nibbles and 2j + 1 in its high nibbles; bit s of qh[l] is the fifth bit of value l of
sub-block s.
Q6_K (210 bytes): ql (128 bytes of low nibbles), qh (64 bytes of 2-bit high parts),
sixteen int8 scales for sub-blocks of 16, fp16 d; w = d * sc * (q - 32). Each half of 128
values is four quarters of 32: ql holds quarters 0, 1 in low nibbles and 2, 3 in high
nibbles; qh[l] holds the high parts of value l of quarters 0..3 at bits 0, 2, 4, 6.

Encoders follow ggml's reference quantizers (what llama-quantize writes without an
importance matrix): fit each sub-block (k_search), quantize the sub-block scales to
6 bits (8 signed bits for Q6_K) against one fp16 super-scale, then re-round every value
against the scale it will be read with. Decoders do the same float operations in the same
order as ggml and gguf, so they agree bit for bit.

Legend: B super-blocks, S sub-blocks of a super-block, V values in a sub-block.
"""
from __future__ import annotations

import torch

from ostinato.quant.bits import div, fp16_bytes, fp16_field
from ostinato.quant.k_search import GROUP_MAX_EPS, fit_scale, fit_scale_min

BLOCK_SIZE = 256
Q4_K_BYTES = 144
Q5_K_BYTES = 176
Q6_K_BYTES = 210

# (nmax, rmin, rdelta, nstep) of ggml's make_qkx2_quants call for each format.
_SEARCH = {4: (15, -1.0, 0.1, 20), 5: (31, -0.5, 0.1, 15)}


def pack_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """6-bit scales and mins, uint8 [B, 8] each -> ggml's 12 packed bytes [B, 12]."""
    low = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    high = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return torch.cat([low, mid, high], dim=1)


def unpack_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [B, 12] -> (sc, m), uint8 [B, 8] each."""
    low, mid, high = s[:, :4], s[:, 4:8], s[:, 8:]
    sc = torch.cat([low & 0x3F, (high & 0x0F) | ((low >> 6) << 4)], dim=1)
    m = torch.cat([mid & 0x3F, (high >> 4) | ((mid >> 6) << 4)], dim=1)
    return sc, m


def encode_min_k(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 [B, 256] -> Q4_K (bits=4) uint8 [B, 144] or Q5_K (bits=5) [B, 176]."""
    nmax, rmin, rdelta, nstep = _SEARCH[bits]
    B = x.shape[0]
    sub = x.view(B, 8, 32)
    weights = sub.square().mean(dim=2, keepdim=True).sqrt() + sub.abs()
    scale, low = fit_scale_min(
        sub.reshape(-1, 32), weights.reshape(-1, 32), nmax, rmin, rdelta, nstep
    )
    scale, low = scale.view(B, 8), low.view(B, 8)

    max_scale = scale.amax(dim=1, keepdim=True).clamp(min=0)
    max_low = low.amax(dim=1, keepdim=True).clamp(min=0)
    sc = _six_bits(scale, max_scale)
    m = _six_bits(low, max_low)
    d, dmin = fp16_bytes(div(max_scale, 63)), fp16_bytes(div(max_low, 63))

    step = (fp16_field(d) * sc)[:, :, None]  # the scales the decoder will use
    offset = (fp16_field(dmin) * m)[:, :, None]
    q = ((sub + offset) / step).round().clamp(0, nmax)
    q = torch.where(step == 0, torch.zeros_like(q), q).to(torch.uint8)  # [B, 8, 32]

    parts = [d, dmin, pack_scales(sc.to(torch.uint8), m.to(torch.uint8))]
    if bits == 5:
        shifts = torch.arange(8, dtype=torch.uint8, device=x.device)[None, :, None]
        parts.append(((q >> 4) << shifts).sum(dim=1, dtype=torch.uint8))  # qh [B, 32]
        q = q & 0x0F
    pairs = q.view(B, 4, 2, 32)
    parts.append((pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(B, 128))
    return torch.cat(parts, dim=1)


def _six_bits(v: torch.Tensor, vmax: torch.Tensor) -> torch.Tensor:
    """Sub-block scales [B, 8] as 6-bit multiples of vmax / 63 (float32, values 0..63)."""
    inv = torch.where(vmax > 0, 63 / vmax, torch.zeros_like(vmax))
    return (inv * v).round().clamp(0, 63)


def decode_min_k(b: torch.Tensor, bits: int) -> torch.Tensor:
    """Q4_K uint8 [B, 144] (bits=4) or Q5_K [B, 176] (bits=5) -> float32 [B, 256]."""
    B = b.shape[0]
    sc, m = unpack_scales(b[:, 4:16])
    step = (fp16_field(b[:, 0:2]) * sc.float())[:, :, None]
    offset = (fp16_field(b[:, 2:4]) * m.float())[:, :, None]
    qs = b[:, -128:].view(B, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).view(B, 8, 32)
    if bits == 5:
        shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[None, :, None]
        q = q | (((b[:, 16:48][:, None, :] >> shifts) & 1) << 4)
    return (step * q.float() - offset).view(B, 256)


def encode_q6_k(x: torch.Tensor) -> torch.Tensor:
    """float32 [B, 256] -> uint8 [B, 210]."""
    B = x.shape[0]
    sub = x.view(B, 16, 16)
    scale = fit_scale(sub.reshape(-1, 16), 32).view(B, 16)
    top = scale.gather(1, scale.abs().argmax(dim=1, keepdim=True))  # signed, [B, 1]
    zero = top.abs() < GROUP_MAX_EPS
    inv = torch.where(zero, 0.0, -128 / torch.where(zero, 1.0, top))
    d = fp16_bytes(torch.where(zero, torch.zeros_like(top), 1 / inv))
    sc = (inv * scale).round().clamp(-128, 127)

    step = (fp16_field(d) * sc)[:, :, None]
    q = ((sub / step).round().clamp(-32, 31) + 32).view(B, 256)
    q = torch.where((step == 0).expand(-1, -1, 16).reshape(B, 256), torch.zeros_like(q), q)
    q = q.to(torch.uint8).view(B, 2, 4, 32)  # half, quarter, value

    ql = ((q[:, :, :2] & 0x0F) | ((q[:, :, 2:] & 0x0F) << 4)).reshape(B, 128)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=x.device)[None, None, :, None]
    qh = ((q >> 4) << shifts).sum(dim=2, dtype=torch.uint8).reshape(B, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), d], dim=1)


def decode_q6_k(b: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 210] -> float32 [B, 256]."""
    B = b.shape[0]
    ql = b[:, :128].view(B, 2, 2, 32)
    qh = b[:, 128:192].view(B, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[None, None, :, None]
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # [B, 2, 4, 32]
    q = (low | (((qh >> shifts) & 3) << 4)).view(B, 16, 16).float() - 32
    step = fp16_field(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()
    return (step[:, :, None] * q).view(B, 256)
