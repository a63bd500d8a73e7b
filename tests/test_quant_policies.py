"""Every baseline policy on a GGUF file's own block formats: tiny-k as Q4_K_M (layer 0
Q4_K/Q4_K, layer 1 Q4_K/Q6_K, so two pool groups), each policy's pools quantized, its pool
bytes within the byte budget, and its logits over a prompt and a few decode steps against the
same policy with experts="bf16" (dequantized at load).

Tolerances, as tests/test_quant_engine.py argues them: a policy that computes every route
from its pools does the same fp32 math on the same dequantized values as the bf16 mode (1e-4
of the largest logit); one whose CPU branch runs the native kernels quantizes activations to
int8 per 32 values (about 1% on a cold expert's output, 1% of the largest logit allowed),
whatever it uploaded (expert-cache serves this short prompt and decode from its cache),
which is also why those must differ from the reference by more than 1e-6 (the comparison can
fail). The reference runs its CPU routes in the torch backend on float weights: exact fp32, so
its logits do not depend on its placement, which its own byte budget chooses.

Legend: E experts per layer, K top-k, b0 / b1 one expert's bytes in group 0 / 1.
"""
from __future__ import annotations

import pytest
import torch

from ostinato.engine.routes import RouteCounts
from ostinato.engine.runner import RunnerSettings
from ostinato.engine.sizes import expert_sizes
from ostinato.load import load_engine
from ostinato.loader.build import expert_formats
from ostinato.loader.gguf import GGUFSource
from ostinato.policies.factory import policy_factory
from ostinato.policies.settings import POLICIES, PolicySettings
from tests.test_quant_engine import _logits, _rel, _residency, tinyk_q4km  # noqa: F401  (a fixture)

# slots per group beyond the K zero slots, each policy's budget: partial residency where the model allows
# it (fixed-*: 8 of 16 per layer; caches: E staging + 8 and 7 cache slots); `layers` on two layers in two
# groups is all or nothing (a host layer's E staging slots cost what the layer would), so it holds both
EXTRA = {"cpu": 0, "gpu": 16, "layers": 16, "fixed-per-layer": 8, "fixed-uniform": 8, "expert-cache": 24,
         "decaying-cache": 24}
ALL_ON_POOLS = ("gpu", "layers")  # every route from the pools under their budgets here


def _counts(cfg) -> RouteCounts:
    c = RouteCounts.zeros(list(cfg.moe_layers), cfg.num_experts)
    for l in cfg.moe_layers:
        c.prefill[l] = torch.tensor([100 - 5 * e for e in range(cfg.num_experts)])
        c.decode[l] = torch.tensor([max(0, 50 - 3 * e) for e in range(cfg.num_experts)])
    c.tokens = {"prefill": 400, "decode": 100}
    return c


def _group_bytes(source) -> list[int]:
    """One expert's bytes per format group, in layer order: [b0, b1]."""
    sizes = expert_sizes(source.config, torch.float32, expert_formats(source))
    return list(dict(sizes.values()).values())


def _build(path, name, settings):
    rs = RunnerSettings(device="cpu", dtype="fp32", max_context=128, prefill_chunk=64, cuda_graph=False)
    return load_engine(str(path), rs, experts_factory=policy_factory(name, settings))


@pytest.fixture(scope="module")
def setup(tinyk_q4km, tmp_path_factory):  # noqa: F811
    source = GGUFSource(tinyk_q4km)
    residency = _residency(source, 0.5)  # 8 hot per layer: 8 + K + 8 flex slots per group
    return source, residency, _counts(source.config), _group_bytes(source)


def _settings(name, setup, experts):
    source, residency, counts, b = setup
    K = source.config.num_experts_per_tok
    base = dict(profile=counts, residency=residency, cpu_backend="auto" if experts == "native" else "torch",
                offload_threshold=32, experts=experts)
    if name not in EXTRA:  # ostinato's steps and ktransformers: the residency's own pools
        return PolicySettings(**base)
    if experts == "native":
        return PolicySettings(budget_bytes=sum(b) * (K + EXTRA[name]), **base)
    # one float group, its own budget (gpu: over it, logically); the reference's placement does not matter
    return PolicySettings(expert_slots=K + EXTRA[name], allow_over_budget=True, **base)


@pytest.mark.parametrize("name", POLICIES, ids=lambda n: n.replace("gpu", "all-resident"))  # "gpu": a CUDA mark
def test_policy_on_quantized_experts_matches_dequantized(tinyk_q4km, setup, name):  # noqa: F811
    source, residency, counts, b = setup
    settings = _settings(name, setup, "native")
    native = _build(tinyk_q4km, name, settings)
    backend = native.runner.experts.unwrapped
    pools = backend.pools
    assert [p.qtypes for p in pools.groups] == [("Q4_K", "Q4_K"), ("Q4_K", "Q6_K")]
    assert all(p.w13.dtype == torch.uint8 for p in pools.groups)
    assert [p.expert_bytes for p in pools.groups] == b
    if settings.budget_bytes is not None:
        assert pools.nbytes <= settings.budget_bytes, (pools.describe(), settings.budget_bytes)
    got = _logits(native)
    stats = native.runner.placement_stats()
    native.runner.experts.close()
    ref_engine = _build(tinyk_q4km, name, _settings(name, setup, "bf16"))
    assert [p.qtypes for p in ref_engine.runner.experts.unwrapped.pools.groups] == [None]
    ref = _logits(ref_engine)
    ref_engine.runner.experts.close()
    assert (stats.get("cold_routes", 0) == 0) == (name in ALL_ON_POOLS)
    if stats.get("cpu_experts", 0) == 0:  # every route from the pools, uploaded ones too (expert-cache)
        assert _rel(got, ref) < 1e-4
    else:
        assert 1e-6 < _rel(got, ref) < 1e-2, _rel(got, ref)


def test_budget_is_bytes_per_group(tinyk_q4km, setup):  # noqa: F811
    """One budget for every policy, as bench gives it: each fits, and each takes what the bytes allow."""
    source, residency, counts, b = setup
    K, E = source.config.num_experts_per_tok, source.config.num_experts
    budget = sum(b) * (K + E + 8)
    for name in POLICIES:
        settings = PolicySettings(budget_bytes=budget, profile=counts, residency=residency, cpu_backend="torch",
                                  allow_over_budget=True)
        engine = _build(tinyk_q4km, name, settings)
        backend = engine.runner.experts.unwrapped
        pools = backend.pools
        assert len(pools.groups) == 2
        if name != "gpu":
            assert pools.nbytes <= budget, name
        if name == "fixed-per-layer":  # n from the bytes: (budget - K * (b0 + b1)) // (b0 + b1), capped at E
            assert all(p.num_hot == E for p in pools.groups)
        if name == "expert-cache":  # the bytes after zero + staging split by layers: 4 * (b0 + b1) each
            assert [p.num_slots - p.flex_lo - E for p in pools.groups] == [4 * sum(b) // x for x in b]
            assert backend.resident_experts() == sum(4 * sum(b) // x for x in b)
        engine.runner.experts.close()
    tight = sum(b) * (K + 5) + b[0]  # fixed-per-layer: 5 per layer, the extra b0 unused
    engine = _build(tinyk_q4km, "fixed-per-layer", PolicySettings(budget_bytes=tight, profile=counts,
                                                                  cpu_backend="torch"))
    assert [p.num_hot for p in engine.runner.experts.unwrapped.pools.groups] == [5, 5]
    engine.runner.experts.close()


def test_policies_over_a_kept_store_of_block_formats(tinyk_q4km, setup, monkeypatch):  # noqa: F811
    """As the bench builds them: the profiling placement's host copies of every expert, in the file's two
    block-format groups, kept as the store (engine/experts.py keep_host_experts); each policy built over it
    loads nothing from the file and gives the logits of the same policy loaded from the file. A policy in
    another format (experts="bf16") does not take the store."""
    from ostinato.engine.experts import keep_host_experts, stored_experts
    from ostinato.policies.factory import make_policy, use_policy

    rs = RunnerSettings(device="cpu", dtype="fp32", max_context=128, prefill_chunk=64, cuda_graph=False)
    loaded = _build(tinyk_q4km, "cpu", _settings("cpu", setup, "native"))
    store = loaded.runner.experts.unwrapped.host
    assert keep_host_experts(loaded.source, store)
    assert stored_experts(loaded.source, expert_formats(loaded.source, "bf16"), torch.float32) is None
    wants = {}
    for name in ("ostinato", "layers", "expert-cache"):
        engine = _build(tinyk_q4km, name, _settings(name, setup, "native"))
        wants[name] = _logits(engine)
        engine.runner.experts.close()

    def no_load(*a, **kw):
        raise AssertionError("a placement over the kept store loaded the file's experts")
    monkeypatch.setattr("ostinato.engine.experts.load_layer_experts", no_load)
    for name, want in wants.items():
        use_policy(loaded, make_policy(name, loaded.source, rs, _settings(name, setup, "native")))
        host = loaded.runner.experts.unwrapped.host
        assert all(w.w13.data_ptr() == store.layers[l].w13.data_ptr() for l, w in host.layers.items())
        assert torch.equal(_logits(loaded), want), name
    loaded.runner.experts.close()
