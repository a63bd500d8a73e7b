"""Quantized expert weights in GGUF's block formats (formats: sizes, quantize, dequantize)."""
from ostinato.quant.formats import (
    QTYPES,
    block_bytes,
    block_size,
    dequantize,
    gguf_type,
    qtype_of,
    quantize,
    row_bytes,
)

__all__ = [
    "QTYPES",
    "block_bytes",
    "block_size",
    "dequantize",
    "gguf_type",
    "qtype_of",
    "quantize",
    "row_bytes",
]
