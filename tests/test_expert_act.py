"""The expert seam beyond SwiGLU: gpt-oss's clamped SwiGLU and per-expert biases, in every CPU
path (the reference MoE, torch_reference / quant_reference, the native kernels bf16, fp32 and
quantized, direct and scatter down projections, the decode graph's worker arguments) and in the
pool's torch path (the GPU branch's oracle).

Legend: T tokens, K experts per token, E experts, D hidden, F expert FFN size.
The weights are scaled so that gate and up values spread over several times the clamp limit:
both clamps act on a good share of the elements (checked), so a kernel that skips one fails.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F_

from ostinato.config import ConfigError
from ostinato.layers.moe import gpu_experts as ge
from ostinato.layers.moe import gpu_quant as gq
from ostinato.layers.moe.cpu_experts import CpuExperts, quant_reference, torch_reference
from ostinato.layers.moe.reference import moe_forward
from ostinato.config import ExpertAct
from ostinato.layers.moe.types import ExpertWeights, QuantExpertWeights, TopKOutput
from ostinato.quant import formats
from tests.test_cpu_experts import available_isas, make_routes, make_x, native_skip_reason, rel_err

E, K, D, F = 8, 4, 256, 128
ACT = ExpertAct("clamped_swiglu", alpha=1.702, limit=1.5)


def oai_layer(dtype, seed=0, d=D, f=F, e=E, act=ACT) -> ExpertWeights:
    """Experts whose gate / up values (x ~ N(0, 1)) spread over about +-2.5 limits."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * f, d, generator=g) * 2.0 / d**0.5).to(dtype)
    w2 = (torch.randn(e, d, f, generator=g) / f**0.5).to(dtype)
    b13 = torch.randn(e, 2 * f, generator=g)
    b2 = torch.randn(e, d, generator=g) * 0.5
    return ExpertWeights(w13, w2, b13, b2, act)


def by_hand(w: ExpertWeights, x, tok, ids, wts) -> torch.Tensor:
    """The gpt-oss expert written out from its definition (transformers' GptOssExperts, with
    gate/up de-interleaved): fp32, one route at a time."""
    out = torch.zeros(x.shape[0], x.shape[1])
    lim, alpha = w.act.limit, w.act.alpha
    for t, e, wt in zip(tok.tolist(), ids.tolist(), wts.tolist()):
        gu = w.w13[e].float() @ x[t].float() + w.b13[e]
        gate, up = gu[:F].clamp(max=lim), gu[F:].clamp(-lim, lim)
        h = ((up + 1) * gate * torch.sigmoid(gate * alpha)).to(w.w2.dtype).float()
        out[t] += wt * (w.w2[e].float() @ h + w.b2[e])
    return out


def test_torch_reference_is_the_definition():
    w = oai_layer(torch.float32)
    x = make_x(9, torch.float32)
    tok, ids, wts = make_routes(9, 0.0, e=E, k=K)
    gu = torch.einsum("ed,efd->ef", x[tok], w.w13[ids.long()]) + w.b13[ids.long()]
    # the clamps bite: a good share of gates above the limit, of ups beyond either side
    assert (gu[:, :F] > ACT.limit).float().mean() > 0.1 and (gu[:, F:].abs() > ACT.limit).float().mean() > 0.2
    ref = torch_reference(w.w13, w.w2, x, tok, ids, wts, b13=w.b13, b2=w.b2, act=w.act)
    assert rel_err(ref, by_hand(w, x, tok, ids, wts)) < 1e-6
    plain = torch_reference(w.w13, w.w2, x, tok, ids, wts)  # the SwiGLU of the same weights differs
    assert rel_err(plain, ref) > 0.3


def test_reference_moe_uses_the_experts_act_and_biases():
    w = oai_layer(torch.float32)
    T = 6
    x = make_x(T, torch.float32)
    tok, ids, wts = make_routes(T, 0.0, e=E, k=K)
    topk = TopKOutput(ids.view(T, K).long(), wts.view(T, K))
    assert rel_err(moe_forward(x, topk, w), by_hand(w, x, tok, ids, wts)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T", [1, 7, 64])
def test_native_matches_oracle(dtype, T):
    if native_skip_reason():
        pytest.skip(native_skip_reason())
    w = oai_layer(dtype)
    x = make_x(T, dtype)
    tok, ids, wts = make_routes(T, 0.25 if T > 1 else 0.0, e=E, k=K)
    ref = torch_reference(w.w13, w.w2, x, tok, ids, wts, b13=w.b13, b2=w.b2, act=w.act)
    experts = CpuExperts([w], num_threads=2, backend="native", spin_us=100)
    for isa in available_isas():
        experts.set_isa(isa)
        out = experts.forward(0, x, tok, ids, wts)
        assert rel_err(out, ref) < 1e-4, isa
    experts.close()


def test_native_direct_and_scatter_agree_bitwise():
    """The down bias enters before the routing weight in both down modes: the same bits."""
    if native_skip_reason():
        pytest.skip(native_skip_reason())
    w = oai_layer(torch.bfloat16)
    T = 5
    x = make_x(T, torch.bfloat16)
    tok, ids, wts = make_routes(T, 0.0, e=E, k=K)
    experts = CpuExperts([w], num_threads=2, backend="native", spin_us=100)
    outs = []
    for mode in (1, 2):
        experts._args[0].down_mode = mode
        outs.append(experts.forward(0, x, tok, ids, wts).clone())
    assert torch.equal(outs[0], outs[1])
    experts.close()


def test_native_silu_with_biases():
    """Biases are independent of the activation: SwiGLU experts with biases (an ExpertWeights
    with b13, b2 and the default act) run through the same kernels."""
    if native_skip_reason():
        pytest.skip(native_skip_reason())
    w = oai_layer(torch.bfloat16)._replace(act=ExpertAct())
    x = make_x(7, torch.bfloat16)
    tok, ids, wts = make_routes(7, 0.0, e=E, k=K)
    ref = torch_reference(w.w13, w.w2, x, tok, ids, wts, b13=w.b13, b2=w.b2)
    out = CpuExperts([w], num_threads=2, backend="native").forward(0, x, tok, ids, wts)
    assert rel_err(out, ref) < 1e-4


@functools.cache
def quant_layer(qt13, qt2, seed=0) -> QuantExpertWeights:
    w = oai_layer(torch.float32, seed)
    return QuantExpertWeights(qt13, formats.quantize(w.w13, qt13), qt2, formats.quantize(w.w2, qt2),
                              w.b13, w.b2, w.act)


@pytest.mark.parametrize("qtypes", [("MXFP4", "MXFP4"), ("Q8_0", "MXFP4")], ids=["mxfp4", "q8_0-mxfp4"])
@pytest.mark.parametrize("T", [1, 7])
def test_native_quant_matches_oracle(qtypes, T):
    if native_skip_reason():
        pytest.skip(native_skip_reason())
    q = quant_layer(*qtypes)
    x = make_x(T, torch.bfloat16)
    tok, ids, wts = make_routes(T, 0.0, e=E, k=K)
    experts = CpuExperts([q], num_threads=2, backend="native", spin_us=100)
    if experts.backend != "native":
        pytest.skip(experts.fallback_reason)
    out = experts.forward(0, x, tok, ids, wts)
    ref = quant_reference(q, x, tok, ids, wts)
    assert rel_err(out, ref) < 1e-4
    # against bf16 activations on the dequantized weights: the int8 activations' ~1% and no more
    dq = ExpertWeights(formats.dequantize(q.w13, q.qt13, D), formats.dequantize(q.w2, q.qt2, F), q.b13, q.b2, q.act)
    exact = torch_reference(dq.w13, dq.w2, x, tok, ids, wts, h_dtype=torch.bfloat16, b13=dq.b13, b2=dq.b2, act=dq.act)
    assert rel_err(out, exact) < 3e-2
    experts.close()


def test_bias_checks():
    w = oai_layer(torch.float32)
    with pytest.raises(ConfigError, match="b13 and b2 go together"):
        CpuExperts([w._replace(b2=None)], num_threads=1, backend="torch")
    with pytest.raises(ConfigError, match=r"b2 must be a float tensor \[8, 256\]"):
        CpuExperts([w._replace(b2=w.b2[:, :10])], num_threads=1, backend="torch")
    with pytest.raises(ValueError, match="positive limit"):
        ExpertAct("clamped_swiglu", 1.0, 0.0)


def test_bf16_biases_are_copied_to_fp32_once():
    if native_skip_reason():
        pytest.skip(native_skip_reason())
    w = oai_layer(torch.bfloat16)
    w = w._replace(b13=w.b13.bfloat16(), b2=w.b2.bfloat16())
    experts = CpuExperts([w], num_threads=1, backend="native")
    held = experts.layers[0]
    assert held.b13.dtype == torch.float32 and held.w13 is w.w13  # weights in place, biases copied
    x = make_x(3, torch.bfloat16)
    tok, ids, wts = make_routes(3, 0.0, e=E, k=K)
    ref = torch_reference(w.w13, w.w2, x, tok, ids, wts, b13=w.b13, b2=w.b2, act=w.act)
    assert rel_err(experts.forward(0, x, tok, ids, wts), ref) < 1e-4


def slot_pool(w: ExpertWeights, zero_lo: int):
    """The layer's experts as pool slots [0, E) with K zero slots after them, biases beside."""
    pad = lambda t: torch.cat([t, torch.zeros(K, *t.shape[1:], dtype=t.dtype)])  # noqa: E731
    return pad(w.w13), pad(w.w2), pad(w.b13.float()), pad(w.b2.float())


@pytest.mark.parametrize("quant", [False, True], ids=["float", "mxfp4"])
def test_slot_torch_path_matches_cpu_oracle(quant):
    """The GPU branch's plain-torch path (its oracle) with biases and the act: cold routes read
    zero slots, whose biases must not leak in."""
    T = 7
    w = oai_layer(torch.float32)
    x = make_x(T, torch.float32)
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    wts = torch.rand(T, K, generator=g)
    slots = ids.clone().int()
    slots[0, 1] = E + 1  # a cold route: the zero slot of its position
    slots[3, 0] = E
    tok = torch.arange(T)[:, None].expand(T, K)
    hot = slots < E
    if quant:
        q = QuantExpertWeights("MXFP4", formats.quantize(w.w13, "MXFP4"), "MXFP4", formats.quantize(w.w2, "MXFP4"))
        w13p, w2p, b13p, b2p = slot_pool(w._replace(w13=q.w13, w2=q.w2), E)
        out = gq.slot_experts_quant_forward(x, slots, wts, w13p, w2p, E, E + K, qtypes=("MXFP4", "MXFP4"),
                                            out_dtype=torch.float32, b13_pool=b13p, b2_pool=b2p, act=w.act)
        dq = (formats.dequantize(q.w13, "MXFP4", D), formats.dequantize(q.w2, "MXFP4", F))
        ref = torch_reference(*dq, x, tok[hot], ids[hot], wts[hot], b13=w.b13, b2=w.b2, act=w.act)
    else:
        w13p, w2p, b13p, b2p = slot_pool(w, E)
        out = ge.slot_experts_forward(x, slots, wts, w13p, w2p, E, E + K, out_dtype=torch.float32,
                                      b13_pool=b13p, b2_pool=b2p, act=w.act)
        ref = torch_reference(w.w13, w.w2, x, tok[hot], ids[hot], wts[hot], b13=w.b13, b2=w.b2, act=w.act)
    assert rel_err(out, ref) < 1e-5
    assert F_.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.999
