"""Dense linear weights kept in their GGUF blocks (layers/quant_linear.py, kernels/triton/quant_linear.py).

Oracle: nn.Linear's arithmetic on the weight dequantized by formats.dequantize (itself bitwise
gguf.quants', test_quant_formats.py). On the CPU the kept blocks compute exactly what the
dequantized-at-load weights compute; the matvec kernel runs under the Triton interpreter where
triton is importable, and on CUDA (marked gpu) inside a captured graph and in the whole engine.

Legend: T tokens, N output features, n input features.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ostinato.config import ModelConfig
from ostinato.engine.runner import ModelRunner, RunnerSettings
from ostinato.engine.sizes import dense_dequant_bytes, dense_parts, dense_weight_bytes
from ostinato.layers import quant_linear as ql
from ostinato.layers.moe.gpu_quant import QUANT_QTYPES
from ostinato.loader.build import WeightFormats, build_model, dense_formats, weight_formats
from ostinato.loader.gguf import GGUFSource, gguf_name
from ostinato.loader.source import CheckpointSource
from ostinato.models.common import FusedProjections
from ostinato.models.registry import new_model
from ostinato.planner.capacity import CapacitySettings, plan_capacity
from ostinato.quant import formats
from ostinato.synth.build import write_checkpoint
from ostinato.synth.gguf_writer import tensor_qtype, write_gguf
from ostinato.synth.presets import preset_config
from tests.triton_interpreter import capture, needs_cuda, run_interpreted


def blocks(N: int, n: int, qtype: str, seed: int) -> torch.Tensor:
    """uint8 [N, row_bytes]: Gaussian weights quantized (so every scale is sane)."""
    w = torch.randn(N, n, generator=torch.Generator().manual_seed(seed)) / n**0.5
    return formats.quantize(w, qtype)


def oracle(x: torch.Tensor, q: torch.Tensor, qtype: str, bias=None) -> torch.Tensor:
    return F.linear(x.float(), formats.dequantize(q, qtype, x.shape[-1]), None if bias is None else bias.float())


@pytest.fixture(scope="module")
def tinyk(tmp_path_factory, _isolated_cache):
    """tiny-k's checkpoint and its Q4_K_M file: attention q/k/o in Q4_K, v in Q4_K on layer 0 and Q6_K on
    layer 1 (llama.cpp's use_more_bits), head Q6_K, norms and routers F32."""
    ckpt = write_checkpoint("tiny-k", tmp_path_factory.mktemp("tinyk"))
    return ckpt, write_gguf(CheckpointSource(ckpt), tmp_path_factory.mktemp("gguf") / "tiny-k-Q4_K_M.gguf",
                            "Q4_K_M", device="cpu")


@pytest.fixture(scope="module")
def tinyk_file(tinyk):
    return tinyk[1]


@pytest.mark.parametrize("qtype", QUANT_QTYPES)
@pytest.mark.parametrize("T", [1, 7, 64])
def test_cpu_forward_is_the_dequantized_linear(qtype, T):
    n = 512
    q, bias = blocks(48, n, qtype, seed=T), torch.randn(48)
    layer = ql.QuantLinear(n, 48, qtype, bias=True, bias_dtype=torch.float32)
    layer.qweight.copy_(q)
    layer.bias.data.copy_(bias)
    x = torch.randn(2, T, n)
    assert torch.equal(layer(x), F.linear(x, formats.dequantize(q, qtype, n), bias))


def test_large_weights_are_dequantized_rows_at_a_time(monkeypatch):
    """Above DEQUANT_BYTES a pass holds a few rows dequantized at once; each output column is the
    same dot product as the whole weight's, a chunk ending short included."""
    n, N = 256, 50
    q, bias = blocks(N, n, "Q4_K", seed=1), torch.randn(N)
    x = torch.randn(9, n)
    whole = ql.quant_linear(x, q, "Q4_K", n, bias)
    monkeypatch.setattr(ql, "DEQUANT_BYTES", 7 * n * 4)  # 7 rows of fp32 a chunk: 8 chunks, the last of 1
    seen = []
    real = ql.dequantized
    monkeypatch.setattr(ql, "dequantized", lambda w, *a: seen.append(w.shape[0]) or real(w, *a))
    chunked = ql.quant_linear(x, q, "Q4_K", n, bias)
    assert seen == [7] * 7 + [1]
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


def test_keep_quantized_swaps_the_named_linears():
    model = nn.Sequential(nn.Linear(256, 8, bias=True), nn.ReLU(), nn.Linear(8, 4))
    ql.keep_quantized_(model, {"0.weight": "Q8_0"})
    assert isinstance(model[0], ql.QuantLinear) and isinstance(model[2], nn.Linear)
    assert model[0].qweight.shape == (8, formats.row_bytes("Q8_0", 256)) and model[0].bias.shape == (8,)
    assert ql.quantized_bytes(model) == 8 * formats.row_bytes("Q8_0", 256)
    with pytest.raises(TypeError, match="not an nn.Linear"):
        ql.keep_quantized_(model, {"1.weight": "Q8_0"})


def test_fused_projections_of_blocks():
    """q, k, v of one format concatenate their rows (whole blocks) into one weight the modules view;
    formats that differ (Q4_K_M's Q6_K v on some layers) stay three linears."""
    n = 256
    mods = [ql.QuantLinear(n, N, "Q4_K") for N in (32, 16, 16)]
    for i, m in enumerate(mods):
        m.qweight.copy_(blocks(m.out_features, n, "Q4_K", seed=i))
    x = torch.randn(3, n)
    want = [m(x) for m in mods]
    fused = FusedProjections.of(*mods)
    assert fused is not None and all(m.qweight.data_ptr() == fused.weight[at:].data_ptr()
                                     for m, at in zip(mods, (0, 32, 48)))
    for got, w in zip(fused(x), want):
        assert torch.equal(got, w)
    assert FusedProjections.of(*mods[:2], ql.QuantLinear(n, 16, "Q6_K")) is None
    assert FusedProjections.of(mods[0], nn.Linear(n, 16, bias=False)) is None


def test_dense_formats_of_a_q4_k_m_file(tinyk):
    ckpt, path = tinyk
    src = GGUFSource(path)
    got = dense_formats(src)
    want = {"lm_head.weight": "Q6_K"}
    for i in range(src.config.num_hidden_layers):
        for p in ("q", "k", "v", "o"):
            want[f"model.layers.{i}.self_attn.{p}_proj.weight"] = "Q6_K" if (i, p) == (1, "v") else "Q4_K"
    assert got == want  # the routers stay F32 in the file, so float here
    assert dense_formats(src, "bf16") == {}
    assert dense_formats(CheckpointSource(ckpt)) == {}  # a checkpoint's weights are float
    assert weight_formats(src).dense == got and weight_formats(src, "bf16") == WeightFormats({l: None for l in
                                                                                          src.config.moe_layers}, {})


def test_kept_blocks_compute_what_dequantized_weights_compute(tinyk_file):
    """On the CPU in fp32 a model whose attention and head keep their blocks gives the logits of the
    same file dequantized at load, bit for bit (the same fp32 values into the same GEMMs), with the
    q/k/v fusion where formats agree and three linears where they do not."""
    settings = RunnerSettings(device="cpu", dtype="fp32", max_context=64)
    src = GGUFSource(tinyk_file)
    plain = ModelRunner(src, settings)
    kept = ModelRunner(src, settings, quantized=dense_formats(src))
    attn = [layer.self_attn for layer in kept.model.model.layers]
    assert all(isinstance(a.q_proj, ql.QuantLinear) for a in attn) and isinstance(kept.model.lm_head, ql.QuantLinear)
    assert attn[0].qkv is not None and attn[1].qkv is None  # layer 1's v is Q6_K
    ids = list(range(300, 324))
    assert torch.equal(kept.forward(ids, 0, all_logits=True), plain.forward(ids, 0, all_logits=True))
    assert torch.equal(kept.forward([5], 24), plain.forward([5], 24))


def test_layers_split_over_devices_keep_their_blocks(tinyk_file):
    """A model split over devices (here "cpu:0,cpu:1", engine/devices.py) is built with its blocks and
    moved layer by layer: the same logits as on one device, each layer's QuantLinear where its layer runs."""
    settings = RunnerSettings(device="cpu", dtype="fp32", max_context=64, cuda_graph=False)
    src = GGUFSource(tinyk_file)
    one = ModelRunner(src, settings, quantized=dense_formats(src))
    two = ModelRunner(src, dataclasses.replace(settings, devices="cpu:0,cpu:1"), quantized=dense_formats(src))
    assert two.layer_devices is not None and isinstance(two.model.lm_head, ql.QuantLinear)
    ids = list(range(300, 324))
    a, b = one.forward(ids, 0, all_logits=True), two.forward(ids, 0, all_logits=True)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_capacity_counts_the_blocks(tinyk_file):
    """The dense weights cost their blocks' bytes in the capacity test, which leaves that much more to
    the pool; per layer too (the split assignment's counts)."""
    src = GGUFSource(tinyk_file)
    cfg, dense = src.config, dense_formats(src)
    bf = torch.bfloat16
    model = build_model(src, "cpu", bf, dense)
    blocks_bytes = ql.quantized_bytes(model)
    floats = sum(model.get_submodule(n.removesuffix(".weight")).out_features
                 * model.get_submodule(n.removesuffix(".weight")).in_features * 2 for n in dense)
    assert dense_weight_bytes(cfg, bf) - dense_weight_bytes(cfg, bf, dense) == floats - blocks_bytes
    layers_f, embed_f, head_f = dense_parts(cfg, bf)
    layers_q, embed_q, head_q = dense_parts(cfg, bf, dense)
    assert embed_f == embed_q and sum(layers_f) + head_f - sum(layers_q) - head_q == floats - blocks_bytes
    counts = {l: torch.ones(cfg.num_experts) for l in cfg.moe_layers}
    cap, s = 48 * 2**20, CapacitySettings(margin_bytes=0, margin_fraction=0.0)
    # 256-token passes: the experts' dequantized path (off by default) holds no scratch, the dense weights' does
    a = plan_capacity(cfg, counts, cap, 256, bf, s, formats=WeightFormats(weight_formats(src).experts))
    b = plan_capacity(cfg, counts, cap, 256, bf, s, formats=weight_formats(src))
    assert a.dense_weights - b.dense_weights == floats - blocks_bytes
    assert a.activation_parts["dequant_scratch"] == 0
    # the head, V x D in bf16, is the largest weight (q, k and v together: (4 + 2 + 2) heads x 32 x D)
    assert b.activation_parts["dequant_scratch"] == dense_dequant_bytes(cfg, bf, dense) == 4096 * 256 * 2
    # tiny's scratch (its head) outweighs what its blocks save; a real model's does not (below)
    assert b.fixed - a.fixed == b.activations - a.activations - (floats - blocks_bytes)


class RecipeSource:
    """A config and the types llama.cpp's Q4_K_M gives its dense tensors, without a file."""

    def __init__(self, cfg):
        self.config, self._model = cfg, new_model(cfg)

    def dense_qtype(self, name: str) -> str:
        return tensor_qtype("Q4_K_M", gguf_name(name), tuple(self._model.get_parameter(name).shape), self.config)


@pytest.mark.parametrize("preset,layers,floats,kept", [("qwen3-235b-a22b", 32, 5.842, 1.837),
                                                        ("qwen3-30b-a3b", 48, 2.460, 0.797)])
def test_q4_k_m_dense_weights_at_real_shapes(preset, layers, floats, kept):
    """What keeping the blocks frees under a cap: 4.0 GB on the 235B shape of session 18's runs
    (32 layers), 1.66 GB on Qwen3-30B-A3B, for a dequantized scratch of at most 64 MiB."""
    cfg = ModelConfig.from_dict(preset_config(preset, layers))
    dense = dense_formats(RecipeSource(cfg))
    bf = torch.bfloat16
    assert dense_weight_bytes(cfg, bf) / 1e9 == pytest.approx(floats, abs=1e-3)
    assert dense_weight_bytes(cfg, bf, dense) / 1e9 == pytest.approx(kept, abs=1e-3)
    assert dense_dequant_bytes(cfg, bf, dense) == ql.DEQUANT_BYTES


MATVEC_SCRIPT = """
    import torch
    import torch.nn.functional as F
    from ostinato.kernels.triton.quant_linear import matvec
    from ostinato.quant import formats
    from test_quant_linear import blocks
    # N not a multiple of BLOCK_N, several group steps, a bias and none, bf16 and fp32 activations
    for qtype, n in (("Q4_K", 512), ("Q5_K", 256), ("Q6_K", 512), ("Q8_0", 160), ("MXFP4", 96)):
        q = blocks(37, n, qtype, seed=n)
        bias = torch.randn(37)
        w = formats.dequantize(q, qtype, n)
        for dtype, T, b in ((torch.float32, 3, bias), (torch.bfloat16, 1, None)):
            x = torch.randn(T, n).to(dtype)
            cfg = {"BLOCK_N": 8, "GROUPS": 2, "num_warps": 1, "num_stages": 1}
            got = matvec(x, q, qtype, b, cfg).float()
            want = F.linear(x.float(), w, b)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    print("INTERPRETER_OK")
"""


def test_matvec_kernel_interpreted():
    pytest.importorskip("triton")
    run_interpreted(MATVEC_SCRIPT, timeout=600)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("qtype", QUANT_QTYPES)
def test_cuda_paths_and_graph_replay(qtype):
    """CUDA: the matvec (T <= dense_matvec_max_tokens; captured and replayed) and the dequantized GEMM
    (larger T) against the oracle, at Qwen3-30B-A3B's fused q/k/v and at its head (151936 rows: more
    than a grid's second axis holds, and dequantized in chunks), random blocks with sane scales."""
    from tests.test_moe_quant_triton import random_rows

    n, g = 2048, torch.Generator().manual_seed(3)
    for N, tokens in ((4096 + 512 + 512, (1, 3, 7, 300)), (151936, (1, 40))):
        q = random_rows((N,), n, qtype, g).cuda()
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        for T in tokens:
            x = torch.randn(T, n, device="cuda", dtype=torch.bfloat16)
            got = ql.quant_linear(x, q, qtype, n, bias).float()
            want = oracle(x, q, qtype, bias)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    x = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
    out = {}
    graph = capture(lambda: out.__setitem__("y", ql.quant_linear(x, q, qtype, n, bias)))
    x.copy_(torch.randn(1, n, device="cuda"))
    graph.replay()
    assert torch.equal(out["y"], ql.quant_linear(x, q, qtype, n, bias))


@pytest.mark.gpu
@needs_cuda
def test_engine_on_cuda_keeps_the_dense_blocks(tinyk_file):
    """load_engine on CUDA keeps attention and head in blocks (fewer dense bytes on the GPU than the
    same file dequantized) and decodes through the graph the greedy tokens of the dequantized
    engine wherever its top two logits stand apart (elsewhere rounding may pick either)."""
    from ostinato.engine.placement import PlacementSettings
    from ostinato.engine.sampling import SamplingParams
    from ostinato.load import load_engine, startup_summary

    settings = RunnerSettings(device="cuda", dtype="bf16", max_context=512)
    kept = load_engine(str(tinyk_file), settings, announce=False)
    assert isinstance(kept.runner.model.lm_head, ql.QuantLinear)
    plain = load_engine(str(tinyk_file), settings, PlacementSettings(experts="bf16"), announce=False)
    assert isinstance(plain.runner.model.lm_head, nn.Linear)
    prompt = kept.tokenizer.render_ids([{"role": "user", "content": "check order #W2378156"}])
    a = kept.runner.forward(prompt, 0)
    b = plain.runner.forward(prompt, 0)
    assert ((a - b).abs().max() / b.abs().max()).item() < 0.05
    ids = list(kept.engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    checked = 0
    for i in range(len(ids)):  # the dequantized engine's next token on the kept one's sequence
        top = plain.runner.forward(prompt + ids[:i], 0).topk(2)
        if (top.values[0] - top.values[1]).item() > 0.05 * top.values[0].abs().item():
            assert ids[i] == top.indices[0].item(), i
            checked += 1
    assert checked >= 3, "too few steps with a clear greedy choice to compare"  # 5 of 8 on the CPU
    a, b = startup_summary(kept)["dense_weights"], startup_summary(plain)["dense_weights"]
    assert a["blocks"] == {"Q4_K": 7, "Q6_K": 2} and b["blocks"] == {} and a["bytes"] < b["bytes"]


def test_start_up_summary_says_what_stays_in_blocks():
    from ostinato.load import _dense_text

    assert _dense_text({"bytes": 1_836_716_032, "blocks": {"Q6_K": 17, "Q4_K": 112}}) == \
        "  dense weights: 1.84 GB on the GPU, 129 linear weights in their blocks (Q4_K x112, Q6_K x17)"
    assert _dense_text({"bytes": 5_842_165_760, "blocks": {}}) == "  dense weights: 5.84 GB on the GPU"
