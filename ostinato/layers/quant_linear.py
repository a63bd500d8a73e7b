"""Dense linear layers whose weights stay in their GGUF blocks on the GPU, as llama.cpp keeps them.

A Q4_K_M file stores attention and the head in Q4_K and Q6_K: 4.5-6.6 bits a value against bf16's 16.
Dequantized at load, a Qwen3-235B-A22B-shaped model of 32 layers spent 5.84 GB of a 24 GiB cap on
them (session 18), about 4 GB more than their blocks: some 350 experts the pool could hold instead.
Kept as blocks, a decode step also reads 3.5x fewer dense bytes.

`QuantLinear` holds uint8 qweight [N, row_bytes(qt, n)] (and a float bias if the layer has one) and
computes what nn.Linear computes on the dequantized weight (the values gguf.quants gives):
- CUDA, passes of at most "dense_matvec_max_tokens" tokens (decode): the matvec kernel
  (kernels/triton/quant_linear.py), fp32 products and sums, capturable in the decode graph;
- larger passes: rows of the weight dequantized into the activation dtype, at most
  DEQUANT_BYTES at a time (the scratch the capacity test counts), then torch's GEMM;
- the CPU: the same with formats.dequantize (the oracle's arithmetic; fp32 on a CPU runner).
`keep_quantized_` swaps a model's nn.Linear modules for these by parameter name (loader/build.py
dense_formats says which), so the models themselves stay plain PyTorch.

Legend: T tokens, N output features, n input features.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ostinato.quant import formats

DEQUANT_BYTES = 64 << 20  # the most of a weight a pass above the matvec holds dequantized at once


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, qtype: str, bias: bool = False,
                 bias_dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        self.register_buffer("qweight", torch.empty(out_features, formats.row_bytes(qtype, in_features),
                                                    dtype=torch.uint8))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.qweight, self.qtype, self.in_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}, " \
               f"bias={self.bias is not None}"


def quant_linear(x: torch.Tensor, w: torch.Tensor, qtype: str, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x[..., n] @ dequantize(w[N, row_bytes(qtype, n)]).T (+ bias) -> [..., N] in x's dtype."""
    lead, x2 = x.shape[:-1], x.reshape(-1, n)
    if x.is_cuda:
        from ostinato.kernels.triton.quant_linear import matvec
        from ostinato.layers.moe.gpu_quant import quant_tuning

        tuning = quant_tuning(x.device)
        if x2.shape[0] <= tuning["dense_matvec_max_tokens"]:
            return matvec(x2.contiguous(), w, qtype, bias, tuning["dense_matvec"]).reshape(*lead, -1)
    return dequant_linear(x2, w, qtype, n, bias).reshape(*lead, -1)


def dequant_linear(x: torch.Tensor, w: torch.Tensor, qtype: str, n: int, bias: torch.Tensor | None = None):
    """x[T, n] times w's rows dequantized into x's dtype, at most DEQUANT_BYTES of them at a time, by
    torch's GEMM -> [T, N]."""
    N = w.shape[0]
    step = max(1, DEQUANT_BYTES // (n * x.element_size()))
    if step >= N:
        return F.linear(x, dequantized(w, qtype, n, x.dtype), bias)
    out = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    for r in range(0, N, step):
        part = None if bias is None else bias[r:r + step]
        out[:, r:r + step] = F.linear(x, dequantized(w[r:r + step], qtype, n, x.dtype), part)
    return out


def dequantized(w: torch.Tensor, qtype: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 w[N, row_bytes(qtype, n)] -> [N, n] in `dtype` (the fp32 values, rounded once)."""
    if w.is_cuda:
        from ostinato.kernels.triton.moe_quant import dequantize_rows

        return dequantize_rows(w, qtype, n, out=torch.empty(w.shape[0], n, dtype=dtype, device=w.device))
    return formats.dequantize(w, qtype, n).to(dtype)


def keep_quantized_(model: nn.Module, qtypes: dict[str, str]) -> nn.Module:
    """Replace the nn.Linear whose weight is named in `qtypes` (parameter name -> block qtype) by a
    QuantLinear of the same shape and bias, uninitialised on the linear's device (meta before a
    load). Returns the model."""
    for name, qtype in qtypes.items():
        path, _, attr = name.removesuffix(".weight").rpartition(".")
        parent = model.get_submodule(path)
        linear = getattr(parent, attr)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{name}: {type(linear).__name__} is not an nn.Linear")
        with torch.device(linear.weight.device):
            q = QuantLinear(linear.in_features, linear.out_features, qtype, linear.bias is not None,
                            None if linear.bias is None else linear.bias.dtype)
        setattr(parent, attr, q)
    return model


def quantized_bytes(module: nn.Module) -> int:
    """Bytes of the QuantLinear weights inside `module` (their biases are parameters, counted with those)."""
    return sum(m.qweight.numel() for m in module.modules() if isinstance(m, QuantLinear))
