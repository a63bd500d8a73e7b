"""GGUF's quantized formats as byte tensors: sizes, quantize, dequantize, GGUF type codes.

Ostinato keeps quantized experts in their GGUF block formats, in host memory and in the GPU
pool, and its kernels dequantize inside. This module is the one place that knows the
formats: a row of n values is n / K blocks back to back (blocks run along the input
dimension, as in GGUF), each block K values in a fixed number of bytes. A quantized tensor
is a plain uint8 tensor [..., row_bytes(qtype, n)], byte-identical to a GGUF tensor's data,
so `gguf.quants.dequantize` reads what `quantize` writes and `dequantize` reads GGUF files.

Both directions are vectorised torch over all blocks, in chunks of about `chunk_values`
values to bound the temporaries, on whatever device the input lives (a CUDA tensor is
quantized on its GPU). Q8_0 and MXFP4 bytes equal gguf's and llama.cpp's; the K-quants
follow llama.cpp's reference quantizers (k_quants, k_search). The float types are casts.

Legend: n values in a row, K values in a block, B blocks.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from gguf import GGMLQuantizationType

from ostinato.config import ConfigError
from ostinato.quant import k_quants, mxfp4, q8_0

QTYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "BF16", "F16", "F32")

# Values per chunk: enough work per kernel launch, temporaries of a few times this size.
CHUNK_VALUES = {"cpu": 1 << 19, "cuda": 1 << 24}

_FLOATS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class _Codec(NamedTuple):
    block_size: int
    block_bytes: int
    encode: Callable[[torch.Tensor], torch.Tensor]  # float32 [B, K] -> uint8 [B, bytes]
    decode: Callable[[torch.Tensor], torch.Tensor]  # uint8 [B, bytes] -> float32 [B, K]


_CODECS = {
    "Q8_0": _Codec(q8_0.BLOCK_SIZE, q8_0.BLOCK_BYTES, q8_0.encode, q8_0.decode),
    "Q4_K": _Codec(
        k_quants.BLOCK_SIZE,
        k_quants.Q4_K_BYTES,
        lambda x: k_quants.encode_min_k(x, bits=4),
        lambda b: k_quants.decode_min_k(b, bits=4),
    ),
    "Q5_K": _Codec(
        k_quants.BLOCK_SIZE,
        k_quants.Q5_K_BYTES,
        lambda x: k_quants.encode_min_k(x, bits=5),
        lambda b: k_quants.decode_min_k(b, bits=5),
    ),
    "Q6_K": _Codec(
        k_quants.BLOCK_SIZE, k_quants.Q6_K_BYTES, k_quants.encode_q6_k, k_quants.decode_q6_k
    ),
    "MXFP4": _Codec(mxfp4.BLOCK_SIZE, mxfp4.BLOCK_BYTES, mxfp4.encode, mxfp4.decode),
}


def _check(qtype: str) -> str:
    if qtype not in QTYPES:
        raise ConfigError(
            f"unknown quantization type {qtype!r}: Ostinato handles {', '.join(QTYPES)}"
        )
    return qtype


def block_size(qtype: str) -> int:
    """Values per block: 32 (Q8_0, MXFP4), 256 (K-quants), 1 (float types)."""
    return 1 if _check(qtype) in _FLOATS else _CODECS[qtype].block_size


def block_bytes(qtype: str) -> int:
    """Bytes per block: 34, 144, 176, 210, 17; 2, 2, 4 for BF16, F16, F32."""
    if _check(qtype) in _FLOATS:
        return _FLOATS[qtype].itemsize
    return _CODECS[qtype].block_bytes


def row_bytes(qtype: str, n: int) -> int:
    """Bytes of a row of n values; n must be a whole number of blocks."""
    k = block_size(qtype)
    if n % k:
        raise ConfigError(
            f"a row of {n} values cannot be stored as {qtype}: its blocks hold {k} values, "
            f"so the row length must be a multiple of {k} (choose another type for this tensor)"
        )
    return n // k * block_bytes(qtype)


def quantize(w: torch.Tensor, qtype: str, chunk_values: int | None = None) -> torch.Tensor:
    """float [..., n] -> uint8 [..., row_bytes(qtype, n)] in ggml's layout, on w's device."""
    if not w.is_floating_point() or w.dim() == 0:
        raise ConfigError(f"quantize takes a float tensor [..., n], got {w.dtype} {tuple(w.shape)}")
    n = w.shape[-1]
    nbytes = row_bytes(qtype, n)
    if qtype in _FLOATS:
        return w.to(_FLOATS[qtype]).contiguous().view(torch.uint8)
    codec = _CODECS[qtype]
    out = _map_blocks(
        lambda x: codec.encode(x.float()),
        w.reshape(-1, codec.block_size),
        codec.block_bytes,
        torch.uint8,
        (chunk_values or _default_chunk(w.device)) // codec.block_size,
    )
    return out.view(*w.shape[:-1], nbytes)


def dequantize(q: torch.Tensor, qtype: str, n: int, chunk_values: int | None = None) -> torch.Tensor:
    """uint8 [..., row_bytes(qtype, n)] -> float32 [..., n], on q's device (F32 gives a view)."""
    nbytes = row_bytes(qtype, n)
    if q.dtype != torch.uint8 or q.dim() == 0 or q.shape[-1] != nbytes:
        raise ConfigError(
            f"a {qtype} tensor of rows of {n} values is uint8 [..., {nbytes}], "
            f"got {q.dtype} {tuple(q.shape)}"
        )
    if qtype in _FLOATS:
        return q.contiguous().view(_FLOATS[qtype]).float()
    codec = _CODECS[qtype]
    out = _map_blocks(
        codec.decode,
        q.reshape(-1, codec.block_bytes),
        codec.block_size,
        torch.float32,
        (chunk_values or _default_chunk(q.device)) // codec.block_size,
    )
    return out.view(*q.shape[:-1], n)


def _default_chunk(device: torch.device) -> int:
    return CHUNK_VALUES["cpu" if device.type == "cpu" else "cuda"]


def _map_blocks(fn, blocks: torch.Tensor, width: int, dtype: torch.dtype, step: int) -> torch.Tensor:
    """fn over blocks [B, *], `step` blocks at a time, gathered into one [B, width]."""
    out = torch.empty(blocks.shape[0], width, dtype=dtype, device=blocks.device)
    step = max(1, step)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = fn(blocks[start : start + step])
    return out


def gguf_type(qtype: str) -> GGMLQuantizationType:
    """Ostinato's type name -> the GGUF tensor type code."""
    return GGMLQuantizationType[_check(qtype)]


def qtype_of(ggml_type: GGMLQuantizationType | int) -> str:
    """A GGUF tensor type code -> Ostinato's type name; ConfigError for types it cannot read."""
    t = GGMLQuantizationType(ggml_type)
    if t.name not in QTYPES:
        raise ConfigError(
            f"GGUF tensor type {t.name} is not supported: Ostinato reads {', '.join(QTYPES)}; "
            f"requantize the model with llama-quantize (for example to Q4_K_M or MXFP4_MOE)"
        )
    return t.name
