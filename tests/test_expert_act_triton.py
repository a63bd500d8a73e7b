"""The Triton MoE kernels with expert biases and the clamped SwiGLU (gpt-oss), bf16 pools and
quantized ones, decode and prefill, against the plain-torch slot paths (whose own oracle test is
tests/test_expert_act.py). Under TRITON_INTERPRET=1 where triton is importable (the CPU here),
on CUDA in the gpu-marked test.

The bias pools hold NaN in the zero slots, so a kernel that reads a cold route's bias shows it;
gate and up values spread over several clamp limits, so a missing clamp shows too.

Legend: T tokens, K routes per token, D hidden, F expert FFN size, N pool slots.
"""
from __future__ import annotations

import pytest
import torch

from ostinato.layers.moe import gpu_experts as ge
from ostinato.config import ExpertAct
from tests.triton_interpreter import needs_cuda, run_interpreted

ACT = ExpertAct("clamped_swiglu", 1.702, 1.0)


def bias_pools(N: int, F: int, D: int, zero_lo: int, zero_hi: int, device, seed=5):
    """fp32 b13 [N, 2F], b2 [N, D]; NaN in the zero slots (never read)."""
    g = torch.Generator().manual_seed(seed)
    b13, b2 = torch.randn(N, 2 * F, generator=g), torch.randn(N, D, generator=g) * 0.5
    b13[zero_lo:zero_hi] = float("nan")
    b2[zero_lo:zero_hi] = float("nan")
    return b13.to(device), b2.to(device)


def test_bias_pools_poison_the_torch_path_when_read():
    """The NaN of the zero slots reaches the output if a path reads them (it must not), and the
    torch path without the act or the biases differs: the comparisons below can fail."""
    import tests.test_gpu_experts as t

    w13, w2 = t.make_pool(torch.float32, "cpu")
    b13, b2 = bias_pools(t.N, t.F, t.D, t.ZERO_LO, t.ZERO_HI, "cpu")
    slots, weights = t.make_routing(7, 0.5, "cpu", seed=7)
    x = torch.randn(7, t.D)
    out = ge.slot_experts_torch(x, slots, weights, w13, w2, t.ZERO_LO, t.ZERO_HI, out_dtype=torch.float32,
                                b13_pool=b13, b2_pool=b2, act=ACT)
    assert torch.isfinite(out).all()
    assert (slots == t.ZERO_LO).any()
    bad = ge.slot_experts_torch(x, slots, weights, w13, w2, t.ZERO_LO + 1, t.ZERO_HI, out_dtype=torch.float32,
                                b13_pool=b13, b2_pool=b2, act=ACT)  # zero slot ZERO_LO read as hot
    assert torch.isnan(bad).any()
    plain = ge.slot_experts_torch(x, slots, weights, w13, w2, t.ZERO_LO, t.ZERO_HI, out_dtype=torch.float32)
    assert (out - plain).abs().max() > 0.1 * out.abs().max()


BF16_POOL_SCRIPT = """
    import torch
    import test_gpu_experts as t
    import test_expert_act_triton as a
    from ostinato.layers.moe import gpu_experts as ge
    from ostinato.config import ExpertAct
    tiny = dict(decode_w13={"BLOCK_F": 16, "BLOCK_D": 32, "num_warps": 4, "num_stages": 3},
                decode_w2={"BLOCK_D": 16, "BLOCK_F": 16, "num_warps": 4, "num_stages": 2},
                combine={"BLOCK_D": 32, "num_warps": 4},
                align={"backend": "triton", "CHUNK": 32, "SUB": 16, "TILE": 16, "ROWS": 2,
                       "num_warps": 4, "scan_warps": 4},
                prefill={"1": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2}})
    b13, b2 = a.bias_pools(t.N, t.F, t.D, t.ZERO_LO, t.ZERO_HI, "cpu")
    # the interpreter's bf16 tl.dot is wrong (test_gpu_experts): prefill in fp32 and fp16
    cases = [(torch.float32, "decode", 1, a.ACT), (torch.float32, "decode", 7, a.ACT),
             (torch.bfloat16, "decode", 1, a.ACT), (torch.float32, "prefill", 20, a.ACT),
             (torch.float16, "prefill", 20, a.ACT), (torch.float32, "decode", 5, ExpertAct()),
             (torch.float32, "prefill", 20, ExpertAct())]
    for dtype, path, T, act in cases:
        w13, w2 = t.make_pool(dtype, "cpu", nan_zero_slots=True)
        x = torch.randn(T, t.D).to(dtype)
        slots, weights = t.make_routing(T, 0.5, "cpu", seed=T)
        epi = dict(b13_pool=b13, b2_pool=b2, act=act)
        out = ge.slot_experts_triton(x, slots, weights, w13, w2, t.ZERO_LO, t.ZERO_HI, out_dtype=torch.float32,
                                     max_distinct=t.E, tuning=t.forced(path, **tiny), **epi)
        ref = ge.slot_experts_torch(x, slots, weights, w13, w2, t.ZERO_LO, t.ZERO_HI, out_dtype=torch.float32, **epi)
        t.assert_close(out, ref, torch.bfloat16 if dtype != torch.float32 else dtype)
    print("INTERPRETER_OK")
"""


def test_bf16_pool_kernels_under_interpreter():
    pytest.importorskip("triton")
    run_interpreted(BF16_POOL_SCRIPT, timeout=600)


QUANT_SCRIPT = """
    import torch
    import test_moe_quant_triton as t
    import test_expert_act_triton as a
    from ostinato.layers.moe import gpu_quant as gq
    tiny = dict(decode_w13={"BLOCK_F": 256, "GROUPS": 16, "num_warps": 4, "num_stages": 2},
                decode_w2={"BLOCK_D": 256, "GROUPS": 4, "num_warps": 4, "num_stages": 1},
                combine={"BLOCK_D": 256, "num_warps": 4},
                align={"backend": "triton", "CHUNK": 32, "SUB": 16, "TILE": 16, "ROWS": 2,
                       "num_warps": 4, "scan_warps": 4},
                prefill={"1": {"BLOCK_M": 64, "BLOCK_N": 256, "GROUPS": 4, "num_warps": 4, "num_stages": 2}})
    qtypes = ("MXFP4", "MXFP4")  # gpt-oss's experts
    case = t.Case(qtypes, *t.small_shape(qtypes), t.K, t.E, "cpu")
    N = t.E + t.K
    b13, b2 = a.bias_pools(N, case.F, case.D, case.zero_lo, case.zero_hi, "cpu")
    epi = dict(b13_pool=b13, b2_pool=b2, act=a.ACT)
    for path, dtype, T in [("decode", torch.bfloat16, 1), ("decode", torch.float32, 7),
                           ("prefill", torch.float16, 7), ("prefill", torch.float32, 40)]:
        x = (torch.randn(T, case.D) * 4).to(dtype)  # the random blocks' rows are small: gates cross the limit
        slots, weights = case.routing(T, 0.5, seed=T)
        out = case.run(x, slots, weights, out_dtype=torch.float32, tuning=t.forced(path, tiny), **epi)
        ref = gq.slot_experts_quant_torch(x, slots, weights, case.w13, case.w2, case.zero_lo, case.zero_hi,
                                          qtypes=qtypes, out_dtype=torch.float32, **epi)
        t.assert_close(out, ref, dtype)
    print("INTERPRETER_OK")
"""


def test_quant_kernels_under_interpreter():
    pytest.importorskip("triton")
    run_interpreted(QUANT_SCRIPT, timeout=600)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("quant", [False, True], ids=["bf16", "mxfp4"])
def test_cuda_kernels_match_torch_path(path, quant):
    """gpt-oss-120b's expert shapes (D = F = 2880: partial tiles), top-4, bf16 activations."""
    from ostinato.layers.moe import gpu_quant as gq
    from ostinato.quant import formats

    D = F = 2880
    K, E = 4, 16
    N, zero_lo, zero_hi = E + K, E, E + K
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(N, 2 * F, D, generator=g) / D**0.5
    w2 = torch.randn(N, D, F, generator=g) / F**0.5
    b13, b2 = bias_pools(N, F, D, zero_lo, zero_hi, "cuda")
    T = 1 if path == "decode" else 96
    x = torch.randn(T, D, generator=g).bfloat16().cuda()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    slots = torch.where(torch.rand(T, K, generator=g) < 0.25, zero_lo + torch.arange(K), ids).int().cuda()
    weights = torch.softmax(torch.randn(T, K, generator=g), -1).cuda()
    epi = dict(b13_pool=b13, b2_pool=b2, act=ACT)
    if quant:
        q13, q2 = formats.quantize(w13, "MXFP4").cuda(), formats.quantize(w2, "MXFP4").cuda()
        args = (x, slots, weights, q13, q2, zero_lo, zero_hi)
        got = gq.slot_experts_quant_forward(*args, qtypes=("MXFP4", "MXFP4"), out_dtype=torch.float32, **epi)
        ref = gq.slot_experts_quant_torch(*args, qtypes=("MXFP4", "MXFP4"), out_dtype=torch.float32, **epi)
    else:
        args = (x, slots, weights, w13.bfloat16().cuda(), w2.bfloat16().cuda(), zero_lo, zero_hi)
        got = ge.slot_experts_forward(*args, out_dtype=torch.float32, **epi)
        ref = ge.slot_experts_torch(*args, out_dtype=torch.float32, **epi)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-2
