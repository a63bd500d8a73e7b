"""Oracle tests of the quantized CPU experts (GGUF blocks read in place by the VNNI kernels).

Legend: T tokens, K experts per token, E experts, D hidden, F expert FFN size.

The oracle: the blocks dequantized by gguf.quants.dequantize, then fp32 torch math, with the
activations quantized as the kernels define it (per 32 values to int8, ostinato/kernels/cpu/
experts.h; written out again below) and h rounded to bf16 before its quantization.
The kernels and the oracle then differ only in fp32 summation order, and that difference
can move a value of h across a rounding boundary (bf16 or int8), which shifts that route's
output by one int8 step (~1e-3 of it). So:
- exact tests use blocks whose scales are powers of two, x on a grid of 2^-6 with one 127 in
  every 32-block and gate rows >= 0 (so gate > 17 and silu(gate) = gate in fp32): every
  gate/up sum is exact in fp32 whichever the order, h is bit-identical, and the outputs
  agree to 1e-5 (only the down projection's final fp32 rounding differs);
- random tests (any fp16 scale, mins, signs) bound the difference at 1e-3, far below what a
  wrong scale, layout or rounding rule gives (>= 1e-2), and check that the int8 activations
  cost under 3% against unquantized ones.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as nnf
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ostinato.config import ConfigError
from ostinato.kernels.cpu import build
from ostinato.layers.moe import cpu_experts as ce_mod
from ostinato.layers.moe.cpu_experts import CpuExperts, quantize_activations
from ostinato.layers.moe.graph_worker import GraphHandshake, GraphWorker
from ostinato.layers.moe.types import QuantExpertWeights
from ostinato.quant import formats
from tests.test_graph_worker import FakeGpu

E, K = 8, 4
# (qt13, qt2, D, F): D and F give full and partial 2- and 4-block steps for Q8_0 and MXFP4.
LAYERS = {
    "Q4_K": ("Q4_K", "Q4_K", 256, 256),
    "Q5_K": ("Q5_K", "Q5_K", 256, 256),
    "Q6_K": ("Q6_K", "Q6_K", 256, 256),
    "Q8_0": ("Q8_0", "Q8_0", 224, 160),
    "MXFP4": ("MXFP4", "MXFP4", 224, 160),
    "Q4_K/Q6_K": ("Q4_K", "Q6_K", 256, 256),
}
TOKENS = [1, 7, 64]
EXACT_TOL = 1e-5
RANDOM_TOL = 1e-3


@pytest.fixture(scope="module")
def native():
    ext = build.load_cpu_extension()
    if ext is None:
        pytest.skip(f"native CPU extension unavailable: {build.load_error()}")
    if not ext.cpu_features()["avx512_vnni"]:
        pytest.skip("this CPU lacks AVX512_VNNI; quantized experts use the torch backend")
    return ext


# ---- test data ------------------------------------------------------------------------


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.half().unsqueeze(-1).view(torch.uint8)


def _pow2(shape, g, lo=-7, hi=-6) -> torch.Tensor:
    return torch.exp2(torch.randint(lo, hi + 1, shape, generator=g).float())


def random_rows(qt: str, rows: int, n: int, g: torch.Generator, exact: bool, positive: bool) -> torch.Tensor:
    """uint8 [rows, row_bytes(qt, n)] of random blocks. exact: power-of-two scales and small
    integer multipliers, so that every dot with grid activations is exact in fp32;
    positive: every dequantized value >= 0 (gate rows of the exact tests)."""
    nb, B = n // formats.block_size(qt), formats.block_bytes(qt)
    b = torch.randint(0, 256, (rows, nb, B), dtype=torch.uint8, generator=g)
    shape = (rows, nb)

    def scale(lo, hi):
        return _pow2(shape, g) if exact else lo + (hi - lo) * torch.rand(shape, generator=g)

    if qt == "Q8_0":
        b[..., 0:2] = _fp16_bytes(scale(1e-3, 1e-2))
        if positive:
            b[..., 2:] &= 0x7F
    elif qt in ("Q4_K", "Q5_K"):
        b[..., 0:2] = _fp16_bytes(scale(1e-3, 4e-3))
        b[..., 2:4] = _fp16_bytes(scale(1e-3, 4e-3))
        if exact:  # 6-bit scales and mins <= 7 (their high bits 0)
            b[..., 4:12] &= 0x07
            b[..., 12:16] &= 0x77
        if positive:  # mins 0, scales >= 4
            b[..., 4:8] |= 0x04
            b[..., 8:12] = 0
            b[..., 12:16] = (b[..., 12:16] & 0x07) | 0x04
    elif qt == "Q6_K":
        b[..., 208:210] = _fp16_bytes(scale(1e-3, 4e-3))
        if exact:
            sc = torch.randint(1 if positive else -7, 8, (rows, nb, 16), generator=g, dtype=torch.int8)
            b[..., 192:208] = sc.view(torch.uint8)
        if positive:  # q >= 32: the high bit of every 2-bit qh pair
            b[..., 128:192] |= 0xAA
    elif qt == "MXFP4":
        lo, hi = (126, 127) if exact else (118, 126)
        b[..., 0] = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.uint8)
        if positive:  # no sign bits
            b[..., 1:] &= 0x77
    return b.view(rows, -1)


def make_layer(name: str, exact: bool, seed=0, e=E) -> QuantExpertWeights:
    qt13, qt2, D, F = LAYERS[name]
    g = torch.Generator().manual_seed(seed)
    gate = random_rows(qt13, e * F, D, g, exact, positive=exact).view(e, F, -1)
    up = random_rows(qt13, e * F, D, g, exact, positive=False).view(e, F, -1)
    w2 = random_rows(qt2, e * D, F, g, exact, positive=False).view(e, D, -1)
    return QuantExpertWeights(qt13, torch.cat([gate, up], 1).contiguous(), qt2, w2)


def make_x(T: int, D: int, exact: bool, seed=2, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if not exact:
        return torch.randn(T, D, generator=g).to(dtype)
    k = torch.randint(32, 128, (T, D // 32, 32), generator=g)
    k[:, :, 0] = 127  # every block's amax is 127 * 2^-6: d = 2^-6, q = k, both exact
    k = k.gather(2, torch.argsort(torch.rand(T, D // 32, 32, generator=g), 2))
    return (k.float() / 64).reshape(T, D).to(dtype)


def make_routes(T, e=E, k=K, seed=1):
    g = torch.Generator().manual_seed(seed)
    w, ids = torch.topk(torch.randn(T, e, generator=g).softmax(-1), k)
    tok = torch.arange(T)[:, None].expand(T, k).reshape(-1)
    return tok.int(), ids.reshape(-1).int(), (w / w.sum(-1, keepdim=True)).reshape(-1).float()


# ---- the oracle -----------------------------------------------------------------------


def gguf_rows(qt: str, b: torch.Tensor, n: int) -> torch.Tensor:
    out = gguf_dequantize(b.reshape(-1, b.shape[-1]).numpy(), GGMLQuantizationType[qt])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(*b.shape[:-1], n)


def q8(v: torch.Tensor) -> torch.Tensor:
    """v as the kernels see it: per 32 values, d = amax / 127, q = round(v * (127 / amax))."""
    blocks = v.reshape(*v.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    live = amax >= 2.0**-96
    inv = torch.where(live, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    d = torch.where(live, amax / 127.0, torch.zeros_like(amax))
    return (torch.round(blocks * inv).clamp(-127, 127) * d).reshape(v.shape)


def oracle(w: QuantExpertWeights, x, tok, ids, wts, quantize_acts=True, bf16_weights=False):
    """(out [T, D], the smallest gate value). bf16_weights: the dequantized weights rounded to
    bf16 (as the AMX path decodes them), activations then unquantized."""
    D, F = w.hidden, w.ffn
    w13, w2 = gguf_rows(w.qt13, w.w13, D), gguf_rows(w.qt2, w.w2, F)
    if bf16_weights:
        w13, w2, quantize_acts = w13.bfloat16().float(), w2.bfloat16().float(), False
    act = q8 if quantize_acts else (lambda v: v)
    xq = act(x.float())
    out = torch.zeros(x.shape[0], D)
    gmin = float("inf")
    for e in torch.unique(ids).tolist():
        sel = (ids == e).nonzero().squeeze(1)
        t = tok[sel].long()
        gu = xq[t] @ w13[e].T
        gmin = min(gmin, gu[:, :F].min().item())
        h = act((nnf.silu(gu[:, :F]) * gu[:, F:]).bfloat16().float())
        out.index_add_(0, t, (h @ w2[e].T) * wts[sel, None])
    return out, gmin


def rel_err(got, ref) -> float:
    return ((got - ref).norm() / ref.norm()).item()


# ---- tests ----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.sampled_from([32, 64, 160]),
              elements=st.floats(-2.0**100, 2.0**100, width=32, allow_nan=False, allow_subnormal=True)),
       st.sampled_from([1.0, 1e-3, 1e-20, 1e-35]))
def test_activation_quantization_is_bit_identical(native, v, scale):
    """The native quantizer, the torch one and the definition above agree bit for bit,
    also on zeros, ties, tiny and huge blocks."""
    x = torch.from_numpy(v) * scale
    x[:8] = torch.tensor([0.5, -0.5, 1.5, 2.5, 0.0, -0.0, 127.0, -63.5]) * scale  # ties
    if x.numel() >= 64:
        x[32:64] = 0.0  # a zero block
    q, d = torch.empty(x.numel(), dtype=torch.int8), torch.empty(x.numel() // 32)
    native.quantize_activations(x.data_ptr(), x.numel(), q.data_ptr(), d.data_ptr())
    tq, td = quantize_activations(x)
    assert torch.equal(q, tq) and torch.equal(d, td)
    assert torch.equal((q.float().view(-1, 32) * d[:, None]).view(-1), q8(x))


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("name", list(LAYERS))
def test_exact_blocks_match_oracle(native, name, T):
    w = make_layer(name, exact=True)
    x = make_x(T, w.hidden, exact=True)
    tok, ids, wts = make_routes(T)
    experts = CpuExperts([w], num_threads=2, backend="native", spin_us=100)
    out = torch.full((T, w.hidden), float("nan"))
    experts.submit(0, x, tok, ids, wts, out)
    assert experts.wait() is out
    assert experts.last_stats()["quant"] and experts.last_stats()["isa"] == "avx512_vnni"
    ref, gmin = oracle(w, x, tok, ids, wts)
    assert gmin > 17, "test data: silu(gate) must equal gate in fp32"
    assert rel_err(out, ref) < EXACT_TOL
    experts.close()


@pytest.mark.parametrize("name", ["Q4_K/Q6_K", "MXFP4", "Q8_0"])
def test_torch_backend_matches_oracle(name):
    """The fallback (formats.dequantize + quant_reference) computes the same function."""
    w = make_layer(name, exact=True, seed=4)
    x = make_x(7, w.hidden, exact=True, seed=5)
    tok, ids, wts = make_routes(7, seed=6)
    experts = CpuExperts({3: w}, num_threads=1, backend="torch")
    out = experts.forward(3, x, tok, ids, wts)
    assert rel_err(out, oracle(w, x, tok, ids, wts)[0]) < EXACT_TOL


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("name", list(LAYERS))
def test_random_blocks_match_oracle(native, name, T):
    w = make_layer(name, exact=False, seed=7)
    x = make_x(T, w.hidden, exact=False, seed=8)
    tok, ids, wts = make_routes(T, seed=9)
    out = CpuExperts([w], num_threads=2, backend="native", spin_us=100).forward(0, x, tok, ids, wts)
    assert rel_err(out, oracle(w, x, tok, ids, wts)[0]) < RANDOM_TOL
    assert rel_err(out, oracle(w, x, tok, ids, wts, quantize_acts=False)[0]) < 3e-2


@pytest.mark.slow
def test_prefill_512_tokens_fp32_x(native):
    w = make_layer("Q4_K/Q6_K", exact=True, seed=10)
    x = make_x(512, w.hidden, exact=True, seed=11, dtype=torch.float32)
    tok, ids, wts = make_routes(512, seed=12)
    out = CpuExperts([w], num_threads=2, backend="native", spin_us=100).forward(0, x, tok, ids, wts)
    assert rel_err(out, oracle(w, x, tok, ids, wts)[0]) < EXACT_TOL


def test_threads_and_down_modes_give_identical_bits(native):
    """The pool's size sets the task sizes (with 7 workers some end inside a 32-chunk of h, which
    two tasks then share); the down mode sets whether gate/up and down share a job phase."""
    w = make_layer("Q4_K/Q6_K", exact=False, seed=13)
    x = make_x(64, w.hidden, exact=False, seed=14)
    tok, ids, wts = make_routes(64, seed=15)
    keep = torch.rand(tok.numel(), generator=torch.Generator().manual_seed(16)) < 0.5  # some routes hot
    tok, ids, wts = tok[keep], ids[keep], wts[keep]
    results = []
    for threads in (1, 2, 7):
        experts = CpuExperts([w], num_threads=threads, backend="native", spin_us=100)
        for mode in (1, 2, 1):  # direct, scatter, direct
            experts._args[0].down_mode = mode
            results.append(experts.forward(0, x, tok, ids, wts).clone())
            assert experts.last_stats()["scatter"] == (mode == 2)
        experts.close()
    for r in results[1:]:
        assert torch.equal(r, results[0])


@pytest.mark.parametrize("name", ["Q4_K/Q6_K", "Q8_0", "MXFP4"])
def test_software_prefetch_gives_identical_bits(native, name):
    """The kernels' software prefetch (ColdArgs.prefetch, prefetch_bytes: how far ahead of each
    row stream) is a tuning switch: off, or at any distance, even one reaching past the layer's
    weights (prefetches never fault), the outputs are the same bits. One token (4-row kernel
    calls) and 64 (an expert's routes several to a row pass)."""
    w = make_layer(name, exact=False, seed=22)
    experts = CpuExperts([w], num_threads=2, backend="native", spin_us=100)
    for T in (1, 64):
        x = make_x(T, w.hidden, exact=False, seed=23)
        tok, ids, wts = make_routes(T, seed=24)
        results = []
        for on, ahead in ((False, 1024), (True, 0), (True, 64), (True, 1024), (True, 1 << 20)):
            experts._args[0].prefetch, experts._args[0].prefetch_bytes = on, ahead
            results.append(experts.forward(0, x, tok, ids, wts).clone())
        for r in results[1:]:
            assert torch.equal(r, results[0])
    experts.close()


def test_duplicates_strided_x_and_empty_rows(native):
    w = make_layer("MXFP4", exact=True, seed=17)
    big = make_x(10, 2 * w.hidden, exact=True, seed=18)
    x = big[:, : w.hidden]  # rows with stride 2D
    tok = torch.tensor([0, 3, 3, 3, 9, 9])
    ids = torch.tensor([1, 2, 2, 7, 0, 1])  # token 3 routes to expert 2 twice
    wts = torch.tensor([0.5, 0.25, 0.125, 1.0, -1.0, 2.0])
    out = CpuExperts([w], num_threads=2, backend="native", spin_us=100).forward(0, x, tok, ids, wts)
    assert rel_err(out, oracle(w, x.contiguous(), tok.int(), ids.int(), wts)[0]) < EXACT_TOL
    assert torch.equal(out[1], torch.zeros(w.hidden))


def test_graph_worker_serves_quantized_layers_bitwise(native):
    """The handshake's native worker runs the same quantized kernel as CpuExperts.forward."""
    D = 256  # one hidden size for the handshake: Q4_K/Q6_K's, and an MXFP4 layer of it
    layers = {2: make_layer("Q4_K/Q6_K", exact=False, seed=19, e=6), 5: _with_hidden("MXFP4", D, seed=20)}
    cpu = CpuExperts(layers, num_threads=1, backend="native", spin_us=100)
    table = torch.tensor([0, 1, 2, 3, 4, 5, -1, -1], dtype=torch.int32)  # experts 6, 7 hot
    hs = GraphHandshake(2, K, D)
    worker = GraphWorker(hs, cpu, {2: table, 5: table}, [2, 5], spin_us=200, sleep_us=20, idle_sleep_us=500)
    gpu = FakeGpu(hs)
    g = torch.Generator().manual_seed(21)
    records = []
    worker.start(1)
    for seq in range(1, 7):
        for i, layer in enumerate((2, 5)):
            ids = torch.randperm(E, generator=g)[:K].int()
            wt = torch.rand(K, generator=g) + 0.1
            x = torch.randn(D, generator=g).bfloat16()
            out = gpu.layer(i, seq, ids, wt, x, True)
            records.append((layer, ids, wt, x, torch.from_numpy(out)))
    worker.stop()
    stats = worker.stats()
    assert stats["errors"] == 0 and stats["last_error"] == "", stats
    for layer, ids, wt, x, out in records:
        cid = table[ids.long()]
        cold = cid >= 0
        want = cpu.forward(layer, x[None], torch.zeros(int(cold.sum()), dtype=torch.int32), cid[cold], wt[cold])[0]
        assert torch.equal(out, want)


def _with_hidden(qt: str, D: int, seed: int, e=6) -> QuantExpertWeights:
    g = torch.Generator().manual_seed(seed)
    F = 160
    w13 = random_rows(qt, e * 2 * F, D, g, exact=False, positive=False).view(e, 2 * F, -1)
    w2 = random_rows(qt, e * D, F, g, exact=False, positive=False).view(e, D, -1)
    return QuantExpertWeights(qt, w13, qt, w2)


def test_float_qtypes_and_bad_layers():
    D, F = 64, 32
    w13, w2 = torch.randn(2, 2 * F, D), torch.randn(2, D, F)
    as_bytes = QuantExpertWeights("F32", w13.view(torch.uint8), "F32", w2.view(torch.uint8))
    experts = CpuExperts([as_bytes], num_threads=1, backend="torch")
    assert torch.equal(experts.layers[0].w13, w13)  # a view, not a copy
    q = make_layer("Q4_K", exact=False)
    with pytest.raises(ConfigError, match="both in block formats or both in one float type"):
        CpuExperts([QuantExpertWeights("Q4_K", q.w13, "F32", w2.view(torch.uint8))], backend="torch")
    with pytest.raises(ConfigError, match="row_bytes"):
        CpuExperts([QuantExpertWeights("Q4_K", q.w13[:, :, :-1], "Q4_K", q.w2)], backend="torch")
    with pytest.raises(ConfigError, match="unknown quantization type"):
        CpuExperts([QuantExpertWeights("Q3_K", q.w13, "Q3_K", q.w2)], backend="torch")


def test_fallback_without_vnni(monkeypatch):
    monkeypatch.setattr(ce_mod, "_native_unavailable", lambda isa: None)
    monkeypatch.setattr(ce_mod, "_quant_unavailable", lambda: "no VNNI here")
    w = make_layer("Q8_0", exact=True)
    with pytest.warns(RuntimeWarning, match="plain torch, not the native kernels: no VNNI here"):
        experts = CpuExperts([w], backend="auto")
    assert experts.backend == "torch" and experts.fallback_reason == "no VNNI here"
    with pytest.raises(RuntimeError, match="no VNNI here"):
        CpuExperts([w], backend="native")


# ---- the AMX path for quantized experts (rows decoded to bf16, dequant.h) ----------------

FORMATS = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "MXFP4"]


@pytest.fixture(scope="module")
def extension():
    ext = build.load_cpu_extension()
    if ext is None:
        pytest.skip(f"native CPU extension unavailable: {build.load_error()}")
    return ext


@pytest.mark.parametrize("avx512", [False, True], ids=["portable", "avx512"])
@pytest.mark.parametrize("qt", FORMATS)
def test_dequant_rows_bf16_is_gguf_rounded(extension, qt, avx512):
    """The AMX path's decoding is gguf's dequantize rounded to the nearest bf16, bit for bit,
    also for subnormal fp16 scales and the smallest and large MXFP4 exponents: dequant.h built
    without an ISA target (any host), and the AMX path's own build (Q4_K and Q5_K by table)."""
    if avx512 and not extension.cpu_features()["avx512"]:
        pytest.skip("this CPU lacks AVX-512")
    n, rows = 512, 24
    g = torch.Generator().manual_seed(30)
    b = random_rows(qt, rows, n, g, exact=False, positive=False).view(rows, n // formats.block_size(qt), -1)
    sub = torch.tensor([1, 0], dtype=torch.uint8)  # fp16 2^-24, the smallest subnormal
    if qt == "Q8_0":
        b[0, :, 0:2] = sub
    elif qt in ("Q4_K", "Q5_K"):
        b[0, :, 0:2] = sub
        b[1, :, 2:4] = torch.tensor([0xFF, 0x03], dtype=torch.uint8)  # the largest subnormal
    elif qt == "Q6_K":
        b[0, :, 208:210] = sub
    else:
        b[0, :, 0] = torch.tensor([0, 1, 2, 3] * 4, dtype=torch.uint8)
        b[1, :, 0] = 200
    b = b.reshape(rows, -1).contiguous()
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    extension.dequant_rows_bf16(ce_mod.QTYPE_CODES[qt], b.data_ptr(), rows, n, out.data_ptr(), avx512)
    assert torch.equal(out, gguf_rows(qt, b, n).bfloat16())


@pytest.fixture(scope="module")
def amx(native):
    if not native.cpu_features()["amx"]:
        pytest.skip("this CPU lacks AMX")
    return native


@pytest.mark.parametrize("T", [7, 64, 512])
@pytest.mark.parametrize("name", list(LAYERS))
def test_amx_quant_matches_oracle(amx, name, T):
    """Experts with at least 2 routes on the tiles (at T = 7 some have fewer and take the row
    kernels in the same call): against dequantize, bf16 weights, bf16 h, fp32 sums."""
    w = make_layer(name, exact=False, seed=31)
    x = make_x(T, w.hidden, exact=False, seed=32)
    tok, ids, wts = make_routes(T, seed=33)
    experts = CpuExperts([w], num_threads=2, backend="native", spin_us=100, amx_quant_min_tokens=2)
    for mode in (2, 1):  # scatter (the merged phase), direct
        experts._args[0].down_mode = mode
        out = experts.forward(0, x, tok, ids, wts)
        stats = experts.last_stats()
        assert stats["amx_experts"] > 0 and stats["isa"] == "amx"
        assert rel_err(out, oracle(w, x, tok, ids, wts, bf16_weights=True)[0]) < RANDOM_TOL
    experts.close()


def test_amx_quant_off_by_default(native):
    """amx_quant_min_tokens 0: every route on the row kernels, whatever the CPU."""
    w = make_layer("Q4_K/Q6_K", exact=False, seed=34)
    x = make_x(64, w.hidden, exact=False, seed=35)
    tok, ids, wts = make_routes(64, seed=36)
    experts = CpuExperts([w], num_threads=2, backend="native", spin_us=100)
    experts.forward(0, x, tok, ids, wts)
    assert experts.last_stats()["amx_experts"] == 0 and experts.last_stats()["isa"] == "avx512_vnni"
    experts.close()


def test_amx_quant_switch(monkeypatch):
    """OSTINATO_AMX_QUANT sets the engine's default (0: off); a value that is not a whole number
    of routes is refused with its name."""
    monkeypatch.delenv("OSTINATO_AMX_QUANT", raising=False)
    assert ce_mod.default_amx_quant_min_tokens() == 0
    monkeypatch.setenv("OSTINATO_AMX_QUANT", "8")
    assert ce_mod.default_amx_quant_min_tokens() == 8
    for bad in ("-1", "four", "2.5"):
        monkeypatch.setenv("OSTINATO_AMX_QUANT", bad)
        with pytest.raises(ConfigError, match="OSTINATO_AMX_QUANT"):
            ce_mod.default_amx_quant_min_tokens()
    from ostinato.bench.report import _cpu_note  # a bench report names the switch when it was on

    assert _cpu_note({"device": "cuda", "amx_quant_min_tokens": 0}) == []
    assert "at least 8 routes" in _cpu_note({"device": "cuda", "amx_quant_min_tokens": 8})[0]


@pytest.fixture(scope="module")
def amx_int8(native):
    if not native.cpu_features()["amx_int8"]:
        pytest.skip("this CPU lacks AMX-INT8")
    return native


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "random"])
@pytest.mark.parametrize("T", [7, 20, 64, 512])  # groups of 4, 8 or 12, and 16 routes an expert
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_K/Q6_K", "MXFP4", "Q8_0"])
def test_amx_int8_matches_oracle(amx_int8, name, T, exact):
    """Experts with at least 2 routes on the int8 tiles, their Q4_K / Q6_K / MXFP4 projections (Q6_K's
    gate/up and Q8_0 stay on the row kernels, in the same call), against the same oracle as the row
    kernels: per-32 quantized activations, fp32 sums. Exact blocks within EXACT_TOL: the tiles' integers
    are the row kernels', only the fp32 combination of the sub-blocks' sums runs in another order.
    MXFP4's layer (D 224, F 160) ends its rows with 3 and 1 blocks of a 4-block step."""
    w = make_layer(name, exact=exact, seed=41)
    x = make_x(T, w.hidden, exact=exact, seed=42)
    tok, ids, wts = make_routes(T, seed=43)
    experts = CpuExperts([w], num_threads=2, backend="native", spin_us=100, amx_int8_min_tokens=2)
    rows = CpuExperts([w], num_threads=2, backend="native", spin_us=100, amx_int8_min_tokens=0)
    ref = oracle(w, x, tok, ids, wts)[0]
    for mode in (2, 1):  # scatter (the merged phase), direct
        experts._args[0].down_mode = mode
        out = experts.forward(0, x, tok, ids, wts)
        stats = experts.last_stats()
        assert (stats["int8_experts"] > 0) == (name != "Q8_0") and stats["amx_experts"] == 0
        assert rel_err(out, ref) < (EXACT_TOL if exact else RANDOM_TOL)
        # random blocks: a gate/up sum one fp32 ulp apart can round h to the neighbouring bf16
        assert rel_err(out, rows.forward(0, x, tok, ids, wts)) < (EXACT_TOL if exact else 1e-4)
    experts.close()
    rows.close()


def test_amx_int8_threads_and_down_modes_give_identical_bits(amx_int8):
    """On the tiles too, no bit depends on the pool's size (the task sizes) or the down mode; and the
    tiles' rows go in aligned groups of 16 whatever a task's bounds."""
    g, e, D, F = torch.Generator().manual_seed(44), 4, 512, 768
    w = QuantExpertWeights("Q4_K", random_rows("Q4_K", e * 2 * F, D, g, exact=False, positive=False).view(e, 2 * F, -1),
                           "Q6_K", random_rows("Q6_K", e * D, F, g, exact=False, positive=False).view(e, D, -1))
    x = make_x(96, w.hidden, exact=False, seed=46)
    tok, ids, wts = make_routes(96, e=4, seed=47)
    results = []
    for threads in (1, 2, 7):
        experts = CpuExperts([w], num_threads=threads, backend="native", spin_us=100, amx_int8_min_tokens=3)
        for mode in (1, 2):
            experts._args[0].down_mode = mode
            results.append(experts.forward(0, x, tok, ids, wts).clone())
            assert experts.last_stats()["int8_experts"] == 4
        experts.close()
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_mxfp4_experts_take_the_int8_tiles_from_their_own_default(amx_int8, monkeypatch):
    """Unset, the tiles' threshold is the layer format's: an MXFP4 expert of 8 routes goes to the tiles,
    one of 5 stays on the row kernels, where a Q4_K expert of 5 would go (AMX_INT8_MIN_TOKENS_MXFP4). Its
    hidden size of 6 blocks ends gate/up's rows with a step of 2, as gpt-oss's 2880 does."""
    monkeypatch.delenv("OSTINATO_AMX_INT8", raising=False)
    w = _with_hidden("MXFP4", 192, seed=48)
    x = make_x(8, w.hidden, exact=False, seed=49)
    tok = torch.tensor(list(range(8)) + list(range(5)), dtype=torch.int32)
    ids = torch.tensor([0] * 8 + [1] * 5, dtype=torch.int32)
    experts = CpuExperts([w], num_threads=2, backend="native", spin_us=100)
    out = experts.forward(0, x, tok, ids, torch.ones(13))
    assert experts.last_stats()["int8_experts"] == 1
    assert rel_err(out, oracle(w, x, tok, ids, torch.ones(13))[0]) < RANDOM_TOL
    experts.close()


def test_amx_int8_switch(monkeypatch):
    """OSTINATO_AMX_INT8 sets the engine's default; a value that is not a whole number of routes is
    refused with its name."""
    monkeypatch.delenv("OSTINATO_AMX_INT8", raising=False)
    assert ce_mod.default_amx_int8_min_tokens() == ce_mod.AMX_INT8_MIN_TOKENS
    assert ce_mod.default_amx_int8_min_tokens("Q4_K") == ce_mod.AMX_INT8_MIN_TOKENS
    assert ce_mod.default_amx_int8_min_tokens("MXFP4") == ce_mod.AMX_INT8_MIN_TOKENS_MXFP4 == 8
    monkeypatch.setenv("OSTINATO_AMX_INT8", "0")
    assert ce_mod.default_amx_int8_min_tokens() == ce_mod.default_amx_int8_min_tokens("MXFP4") == 0
    monkeypatch.setenv("OSTINATO_AMX_INT8", "bad")
    with pytest.raises(ConfigError, match="OSTINATO_AMX_INT8"):
        ce_mod.default_amx_int8_min_tokens()
    from ostinato.bench.report import _cpu_note  # a bench report names the switch when it was on

    assert _cpu_note({"device": "cuda", "amx_int8_min_tokens": 0}) == []
    assert "at least 6 routes" in _cpu_note({"device": "cuda", "amx_int8_min_tokens": 6})[0]
