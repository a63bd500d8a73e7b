"""A pass of several chunks runs layer by layer, and at each MoE layer hands every chunk's routes to the
experts backend at once (engine/devices.py forward_layer_major, DecoderLayer.forward_chunks,
MoEBackend.many): where a layer's distinct cold experts outnumber the flex slots and go up in waves
(HybridExperts.upload_chunks), each wave is staged once for every chunk, so each distinct cold expert of a
layer crosses once for the whole pass, not once a chunk. Oracles: the same placement over one chunk, the
all-resident reference model, the plain-PyTorch MoE, and the routes the pass counted."""
from __future__ import annotations

import pytest
import torch

from ostinato.layers.moe.backend import MoEBackend
from ostinato.layers.moe.reference import ReferenceExperts, moe_forward
from ostinato.layers.moe.router import route
from ostinato.layers.moe.types import TopKOutput
from tests.test_hybrid import D, E, K, LAYERS, _experts, _hybrid

CHUNK, PROMPT = 32, 96  # three chunks
THRESHOLD = 16  # the baselines' offload threshold: every chunk takes the upload path


@pytest.fixture(scope="module", params=["tiny", "tiny-deepseek-v3"])
def checkpoint(request, tmp_path_factory, _isolated_cache):
    """Qwen3-MoE's and DeepSeek-V3's tiny synthetic checkpoints (DeepSeek-V3's: a dense first layer,
    shared experts added after the routed ones)."""
    from ostinato.synth.build import write_checkpoint

    return write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _engine(path, chunk: int, policy: str | None = None, device: str = "cpu"):
    """The engine over a tiny checkpoint, passes in chunks of `chunk`, its routes tallied; `policy` (a
    baseline with an offload threshold) under K + 8 expert slots, fewer than K zero + E staging slots
    (DeepSeek-V3's bf16 layers under 24 GiB): no layer resident, a quarter of the pool to stage in."""
    from ostinato.engine.runner import RunnerSettings
    from ostinato.load import load_engine
    from ostinato.loader.source import CheckpointSource
    from ostinato.policies.factory import policy_factory
    from ostinato.policies.settings import PolicySettings

    settings = RunnerSettings(device=device, dtype="fp32", max_context=256, prefill_chunk=chunk, count_routes=True)
    if policy is None:
        return load_engine(str(path), settings, announce=False)
    cfg = CheckpointSource(path).config
    ps = PolicySettings(expert_slots=cfg.num_experts_per_tok + 8, offload_threshold=THRESHOLD, cpu_backend="torch")
    return load_engine(str(path), settings, experts_factory=policy_factory(policy, ps), announce=False)


def _prompt(n: int = PROMPT) -> list[int]:
    return torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(3)).tolist()


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("policy", ["layers", "expert-cache"])
def test_a_pass_of_chunks_stages_each_wave_once(checkpoint, policy, device):
    """Three chunks on the upload path, each routing to more distinct cold experts than the staging slots:
    the logits of the same placement over one chunk and of the all-resident model; each MoE layer stages in
    waves once for the pass, and each distinct cold expert the pass routes to in a layer is copied once
    (one chunk after the other, a chunk's waves overwrote the previous chunk's: nearly three copies). On
    CUDA each wave's copies run on the copy stream and must wait for every chunk's GEMMs over the last wave."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    ids = _prompt()
    want = _engine(checkpoint, CHUNK, device=device).runner.forward(ids, 0, all_logits=True)
    one = _engine(checkpoint, PROMPT, policy, device).runner
    three = _engine(checkpoint, CHUNK, policy, device).runner
    h = three.experts.unwrapped
    cfg = three.config
    room = h.stage_room(h.pools.of(cfg.moe_layers[0]))
    hot = {l: set(h.hot_experts(l).tolist()) for l in cfg.moe_layers}  # none: no layer resident, the cache empty
    got_one = one.forward(ids, 0, all_logits=True)
    got = three.forward(ids, 0, all_logits=True)
    assert _err(got, got_one) < 1e-4 and _err(got, want) < 1e-4
    routed = three.routes.take().prefill  # the pass's routes per layer and expert
    cold = {l: set(torch.nonzero(routed[l]).flatten().tolist()) - hot[l] for l in cfg.moe_layers}
    assert all(len(c) > room for c in cold.values())  # every chunk's distinct cold experts go up in waves
    s, s_one = three.placement_stats(), one.placement_stats()
    assert s["uploaded_experts"] == s_one["uploaded_experts"] == sum(len(c) for c in cold.values())
    assert s["wave_passes"] == s_one["wave_passes"] == len(cfg.moe_layers)
    assert s["bytes_uploaded"] == s_one["bytes_uploaded"] and s.get("cpu_experts", 0) == 0
    assert s["cold_routes"] == s_one["cold_routes"] == s["routes"] == PROMPT * cfg.num_experts_per_tok * len(cold)


class Recorder(ReferenceExperts):
    """The reference backend, recording the tokens of each call."""

    def __init__(self, layers):
        super().__init__(layers)
        self.calls: list[int] = []

    def __call__(self, layer, x, topk):
        self.calls.append(x.shape[0])
        return super().__call__(layer, x, topk)


def _chunks(sizes: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T, D, generator=g) for T in sizes]
    return xs, [route(torch.randn(T, E, generator=g), K, True, x.dtype) for T, x in zip(sizes, xs)]


def test_the_base_backend_runs_the_chunks_one_by_one():
    """MoEBackend.many, not overridden: __call__ on each chunk in order, the same outputs as those calls."""
    ref = Recorder({l: _experts(l) for l in LAYERS})
    assert type(ref).many is MoEBackend.many
    xs, topks = _chunks([5, 1, 12])
    got = ref.many(LAYERS[0], xs, topks)
    assert ref.calls == [5, 1, 12]
    assert all(torch.equal(g, ref(LAYERS[0], x, t)) for g, x, t in zip(got, xs, topks))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_hybrid_many_stages_the_upload_chunks_together(device):
    """HybridExperts.many over chunks of 20, 3, 30 and 24 tokens at Np = 16 under 2 flex slots: the three on
    the upload path stage the union of their distinct cold experts once, in waves of 2 (on CUDA each wave's
    copies wait for every chunk's GEMMs over the previous one); the 3-token chunk runs split (its cold routes
    on the CPU). Each chunk's output is the plain-PyTorch MoE's (CUDA: bf16, against the fp32 reference on the
    same rounded inputs and weights)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    hybrid, weights = _hybrid(0.5, upload_threshold=16, backend="torch" if device == "cpu" else "auto",
                              device=device, dtype=dtype, flex=2)
    layer, sizes = LAYERS[1], [20, 3, 30, 24]
    xs, topks = _chunks(sizes, seed=1)
    cold = hybrid.pool.table_host[layer] < 0
    union = set().union(*(set(t.ids[cold[t.ids]].tolist()) for T, t in zip(sizes, topks) if T >= 16))
    split = set(topks[1].ids[cold[topks[1].ids]].tolist())
    on = [TopKOutput(t.ids.to(device), t.weights.to(device)) for t in topks]
    got = hybrid.many(layer, [x.to(dtype).to(device) for x in xs], on)
    w = weights[layer]
    rounded = type(w)(w.w13.to(dtype).float(), w.w2.to(dtype).float())
    for g, x, t in zip(got, xs, topks):
        want = moe_forward(x.to(dtype).float(), t, rounded)
        assert float((g.float().cpu() - want).abs().max() / want.abs().max()) < (1e-5 if device == "cpu" else 2e-2)
    s = hybrid.stats()
    assert len(union) > 2 and s["uploaded_experts"] == len(union) and s["wave_passes"] == 1
    assert s["cpu_experts"] == len(split) and s["routes"] == sum(sizes) * K
    assert s["cold_routes"] == sum(int(cold[t.ids].sum()) for t in topks)
