"""gpt-oss (`GptOssForCausalLM`) against transformers on the tiny synthetic checkpoints (bf16
experts, and MXFP4 experts in the Hugging Face layout), all-on-one-device and hybrid, plus
the pieces underneath: the interleaved experts with biases and the clamped SwiGLU against
transformers' GptOssExperts, the MXFP4 repack against transformers' dequantization, the
config's keys, the synthetic presets.

Legend: T tokens, E experts, K top-k, D hidden, F expert FFN size.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ostinato.config import ConfigError, ModelConfig
from ostinato.engine.placement import PlacementSettings
from ostinato.engine.residency import Residency, model_fingerprint
from ostinato.engine.runner import ModelRunner, RunnerSettings
from ostinato.layers.moe.reference import moe_forward
from ostinato.config import ExpertAct
from ostinato.layers.moe.types import ExpertWeights, TopKOutput
from ostinato.load import load_engine
from ostinato.loader import gpt_oss as layout
from ostinato.loader.source import CheckpointSource
from ostinato.sources import open_source
from ostinato.quant import formats
from ostinato.quant.mxfp4 import from_hf, to_hf
from ostinato.synth.presets import preset_config

transformers = pytest.importorskip("transformers")
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts  # noqa: E402

TOL = 1e-3  # fp32 logits against transformers, relative to the largest logit


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory, _isolated_cache):
    from ostinato.synth.build import write_checkpoint

    return write_checkpoint("tiny-gpt-oss", tmp_path_factory.mktemp("gpt-oss"))


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory, _isolated_cache):
    from ostinato.synth.build import write_checkpoint

    return write_checkpoint("tiny-gpt-oss-mxfp4", tmp_path_factory.mktemp("gpt-oss-mxfp4"))


@pytest.fixture(scope="module", params=["bf16", "mxfp4"])
def ckpt(request, bf16_dir, mxfp4_dir):
    return bf16_dir if request.param == "bf16" else mxfp4_dir


_HF: dict = {}  # path -> the transformers model, loaded once per test session


def _configured(experts: GptOssExperts, cfg) -> GptOssExperts:
    """transformers' experts with the config's clamped SwiGLU: 5.17 and 5.18 (5.17 on the GPU
    machine) fix alpha 1.702 and limit 7.0 in GptOssExperts whatever the config says (5.24 reads
    both from it), and the tiny presets' limit is 1.0: their logits would differ by ~0.2."""
    experts.alpha, experts.limit = getattr(cfg, "swiglu_alpha", 1.702), cfg.swiglu_limit
    return experts


def _load_hf(path, dtype):
    """transformers' model of the checkpoint, its experts as configured and in dtype (5.17 dequantizes
    MXFP4 experts to bf16 whatever dtype asks; the values are exact in either). MXFP4 experts are
    dequantized at load: where triton is installed, 5.25 would otherwise fetch its MXFP4 kernels from
    the Hugging Face hub, which a machine without a network cannot reach."""
    quantized = "quantization_config" in json.loads((Path(path) / "config.json").read_text())
    extra = {"quantization_config": transformers.Mxfp4Config(dequantize=True)} if quantized else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra).eval()
    for m in hf.modules():
        if isinstance(m, GptOssExperts):
            _configured(m, hf.config).to(dtype)
    return hf


def _hf(path):
    if str(path) not in _HF:
        _HF[str(path)] = _load_hf(path, torch.float32)
    return _HF[str(path)]


def _runner(path, chunk=2048):
    return ModelRunner(CheckpointSource(path), RunnerSettings(device="cpu", dtype="fp32", max_context=256,
                                                              prefill_chunk=chunk))


def _prompt(n=40, seed=0):
    return torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _greedy(step, logits, start: int, n: int) -> list[int]:
    """n greedy tokens from the prompt's last logits; step(token, position) -> next logits."""
    out = []
    for i in range(n):
        t = int(logits.argmax())
        out.append(t)
        logits = step(t, start + i)
    return out


_GREEDY: dict = {}


def _hf_greedy(hf, ids, n=16):
    """transformers' greedy continuation (cached: the tests ask for the same one)."""
    key = (id(hf), tuple(ids), n)
    if key not in _GREEDY:
        _GREEDY[key] = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(ids):].tolist()
    return _GREEDY[key]


def test_checkpoint_is_gpt_oss_as_transformers_loads_it(bf16_dir, mxfp4_dir):
    cfg = json.loads((bf16_dir / "config.json").read_text())
    assert cfg["architectures"] == ["GptOssForCausalLM"] and set(cfg["layer_types"]) == {"sliding_attention",
                                                                                       "full_attention"}
    names = set(CheckpointSource(bf16_dir).names())
    assert {"model.layers.0.self_attn.sinks", "model.layers.0.mlp.router.bias",
            "model.layers.1.mlp.experts.gate_up_proj_bias", "model.layers.1.mlp.experts.down_proj"} <= names
    mx = CheckpointSource(mxfp4_dir)
    assert mx.expert_qtypes(0) == ("MXFP4", "MXFP4") and CheckpointSource(bf16_dir).expert_qtypes(0) is None
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in mx.names()


def test_prefill_logits_match_transformers(ckpt):
    """One pass, then the same prompt in chunks of 16 (prefill after cached tokens, across the
    sliding window of 8)."""
    hf = _hf(ckpt)
    ids = _prompt(64)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert _rel(_runner(ckpt).forward(ids, 0, all_logits=True), ref) < TOL
    assert _rel(_runner(ckpt, chunk=16).forward(ids, 0, all_logits=True), ref) < TOL
    r = _runner(ckpt)
    r.forward(ids[:37], 0)
    assert _rel(r.forward(ids[37:], 37, all_logits=True), ref[37:]) < TOL


def test_greedy_decode_and_decode_window_match_transformers(ckpt):
    """16 greedy steps through the eager path and through DecodeWindow (the captured step's
    computation: the position only on the device) give transformers' tokens; their logits agree."""
    hf = _hf(ckpt)
    ids = _prompt(30, seed=1)
    want = _hf_greedy(hf, ids)
    r = _runner(ckpt)
    first = r.forward(ids, 0)
    assert _greedy(lambda t, p: r.forward([t], p), first, len(ids), 16) == want
    w = _runner(ckpt)
    w.forward(ids, 0)
    steps = []
    got = _greedy(lambda t, p: steps.append(w.decode_windowed(t, p)) or steps[-1], first, len(ids), 16)
    assert got == want
    with torch.no_grad():
        ref = hf(torch.tensor([ids + want])).logits[0, len(ids):]
    assert _rel(torch.stack(steps[:-1]), ref[:-1]) < TOL


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_windowed_pass_matches_prefill(bf16_dir, device):
    """Short prefill passes through a window of B rows, the first position on the device (the
    computation PassGraphs captures; on CUDA the full layers' split-K kernel with the sinks), fp32:
    the real rows' logits and the cache rows they write equal the host-driven prefill's, where the
    sliding window (8 rows) reaches before position 0 and where it lies inside; the padding rows
    past n change no real row."""
    from tests.test_graph import windowed_passes_vs_prefill

    windowed_passes_vs_prefill(bf16_dir, device)


@pytest.mark.gpu
@pytest.mark.parametrize("cold", [0.0, 0.5], ids=["all-resident", "half-cold"])
def test_pass_graphs_match_host_driven_passes(bf16_dir, tmp_path, cold):
    """Short prefill passes replayed as captured graphs (full layers through the split-K kernel with
    the sinks, sliding layers' gathered rows) against an engine's host-driven passes, bf16
    (tests/test_graph.py's test of the tiny Qwen3)."""
    from tests.test_graph import pass_graphs_vs_host_driven

    pass_graphs_vs_host_driven(bf16_dir, tmp_path, cold)


def _residency_path(source, tmp_path, fraction=0.5):
    cfg = source.config
    g = torch.Generator().manual_seed(0)
    hot = {l: torch.randperm(cfg.num_experts, generator=g)[:round(fraction * cfg.num_experts)].tolist()
           for l in cfg.moe_layers}
    Residency(model_fingerprint(source), cfg.num_experts, hot).save(tmp_path / "r.json")
    return str(tmp_path / "r.json")


@pytest.mark.parametrize("threshold", [10**9, 16], ids=["split", "upload"])
def test_hybrid_matches_transformers(ckpt, tmp_path, threshold):
    """Half the experts in the pool (CPU device here: the slot kernels' torch path), the rest on
    the CPU branch's native kernels, biases and the clamped SwiGLU in both; the upload path too.
    MXFP4: the CPU branch's int8 activations cost ~1e-3 of the logits, and the tokens hold."""
    settings = RunnerSettings(device="cpu", dtype="fp32", max_context=256, prefill_chunk=64)
    place = PlacementSettings(residency=_residency_path(open_source(str(ckpt)), tmp_path), upload_threshold=threshold)
    hyb = load_engine(str(ckpt), settings, place).runner
    hf = _hf(ckpt)
    ids = _prompt(30, seed=1)  # > 16 tokens: the upload path's prefill
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = hyb.forward(ids, 0, all_logits=True)
    mx = ckpt.name.startswith("gpt-oss-mxfp4")
    assert _rel(got, ref) < (1e-2 if mx and threshold > 64 else TOL)
    if threshold > 64:  # decode never uploads: its steps are the split path's
        assert _greedy(lambda t, p: hyb.forward([t], p), got[-1], len(ids), 16) == _hf_greedy(hf, ids)
    stats = hyb.placement_stats()
    assert stats["cold_routes"] > 0
    split = threshold > 64
    assert (stats.get("cpu_experts", 0) > 0) == split and (stats.get("uploaded_experts", 0) > 0) == (not split)


def test_experts_match_transformers_gpt_oss_experts():
    """The de-interleaved layout, the biases and the clamped SwiGLU against transformers'
    GptOssExperts on random parameters whose gate / up values cross the limit often."""
    E, K, D, F, T = 6, 2, 64, 32, 9
    cfg = transformers.GptOssConfig(num_local_experts=E, hidden_size=D, intermediate_size=F, swiglu_limit=0.8)
    hf = _configured(GptOssExperts(cfg), cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p, std in ((hf.gate_up_proj, 0.3), (hf.gate_up_proj_bias, 0.5), (hf.down_proj, 0.2),
                       (hf.down_proj_bias, 0.5)):
            p.copy_(torch.randn(p.shape, generator=g) * std)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).softmax(-1)
    with torch.no_grad():
        ref = hf(x, ids, w)
        gu = torch.einsum("td,edf->tef", x, hf.gate_up_proj) + hf.gate_up_proj_bias
        assert (gu[..., 0::2] > 0.8).float().mean() > 0.1  # the gate clamp acts
    read = {"model.layers.0.mlp.experts." + n: t.detach() for n, t in
            (("gate_up_proj", hf.gate_up_proj), ("gate_up_proj_bias", hf.gate_up_proj_bias),
             ("down_proj", hf.down_proj), ("down_proj_bias", hf.down_proj_bias))}
    mine = ExpertWeights(torch.empty(E, 2 * F, D), torch.empty(E, D, F), torch.empty(E, 2 * F), torch.empty(E, D),
                         ExpertAct("clamped_swiglu", hf.alpha, hf.limit))
    reader = lambda name, e: read[name] if e is None else read[name][e]  # noqa: E731
    layout.load_float_(reader, set(read), 0, mine.w13, mine.w2)
    layout.load_biases_(reader, 0, mine.b13, mine.b2)
    got = moe_forward(x, TopKOutput(ids, w), mine)
    assert _rel(got, ref) < 1e-5


def test_mxfp4_repack_is_transformers_dequantization():
    """from_hf keeps every bit: GGUF blocks of Hugging Face's blocks dequantize to what
    transformers makes of them, and to_hf gives the bytes back."""
    g = torch.Generator().manual_seed(1)
    rows, G = 12, 5
    blocks = torch.randint(0, 256, (2, rows, G, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 135, (2, rows, G), generator=g, dtype=torch.uint8)
    scales[0, 0, 0] = 0  # the smallest E8M0 exponents too
    scales[0, 0, 1] = 1
    ours = formats.dequantize(from_hf(blocks, scales), "MXFP4", 32 * G)  # [2, rows, 32 G]
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [2, 32 G, rows]
    assert torch.equal(ours, ref.transpose(1, 2))
    b2, s2 = to_hf(from_hf(blocks, scales))
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)


def test_deinterleave():
    t = torch.arange(12).view(2, 6)
    assert layout.deinterleave(t, 1).tolist() == [[0, 2, 4, 1, 3, 5], [6, 8, 10, 7, 9, 11]]
    assert layout.deinterleave(t.T, 0).T.tolist() == layout.deinterleave(t, -1).tolist()


def test_config_keys():
    c = ModelConfig.from_dict(preset_config("gpt-oss-120b"))
    assert (c.family, c.num_hidden_layers, c.num_experts, c.num_experts_per_tok) == ("gpt_oss", 36, 128, 4)
    assert c.moe_intermediate_size == 2880 and c.moe_layers == list(range(36))
    assert [c.window_of(i) for i in range(3)] == [128, None, 128]
    assert c.expert_act.kind == "clamped_swiglu" and c.expert_act.limit == 7.0 and c.expert_act.alpha == 1.702
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["truncate"] is False and c.rope_theta == 150000
    bare = {k: v for k, v in preset_config("tiny-gpt-oss").items()
            if k not in ("layer_types", "rope_scaling", "rope_theta", "swiglu_limit")}
    d = ModelConfig.from_dict(bare)  # transformers' GptOssConfig defaults
    assert d.layer_types == ("sliding_attention", "full_attention") * 2 and d.rope_scaling["factor"] == 32.0
    assert d.swiglu_limit == 7.0 and d.rope_theta == 150000.0
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_dict({**bare, "layer_types": ["sliding_attention"]})
    assert ModelConfig.from_dict(preset_config("tiny")).expert_act.kind == "silu"  # Qwen3 keeps its SwiGLU


def test_synthetic_sources(bf16_dir):
    """In-memory synthetic models hold the experts the written checkpoints hold (bf16: the same
    values; MXFP4: the same bytes); the layered regime applies to gpt-oss, persistence (Qwen3's
    q/k norms) is refused."""
    from ostinato.loader.build import load_experts, load_quantized_experts

    a, b = load_experts(open_source("synth:tiny-gpt-oss"), 1), load_experts(CheckpointSource(bf16_dir), 1)
    assert all(torch.equal(x, y) for x, y in zip(a[:4], b[:4])) and a.act == b.act
    src = open_source("synth:tiny-gpt-oss-mxfp4")
    assert src.expert_qtypes(1) == ("MXFP4", "MXFP4")
    q = load_quantized_experts(src, 1)
    assert q.w13.shape == (16, 128, formats.row_bytes("MXFP4", 128)) and q.b13.shape == (16, 128)
    blocks, scales = to_hf(q.w13[3])  # gate rows, then up rows: interleave them back
    spec = src.spec
    want = spec.tensor("model.layers.1.mlp.experts.gate_up_proj_blocks", dtype=torch.uint8)[3]
    assert torch.equal(layout.deinterleave(want, 0), blocks)
    layered = open_source("synth:tiny-gpt-oss?regime=layered")
    r = ModelRunner(layered, RunnerSettings(device="cpu", dtype="fp32", max_context=64))
    assert torch.isfinite(r.forward(_prompt(20), 0)).all()
    with pytest.raises(ValueError, match="persistence"):
        ModelRunner(open_source("synth:tiny-gpt-oss?regime=layered-persistent"), RunnerSettings(device="cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("fraction", [1.0, 0.5], ids=["all-resident", "half-cold"])
def test_graph_replay_bitwise_equals_synchronous_path(ckpt, tmp_path, fraction):
    """CUDA, bf16: the captured decode step (sliding layers' gathered rows, sinks; the native
    worker's handshake when experts are cold) equals the same step run host-driven, bit for bit,
    over 96 steps; the first prefill agrees with transformers within bf16's rounding."""
    from tests.test_graph import replay_vs_eager

    place = PlacementSettings(residency=_residency_path(open_source(str(ckpt)), tmp_path, fraction))
    graphed = load_engine(str(ckpt), RunnerSettings(device="cuda", dtype="bf16", max_context=2048), place)
    sync = load_engine(str(ckpt), RunnerSettings(device="cuda", dtype="bf16", max_context=2048, cuda_graph=False),
                       place)
    assert graphed.runner.graphs is not None
    ids = _prompt(64)
    hf = _load_hf(ckpt, torch.bfloat16).cuda()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]).cuda()).logits[0].float()
    # per token: a router near-tie in bf16 lets the two pick another expert (the MXFP4 checkpoint's token 12,
    # layer 1: its 4th and 5th scores equal in bf16), so one row in 32 may lie further, never far
    rows = (sync.runner.forward(ids, 0, all_logits=True) - ref).abs().amax(-1) / ref.abs().max()
    assert float((rows < 2e-2).float().mean()) >= 31 / 32 and float(rows.max()) < 0.1, rows.tolist()
    replay_vs_eager(graphed, sync, steps=96)


def test_gpt_oss_120b_preset_shapes():
    """The real model's shapes, without generating it: 36 layers of 128 MXFP4 experts, top-4, its
    expert bytes (blocks, scales and fp32 biases) as the planner counts a pool slot."""
    from ostinato.engine.sizes import expert_sizes
    from ostinato.synth.weights import SynthSpec

    spec = SynthSpec("gpt-oss-120b")
    c = spec.model_config
    assert (len(c.moe_layers), c.num_experts, c.num_experts_per_tok, c.hidden_size) == (36, 128, 4, 2880)
    assert spec.shapes["model.layers.35.mlp.experts.gate_up_proj_blocks"] == (128, 5760, 90, 16)
    assert spec.shapes["model.layers.0.mlp.experts.down_proj_scales"] == (128, 2880, 90)
    assert spec.dtype_of("model.layers.0.mlp.experts.down_proj_blocks") == torch.uint8
    sizes = expert_sizes(c, torch.bfloat16, {l: layout.MXFP4 for l in c.moe_layers})
    assert set(sizes.values()) == {("MXFP4/MXFP4", (5760 + 2880) * 90 * 17 + (5760 + 2880) * 4)}


def test_the_capacity_test_counts_the_scores_of_one_chunk_of_queries():
    """gpt-oss attends in chunks of queries holding at most SCORE_BUDGET bytes of fp32 scores, so the
    capacity test's bound on a long pass is the chunk's, not the whole H x T x N (27.5 GiB for 120b's
    2048-token chunk over 16k tokens)."""
    from ostinato.sources import open_source
    from ostinato.models.gpt_oss import SCORE_BUDGET
    from ostinato.planner.capacity import activation_bytes

    cfg = open_source("synth:gpt-oss-120b").config
    H, T, N = cfg.num_attention_heads, 2048, 16384
    attention = activation_bytes(cfg, T, N, torch.bfloat16)["attention"]
    assert 13 * SCORE_BUDGET // 4 <= attention < 13 * H * T * N / 16
    # a short pass whose scores fit one chunk is counted whole, as before
    assert activation_bytes(cfg, 4, 64, torch.bfloat16)["attention"] >= 13 * H * 4 * 64


def test_pass_graphs_count_the_sliding_layers_scores():
    """A captured pass of B tokens (PassGraphs) on gpt-oss: beside the bound over its own rows and the
    split-K kernel's partials (the full layers'), the sliding layers' torch attention holds fp32 scores
    of B tokens over the w + B - 1 rows they gather, and their cast (models/gpt_oss.py); and the
    handshake's B fp32 join rows."""
    from ostinato.engine.sizes import expert_sizes
    from ostinato.planner.capacity import CapacitySettings, WeightFormats, pass_bound, pass_graph_bytes

    cfg = open_source("synth:gpt-oss-120b").config
    H, Hkv, Hd, w, B = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window, 256
    sizes = expert_sizes(cfg, torch.bfloat16, {})
    got = pass_graph_bytes(cfg, CapacitySettings(pass_graph_rows=B), 8192, torch.bfloat16, WeightFormats(), sizes)
    partials = Hkv * 2 * (B * H // Hkv) * (Hd + 2) * 4  # 256 tokens' 2048 rows a KV head: 32 blocks of 2 splits
    join = B * cfg.hidden_size * 4  # the CPU worker's partial copied into device rows (CopyJoin)
    sliding = H * B * (w + B - 1) * 6
    assert got == pass_bound(cfg, B, B, torch.bfloat16, score_share=0.0)["total"] + partials + sliding + join
