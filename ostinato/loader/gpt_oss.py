"""gpt-oss's routed experts as Hugging Face stores them -> the project's stacked layout.

The checkpoint keeps each layer's experts fused, transposed and with gate and up interleaved
(transformers' GptOssExperts; checked against its `_apply_gate`: even columns gate, odd up):
  mlp.experts.gate_up_proj        [E, D, 2F]   column 2f is gate f, 2f + 1 up f
  mlp.experts.gate_up_proj_bias   [E, 2F]      interleaved alike
  mlp.experts.down_proj           [E, F, D]
  mlp.experts.down_proj_bias      [E, D]
or, in an MXFP4 checkpoint (quantization_config.quant_method "mxfp4", as openai ships it),
the two weights as blocks along their input dimension, rows the output features:
  mlp.experts.gate_up_proj_blocks [E, 2F, D/32, 16] uint8, _scales [E, 2F, D/32] (E8M0)
  mlp.experts.down_proj_blocks    [E, D, F/32, 16] uint8,  _scales [E, D, F/32]
The project's layout (layers/moe/types.py) is w13 [E, 2F, D] with gate rows then up rows,
w2 [E, D, F], b13 [E, 2F] (gate, then up), b2 [E, D]: de-interleaving once here keeps every
kernel's [gate; up] layout. MXFP4 rows are repacked into GGUF's block layout without loss
(quant/mxfp4.py from_hf), so the quantized kernels read gpt-oss's own bits; as floats they
are those bits dequantized, what transformers computes with on a machine without its kernels.

`read(name, e)` is the source's: expert e's slice of a stacked tensor (e None: all of it).
Experts are read one at a time, so no layer-sized temporary is made (a gpt-oss-120b layer's
gate_up_proj is 4 GiB in bf16).

Legend: E experts, D hidden, F expert FFN size, G blocks of 32 values in a row.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ostinato.config import ConfigError
from ostinato.quant import formats
from ostinato.quant.mxfp4 import from_hf

Reader = Callable[[str, "int | None"], torch.Tensor]
MXFP4 = ("MXFP4", "MXFP4")


def prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts."


def float_shapes(E: int, D: int, F: int) -> dict[str, tuple[int, ...]]:
    """The bf16 checkpoint's expert tensors of one layer, by name suffix."""
    return {"gate_up_proj": (E, D, 2 * F), "gate_up_proj_bias": (E, 2 * F), "down_proj": (E, F, D),
            "down_proj_bias": (E, D)}


def mxfp4_shapes(E: int, D: int, F: int) -> dict[str, tuple[int, ...]]:
    """The MXFP4 checkpoint's expert tensors of one layer, by name suffix."""
    return {"gate_up_proj_blocks": (E, 2 * F, D // 32, 16), "gate_up_proj_scales": (E, 2 * F, D // 32),
            "gate_up_proj_bias": (E, 2 * F), "down_proj_blocks": (E, D, F // 32, 16),
            "down_proj_scales": (E, D, F // 32), "down_proj_bias": (E, D)}


def is_fused(names, layer: int) -> bool:
    """The checkpoint stores this layer's experts the gpt-oss way (either form)."""
    p = prefix(layer)
    return p + "gate_up_proj" in names or p + "gate_up_proj_blocks" in names


def qtypes(names, layer: int) -> tuple[str, str] | None:
    """("MXFP4", "MXFP4") for an MXFP4 layer, None for float weights."""
    return MXFP4 if prefix(layer) + "gate_up_proj_blocks" in names else None


def check_shapes(shape_of: Callable[[str], tuple[int, ...]], names, layer: int, E: int, D: int, F: int) -> None:
    """ConfigError unless the layer's expert tensors have the shapes config.json implies."""
    want = mxfp4_shapes(E, D, F) if qtypes(names, layer) else float_shapes(E, D, F)
    for suffix, shape in want.items():
        name = prefix(layer) + suffix
        if name not in names:
            raise ConfigError(f"the checkpoint lacks tensor {name!r} that config.json implies")
        if tuple(shape_of(name)) != shape:
            raise ConfigError(f"tensor {name!r} has shape {list(shape_of(name))}, but config.json implies "
                              f"{list(shape)}")


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Even then odd entries along dim: [g0, u0, g1, u1, ...] -> [g0, g1, ..., u0, u1, ...]."""
    dim = dim % t.dim()
    pairs = t.unflatten(dim, (t.shape[dim] // 2, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)


def _mxfp4_rows(read: Reader, layer: int, which: str, e: int) -> torch.Tensor:
    """Expert e's rows of `which` ("gate_up_proj" or "down_proj") as GGUF MXFP4 blocks."""
    p = prefix(layer) + which
    return from_hf(read(p + "_blocks", e), read(p + "_scales", e))


def load_biases_(read: Reader, layer: int, b13: torch.Tensor, b2: torch.Tensor) -> None:
    p = prefix(layer)
    b13.copy_(deinterleave(read(p + "gate_up_proj_bias", None), 1))
    b2.copy_(read(p + "down_proj_bias", None))


def load_float_(read: Reader, names, layer: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """The layer's experts as floats into w13 [E, 2F, D] and w2 [E, D, F] (any dtype and
    device): the bf16 weights de-interleaved and transposed, or MXFP4 ones dequantized."""
    p = prefix(layer)
    D, F = w2.shape[1], w2.shape[2]
    for e in range(w13.shape[0]):
        if qtypes(names, layer):
            g13 = formats.dequantize(_mxfp4_rows(read, layer, "gate_up_proj", e), "MXFP4", D)  # [2F, D] interleaved
            w13[e].copy_(deinterleave(g13, 0))
            w2[e].copy_(formats.dequantize(_mxfp4_rows(read, layer, "down_proj", e), "MXFP4", F))
        else:
            w13[e].copy_(deinterleave(read(p + "gate_up_proj", e).transpose(0, 1), 0))  # [D, 2F] -> [2F, D]
            w2[e].copy_(read(p + "down_proj", e).transpose(0, 1))  # [F, D] -> [D, F]


def load_quantized_(read: Reader, names, layer: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """The layer's MXFP4 experts, repacked into w13 uint8 [E, 2F, row_bytes("MXFP4", D)] and
    w2 uint8 [E, D, row_bytes("MXFP4", F)], gate rows then up rows."""
    if qtypes(names, layer) != MXFP4:
        raise ConfigError(f"layer {layer}: the checkpoint's experts are not MXFP4 blocks")
    for e in range(w13.shape[0]):
        w13[e].copy_(deinterleave(_mxfp4_rows(read, layer, "gate_up_proj", e), 0))
        w2[e].copy_(_mxfp4_rows(read, layer, "down_proj", e))
