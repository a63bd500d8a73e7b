"""The expert activation of the Triton MoE kernels (layers/moe/types.py ExpertAct), shared by
the bf16 and quantized decode and prefill kernels: ACT is a constexpr, so each kind compiles
to its own code and the SwiGLU kernels are the ones they were.

  ACT 0  silu(g) * u
  ACT 1  clamped SwiGLU (gpt-oss): g' = min(g, LIMIT), u' = clamp(u, -LIMIT, LIMIT),
         (u' + 1) * g' * sigmoid(ALPHA * g')
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def activate(gate, up, ACT: tl.constexpr, ALPHA, LIMIT):
    """h from gate and up (fp32 tiles of one shape, their biases already added)."""
    if ACT == 0:
        h = gate * tl.sigmoid(gate) * up
    else:
        g = tl.minimum(gate, LIMIT)
        u = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        h = (u + 1.0) * (g * tl.sigmoid(g * ALPHA))
    return h
