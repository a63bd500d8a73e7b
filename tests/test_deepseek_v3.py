"""DeepSeek-V3 (issue [O] part 2) against transformers' DeepseekV3ForCausalLM on the same
synthetic checkpoint: logits of a prefill, of a prefill after cached tokens and of decode
steps (eager and through a DecodeWindow), greedy tokens, under a hybrid residency and split
over two devices; short prefill passes through a DecodeWindow (latent attention; on CUDA the
split-K kernel, under graph replay too) against the host-driven prefill; the grouped router
against transformers' router, ties included; the compressed (latent) KV cache and the split-K
partials the planner sizes; and GLM-4-MoE, DeepSeek-V3's MoE under grouped-query attention,
against transformers' Glm4MoeForCausalLM."""
from __future__ import annotations

import json

import pytest
import torch

from ostinato.config import FAMILIES, SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from ostinato.engine.kv_cache import KVCache
from ostinato.engine.runner import ModelRunner, RunnerSettings
from ostinato.layers.moe.router import route_grouped
from ostinato.loader.source import CheckpointSource
from ostinato.models.common import DecodeWindow
from ostinato.models.registry import MODELS
from ostinato.synth import presets

transformers = pytest.importorskip("transformers")
TOL = 1e-3


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory, _isolated_cache):
    from ostinato.synth.build import write_checkpoint

    return write_checkpoint("tiny-deepseek-v3", tmp_path_factory.mktemp("tiny-deepseek-v3"))


def _ours(path, chunk=2048, **kw):
    return ModelRunner(CheckpointSource(path), RunnerSettings(device="cpu", dtype="fp32", max_context=256,
                                                              prefill_chunk=chunk, **kw))


def _prompt(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4000, (n,), generator=g).tolist()


STEPS = 16  # greedy decode steps compared


@pytest.fixture(scope="module")
def ref(ds_dir):
    """transformers on one prompt: (prompt, its greedy tokens, logits of prompt + tokens [T, V])."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(ds_dir, dtype=torch.float32).eval()
    ids = _prompt()
    want = _hf_greedy(hf, ids, STEPS)
    with torch.no_grad():
        return ids, want, hf(torch.tensor([ids + want])).logits[0]


def _err(got, ref) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def _greedy(step, logits, start: int, n: int) -> list[int]:
    """n greedy tokens from the logits of position start - 1, one step(token, position) each."""
    out = []
    for i in range(n):
        out.append(int(logits.argmax()))
        logits = step(out[-1], start + i)
    return out


def _hf_greedy(hf, ids, n):
    return hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(ids):].tolist()


def test_config_and_registry():
    cfg = ModelConfig.from_dict(presets.TINY_DEEPSEEK_V3)
    assert cfg.family == "deepseek_v3" and "DeepseekV3ForCausalLM" in SUPPORTED_ARCHITECTURES
    assert cfg.num_experts == 16 and cfg.moe_layers == [1, 2, 3] and cfg.n_shared_experts == 1
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.scoring_func) == (4, 2, 2.5, "sigmoid")
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim) == (48, 32, 16, 24)
    assert ModelConfig.from_dict({**presets.TINY_DEEPSEEK_V3, "moe_layer_freq": 2}).moe_layers == [2]
    assert {f.name for f in FAMILIES} == set(MODELS)  # every family parsed has a model module
    missing = {k: v for k, v in presets.TINY_DEEPSEEK_V3.items() if k != "kv_lora_rank"}
    with pytest.raises(ConfigError, match="lacks the key 'kv_lora_rank' that DeepSeek-V3 needs"):
        ModelConfig.from_dict(missing)
    with pytest.raises(ConfigError, match="n_group"):
        ModelConfig.from_dict({**presets.TINY_DEEPSEEK_V3, "n_group": 3})
    with pytest.raises(ConfigError, match="scoring_func"):
        ModelConfig.from_dict({**presets.TINY_DEEPSEEK_V3, "scoring_func": "softmax"})
    glm = ModelConfig.from_dict(presets.TINY_GLM4_MOE)
    assert (glm.family, glm.moe_layers, glm.qk_norm, glm.partial_rotary_factor, glm.kv_lora_rank) == \
        ("glm4_moe", [1, 2], True, 0.5, 0)


def _hf_router(E, K, groups, topk_group, norm, scaling):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    c = transformers.DeepseekV3Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=K, n_group=groups,
                                      topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scaling)
    r = DeepseekV3TopkRouter(c)
    with torch.no_grad():
        r.weight.copy_(torch.eye(E))  # its logits are its input
    return r


@pytest.mark.parametrize("E,K,groups,topk_group,norm", [(16, 4, 4, 2, True), (64, 6, 8, 3, True),
                                                       (16, 4, 1, 1, False), (32, 8, 4, 4, True)])
@pytest.mark.parametrize("kind", ["random", "ties"])
def test_router_matches_transformers(E, K, groups, topk_group, norm, kind):
    """Same ids and weights as transformers' router; "ties": logits and biases on a coarse grid,
    so scores, group scores and biased scores tie often."""
    g = torch.Generator().manual_seed(E + K + groups)
    T = 257
    if kind == "ties":
        logits = torch.randint(-2, 3, (T, E), generator=g).float() / 2
        bias = torch.randint(-1, 2, (E,), generator=g).float() / 8
    else:
        logits, bias = 3 * torch.randn(T, E, generator=g), 0.1 * torch.randn(E, generator=g)
    ref = _hf_router(E, K, groups, topk_group, norm, 2.5)
    with torch.no_grad():
        ref.e_score_correction_bias.copy_(bias)
        _, want_w, want_ids = ref(logits)
    got = route_grouped(logits, bias, K, groups, topk_group, norm, 2.5)
    got_ids, order = got.ids.sort(dim=-1)
    want_ids, want_order = want_ids.sort(dim=-1)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got.weights.gather(1, order), want_w.gather(1, want_order))
    assert got.weights.dtype == torch.float32
    # the bias chose, it did not weigh: each weight is its expert's own (scaled) sigmoid share
    s = logits.sigmoid().gather(1, got.ids)
    assert torch.allclose(got.weights, 2.5 * (s / s.sum(-1, keepdim=True) if norm else s))


def test_latent_kv_cache_bytes():
    """MLA caches R + Dr values per token and layer (the latent and the rope key), not per-head K/V;
    the planner's capacity test counts what the runner allocates."""
    from ostinato.engine.sizes import kv_bytes

    for preset, per_token in (("tiny-deepseek-v3", 32 + 16), ("deepseek-v3-shaped", 512 + 64), ("tiny", 2 * 2 * 32)):
        cfg = ModelConfig.from_dict(presets.preset_config(preset))
        N, L = 100, cfg.num_hidden_layers
        want = L * N * per_token * 2
        assert KVCache.bytes_needed(cfg, N, torch.bfloat16) == want == kv_bytes(cfg, N, torch.bfloat16)
        assert kv_bytes(cfg, N, torch.bfloat16, layers=1) == want // L
    cfg = ModelConfig.from_dict(presets.TINY_DEEPSEEK_V3)
    kv = KVCache(cfg, 64, "cpu", torch.float32)
    assert set(kv.layers[0].tensors) == {"ckv"} and kv.layers[0].ckv.shape == (64, 48)
    assert sum(t.numel() * t.element_size() for t in kv.blocks.values()) == KVCache.bytes_needed(cfg, 64, torch.float32)


def test_capacity_counts_the_model():
    """Dense bytes from the model itself (routers kept fp32), activation bounds of MLA, and the
    shaped preset's size: about 100 GiB in bf16."""
    from ostinato.engine.sizes import dense_weight_bytes, expert_bytes
    from ostinato.planner.capacity import activation_bytes

    cfg = ModelConfig.from_dict(presets.TINY_DEEPSEEK_V3)
    D, E = cfg.hidden_size, cfg.num_experts
    fp32_router = len(cfg.moe_layers) * (E * D + E)
    total = sum(p.numel() for p in MODELS["deepseek_v3"](cfg).parameters())
    total -= cfg.vocab_size * D  # the embedding table stays in host memory (host_embedding)
    assert dense_weight_bytes(cfg, torch.bfloat16) == 2 * (total - fp32_router) + 4 * fp32_router
    a, b = activation_bytes(cfg, 64, 1000, torch.bfloat16), activation_bytes(cfg, 64, 2000, torch.bfloat16)
    assert a["total"] == sum(v for k, v in a.items() if k != "total") and b["attention"] > a["attention"]
    assert a["shared_experts"] > 0
    big = ModelConfig.from_dict(presets.preset_config("deepseek-v3-shaped"))
    size = dense_weight_bytes(big, torch.bfloat16) + len(big.moe_layers) * big.num_experts * expert_bytes(
        big, torch.bfloat16)
    assert big.moe_layers == [3, 4, 5, 6] and 90 * 2**30 < size < 100 * 2**30


def test_pass_graphs_count_the_latent_partials():
    """A captured pass of B tokens attends in the latent space (split-K over one KV head of H rows a
    token, R values): beside the bound over its own rows, the planner counts that kernel's fp32
    partials, R + 2 a row and split, not those of the expanded prefill's H heads of Dv (and the handshake's
    B fp32 join rows)."""
    from ostinato.engine.sizes import expert_sizes
    from ostinato.planner.capacity import CapacitySettings, WeightFormats, pass_bound, pass_graph_bytes

    cfg = ModelConfig.from_dict(presets.preset_config("deepseek-v3-shaped"))
    H, R = cfg.num_attention_heads, cfg.kv_lora_rank
    assert (H, R) == (128, 512)
    sizes = expert_sizes(cfg, torch.bfloat16, {})

    def partials(B):
        got = pass_graph_bytes(cfg, CapacitySettings(pass_graph_rows=B), 8192, torch.bfloat16, WeightFormats(), sizes)
        return got - pass_bound(cfg, B, B, torch.bfloat16, score_share=0.0)["total"] - B * cfg.hidden_size * 4  # join

    assert partials(64) == 64 * H * (R + 2) * 4  # 8192 rows in 256 blocks of 32: one split each
    assert partials(2) == 32 * 2 * H * (R + 2) * 4  # 8 blocks share decode's 4 blocks x 64 splits


def test_logits_and_greedy_match_transformers(ds_dir, ref):
    ids, want, logits_ref = ref
    ours = _ours(ds_dir, chunk=20)  # chunks after cached tokens inside the prefill too
    assert _err(ours.forward(ids, 0, all_logits=True), logits_ref[:len(ids)]) < TOL
    ours.forward(ids[:30], 0)  # a prefill after cached tokens
    assert _err(ours.forward(ids[30:], 30, all_logits=True), logits_ref[30:len(ids)]) < TOL
    logits = ours.forward(ids, 0)
    got = []
    for i in range(STEPS):  # decode steps, eager
        got.append(int(logits.argmax()))
        logits = ours.forward([got[-1]], len(ids) + i)
        assert _err(logits, logits_ref[len(ids) + i]) < TOL
    assert got == want
    # the same steps through a DecodeWindow (the captured step's computation)
    assert _greedy(ours.decode_windowed, ours.forward(ids, 0), len(ids), STEPS) == want
    ours.forward(ids, 0)
    for i, t in enumerate(want[:4]):
        assert _err(ours.decode_windowed(t, len(ids) + i), logits_ref[len(ids) + i]) < TOL


def test_one_window_for_every_position(ds_dir):
    """A window object reused at every position, as a captured graph reuses it: the same as prefill."""
    r = _ours(ds_dir)
    ids = _prompt(60, seed=3)
    ref = r.forward(ids, 0, all_logits=True)
    r.forward(ids[:40], 0)
    pos = torch.zeros(1, dtype=torch.long)
    window = DecodeWindow(pos, 256)
    got = []
    with torch.inference_mode():
        for p in range(40, 60):
            pos.fill_(p)
            got.append(r.model.logits(r.model(torch.tensor([ids[p]]), pos, r.kv.layers, 0, window))[0])
    assert _err(torch.stack(got), ref[40:60]) < 1e-5


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_windowed_pass_matches_prefill(ds_dir, device):
    """Short prefill passes through a window of B rows, the first position on the device (the computation
    PassGraphs captures: MLA in the latent space, on CUDA through the split-K kernel with the latent
    cache as one KV head), fp32: the real rows' logits and the latent rows they write equal the
    host-driven prefill's (the expanded MLA); the padding rows past n change no real row."""
    from tests.test_graph import windowed_passes_vs_prefill

    windowed_passes_vs_prefill(ds_dir, device)


@pytest.mark.gpu
def test_cuda_windowed_decode_matches_sdpa(ds_dir):
    """A decode step through the window on CUDA (the split-K kernel over the latent cache) against the
    host-driven step at the same position (SDPA in the latent space, over the same cache: both write
    the same row), fp32, at 20 positions."""
    r = ModelRunner(CheckpointSource(ds_dir), RunnerSettings(device="cuda", dtype="fp32", max_context=256,
                                                             cuda_graph=False))
    ids = _prompt(60, seed=4)
    r.forward(ids[:40], 0)
    for p in range(40, 60):
        want = r.forward([ids[p]], p)
        assert _err(r.decode_windowed(ids[p], p), want) < 1e-4, p


@pytest.mark.gpu
@pytest.mark.parametrize("cold", [0.0, 0.5], ids=["all-resident", "half-cold"])
def test_pass_graphs_match_host_driven_passes(ds_dir, tmp_path, cold):
    """Short prefill passes replayed as captured graphs (MLA in the latent space through the split-K
    kernel) against an engine's host-driven passes (the expanded MLA), bf16 (tests/test_graph.py's test
    of the tiny Qwen3)."""
    from tests.test_graph import pass_graphs_vs_host_driven

    pass_graphs_vs_host_driven(ds_dir, tmp_path, cold)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # transformers' empty shared experts
def test_variant_without_q_lora_and_groups(tmp_path):
    """q_lora_rank None (one q_proj), plain rope, one group, no renormalisation, no shared expert,
    two dense layers, tied embeddings: a checkpoint with those tensors, against transformers."""
    from safetensors.torch import save_file

    from ostinato.synth.weights import SynthSpec

    cfg = dict(presets.TINY_DEEPSEEK_V3, q_lora_rank=None, rope_scaling=None, n_group=1, topk_group=1,
               norm_topk_prob=False, n_shared_experts=0, first_k_dense_replace=2, tie_word_embeddings=True,
               rope_interleave=False)
    presets.PRESETS["_test_ds"] = cfg
    presets.DEFAULT_SKEW["_test_ds"] = 1.0
    try:
        spec = SynthSpec("_test_ds")
        save_file({n: spec.tensor(n, dtype=spec.dtype_of(n)) for n in spec.shapes}, tmp_path / "model.safetensors",
                  metadata={"format": "pt"})
    finally:
        del presets.PRESETS["_test_ds"], presets.DEFAULT_SKEW["_test_ds"]
    assert "model.layers.0.self_attn.q_proj.weight" in spec.shapes
    assert not any("shared_experts" in n for n in spec.shapes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = _ours(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = _prompt(24, seed=1)
    want = _hf_greedy(hf, ids, 4)
    with torch.no_grad():
        ref = hf(torch.tensor([ids + want])).logits[0]
    assert _err(ours.forward(ids, 0, all_logits=True), ref[:len(ids)]) < TOL
    assert _greedy(lambda t, p: ours.forward([t], p), ours.forward(ids, 0), len(ids), 4) == want


def test_hybrid_residency_matches_transformers(ds_dir, ref, tmp_path):
    """Half of every MoE layer's experts in the pool (which runs on the CPU here), the rest on the
    CPU branch; prefill chunks of 32 take the upload path (threshold 16), decode the split path."""
    from ostinato.engine.placement import PlacementSettings
    from ostinato.load import load_engine
    from tests.test_hybrid import _residency_for

    ids, want, logits_ref = ref
    _residency_for(CheckpointSource(ds_dir), 0.5).save(tmp_path / "r.json")
    settings = RunnerSettings(device="cpu", dtype="fp32", max_context=256, prefill_chunk=32)
    r = load_engine(str(ds_dir), settings, PlacementSettings(residency=str(tmp_path / "r.json"), upload_threshold=16),
                    announce=False).runner
    assert _err(r.forward(ids, 0, all_logits=True), logits_ref[:len(ids)]) < TOL
    stats = r.placement_stats()
    assert stats["cold_routes"] > 0 and stats["bytes_uploaded"] > 0
    assert _greedy(lambda t, p: r.forward([t], p), r.forward(ids, 0), len(ids), STEPS) == want
    assert _greedy(r.decode_windowed, r.forward(ids, 0), len(ids), STEPS) == want
    assert r.placement_stats()["cold_routes"] > stats["cold_routes"] + 2 * STEPS  # decode had cold routes too


def test_baselines_under_a_cap_smaller_than_a_layer_match_transformers(ds_dir, ref):
    """layers and expert-cache with a pool of K + 8 slots, less than K zero + E staging (DeepSeek-V3's bf16
    layers under 24 GiB): no layer resident, a quarter of the pool as staging, prefill chunks of 32 (at the
    offload threshold of 16) uploaded in waves, decode on the CPU or from the cache: transformers' logits
    and greedy tokens."""
    from ostinato.load import load_engine
    from ostinato.policies.factory import make_policy, policy_factory, use_policy
    from ostinato.policies.settings import PolicySettings

    ids, want, logits_ref = ref
    cfg = CheckpointSource(ds_dir).config
    settings = RunnerSettings(device="cpu", dtype="fp32", max_context=256, prefill_chunk=32)
    slots = cfg.num_experts_per_tok + 8
    assert slots < cfg.num_experts_per_tok + cfg.num_experts
    ps = PolicySettings(expert_slots=slots, offload_threshold=16, cpu_backend="torch")
    loaded = load_engine(str(ds_dir), settings, experts_factory=policy_factory("layers", ps), announce=False)
    for name in ("layers", "expert-cache"):
        if name != "layers":
            use_policy(loaded, make_policy(name, loaded.source, settings, ps))
        r = loaded.runner
        (pool,) = r.experts.unwrapped.pools.groups
        assert r.experts.unwrapped.stage_room(pool) == slots // 4  # a quarter of the pool (baseline_staging)
        assert _err(r.forward(ids, 0, all_logits=True), logits_ref[:len(ids)]) < TOL, name
        stats = r.placement_stats()
        assert stats["wave_passes"] > 0 and stats.get("cpu_experts", 0) == 0, name
        assert _greedy(lambda t, p: r.forward([t], p), r.forward(ids, 0), len(ids), STEPS) == want, name
    use_policy(loaded, make_policy("cpu", loaded.source, settings, ps))


def test_split_over_two_devices(ds_dir):
    """Layers and their latent caches on two logical devices: the same logits as one."""
    one, two = _ours(ds_dir), _ours(ds_dir, devices="cpu:0,cpu:1")
    assert set(two.kv.blocks) == {"cpu:0", "cpu:1"} and set(two.kv.blocks["cpu:1"]) == {"ckv"}
    ids = _prompt(20, seed=4)
    assert _err(two.forward(ids, 0, all_logits=True), one.forward(ids, 0, all_logits=True)) < 1e-5
    assert _err(two.forward([7], len(ids)), one.forward([7], len(ids))) < 1e-5


def test_synthetic_source_and_regimes(ds_dir):
    """synth:tiny-deepseek-v3 in memory is the checkpoint on disk (its fp32 routers hold the bf16
    values the file has), routes are skewed by the preset's bias channel, and the persistence
    regime, which needs Qwen3's q/k norms, is refused."""
    from ostinato.engine.residency import model_fingerprint
    from ostinato.sources import open_source
    from ostinato.synth.presets import regime
    from ostinato.synth.weights import SynthSpec

    mem, disk = open_source("synth:tiny-deepseek-v3"), CheckpointSource(ds_dir)
    assert model_fingerprint(mem) == model_fingerprint(disk)
    w, ref = torch.empty(16, 128), torch.empty(16, 128)
    mem.load_("model.layers.1.mlp.gate.weight", w)
    disk.load_("model.layers.1.mlp.gate.weight", ref)
    assert torch.equal(w, ref)
    with pytest.raises(ValueError, match="persistence"):
        SynthSpec("tiny-deepseek-v3", regime=regime("layered-persistent")).channels
    spec = SynthSpec("tiny-deepseek-v3", regime=regime("content"))  # channels only the routers read
    R, p = spec.reserved, "model.layers.1."
    assert R > 1 and spec.tensor(p + "mlp.gate.weight")[:, :R].abs().min() > 0
    for reader in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "mlp.shared_experts.up_proj",
                   "mlp.experts.3.gate_proj"):
        assert spec.tensor(p + reader + ".weight")[:, :R].abs().max() == 0, reader
    for writer in ("self_attn.o_proj", "mlp.shared_experts.down_proj", "mlp.experts.3.down_proj"):
        assert spec.tensor(p + writer + ".weight")[:R].abs().max() == 0, writer
    assert spec.tensor(p + "self_attn.kv_b_proj.weight")[:, :R].abs().max() > 0  # reads the latent


def test_glm4_moe_matches_transformers(tmp_path, ds_dir):
    """GLM-4-MoE: q/k norms, q/k/v biases, rotary on half of each head, DeepSeek's MoE (n_group 2)."""
    from ostinato.synth.build import write_checkpoint

    d = write_checkpoint("tiny-glm4-moe", tmp_path / "glm")
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Glm4MoeForCausalLM"
    ids, n = _prompt(40, seed=5), 8
    want = _hf_greedy(hf, ids, n)
    with torch.no_grad():
        ref = hf(torch.tensor([ids + want])).logits[0]
    ours = _ours(d, chunk=16)
    assert set(ours.kv.layers[0].tensors) == {"k", "v"}
    assert _err(ours.forward(ids, 0, all_logits=True), ref[:len(ids)]) < TOL
    ours.forward(ids[:25], 0)
    assert _err(ours.forward(ids[25:], 25, all_logits=True), ref[25:len(ids)]) < TOL
    assert _greedy(lambda t, p: ours.forward([t], p), ours.forward(ids, 0), len(ids), n) == want
    assert _greedy(ours.decode_windowed, ours.forward(ids, 0), len(ids), n) == want
    ours.forward(ids, 0)
    assert _err(ours.decode_windowed(want[0], len(ids)), ref[len(ids)]) < TOL
    # a short prefill pass through a window of 16 rows (its attention is Qwen3's: engine/graph.py PassGraphs
    # captures such passes), 11 of them real, after 29 tokens
    ours.forward(ids[:29], 0)
    pos = torch.tensor([29])
    window = DecodeWindow(pos, 256, 16)
    tokens = torch.tensor(ids[29:40] + [0] * 5)
    with torch.inference_mode():
        got = ours.model.logits(ours.model(tokens, pos, ours.kv.layers, 0, window))[:11]
    assert _err(got, ref[29:40]) < TOL
