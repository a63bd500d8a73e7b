"""Counter-based pseudo-random weights, bit-identical on every device.

A synthetic checkpoint must be the same model whether it is written to disk on a CPU
or generated straight into GPU memory, tensor by tensor, in any order. torch's CPU and
CUDA generators differ, so each element is instead a hash of (tensor key, element index)
computed with 32-bit integer arithmetic held in int64 (no overflow anywhere), and turned
into a uniform float with exact operations. On CUDA, fill_uniform_ runs that arithmetic in one
Triton kernel (kernels/triton/uniform.py); the CPU gives the same bits, only slower.
"""
from __future__ import annotations

import hashlib

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27, so (2**32 - 1) * _MUL fits in int64
_ODD = 0x9E3779B9  # moves the hash off its fixed point at zero
_CHUNK = 1 << 24
_SEGMENT = 1 << 30  # divides 2**32: a segment's indices share their high word


def tensor_key(seed: int, name: str) -> int:
    """A 64-bit key per (seed, tensor name): names, not generation order, fix the values."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(h: torch.Tensor) -> torch.Tensor:
    h = (((h >> 16) ^ h) * _MUL) & _M32
    h = (((h >> 16) ^ h) * _MUL) & _M32
    return (h >> 16) ^ h


def uniform_bits(key: int, start: int, n: int, device) -> torch.Tensor:
    """n uniform floats in [0, 1) (24-bit resolution, fp32) for elements [start, start + n)."""
    idx = torch.arange(start, start + n, device=device, dtype=torch.int64)
    hi = _high_word(key, start)
    h = _mix(_mix((((idx & _M32) ^ (key & _M32)) + _ODD) & _M32) ^ hi)
    return (h >> 8).float() * (2.0 ** -24)


def _high_word(key: int, start: int) -> int:
    """The hash of the high words of element `start`'s index and of the key, as uniform_bits mixes it in."""
    return int(_mix(torch.full((1,), ((start >> 32) ^ (key >> 32)) & _M32, dtype=torch.int64))[0])


def fill_uniform_(out: torch.Tensor, key: int, std: float) -> torch.Tensor:
    """Fill a contiguous tensor with zero-mean uniform values of standard deviation `std`. On CUDA in
    one kernel per 2**30 elements (kernels/triton/uniform.py: the same values, without the temporaries)."""
    flat = out.view(-1)
    half_width = std * 3.0 ** 0.5
    if flat.is_cuda:
        from ostinato.kernels.triton.uniform import uniform_

        for start in range(0, flat.numel(), _SEGMENT):
            uniform_(flat[start:start + _SEGMENT], start, key & _M32, _high_word(key, start), 2.0 * half_width)
        return out
    for start in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - start)
        if (start & _M32) + n > _M32 + 1:
            raise ValueError("chunk crosses a 2**32 element boundary")  # cannot happen: _CHUNK divides 2**32
        u = uniform_bits(key, start, n, out.device)
        flat[start:start + n] = ((u - 0.5) * (2.0 * half_width)).to(out.dtype)
    return out


def normal_vector(key: int, n: int) -> torch.Tensor:
    """n standard normal values (Box-Muller on the CPU, so equal everywhere), fp32."""
    u = uniform_bits(key, 0, 2 * n, "cpu").double()
    u1, u2 = u[:n].clamp_min(2.0 ** -25), u[n:]
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * torch.pi * u2)).float()
