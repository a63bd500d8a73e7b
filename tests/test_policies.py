"""Baseline placement policies: each policy's output against the reference MoE on every
path, and its placement decisions (which experts ran from the pool, were uploaded, or
ran on the CPU) for fixed routings, on the CPU device."""
from __future__ import annotations

import pytest
import torch

from ostinato.config import ConfigError
from ostinato.engine.residency import Residency
from ostinato.engine.routes import RouteCounts
from ostinato.layers.moe.reference import moe_forward
from ostinato.layers.moe.router import route
from ostinato.layers.moe.types import ExpertWeights, TopKOutput
from ostinato.engine.experts import ModelExperts
from ostinato.policies.factory import budget_bytes, build_policy
from ostinato.policies.settings import POLICIES, PolicySettings

E, K, D, F = 16, 4, 64, 32
LAYERS = [0, 2, 3]  # model layer 1 is dense
SLOTS = 36  # pool slots: e.g. 24 hot + 4 zero + 8 flex (half of the 48 experts resident)


def _experts(seed):
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(torch.randn(E, 2 * F, D, generator=g) / D ** 0.5, torch.randn(E, D, F, generator=g) / F ** 0.5)


WEIGHTS = {l: _experts(l) for l in LAYERS}


def _spec(device="cpu"):
    return ModelExperts(4, LAYERS, E, K, D, F, torch.device(device), torch.float32,
                        lambda l: ExpertWeights(WEIGHTS[l].w13.clone(), WEIGHTS[l].w2.clone()), max_tokens=512)


def _counts():
    """A skewed profile: expert e of every layer has 100 - 5e prefill and 50 - 3e decode routes."""
    c = RouteCounts.zeros(LAYERS, E)
    for l in LAYERS:
        c.prefill[l] = torch.tensor([100 - 5 * e for e in range(E)])
        c.decode[l] = torch.tensor([max(0, 50 - 3 * e) for e in range(E)])
    c.tokens = {"prefill": 400, "decode": 100}
    return c


def _residency(hot_per_layer=8):
    return Residency("sha256:test", E, {l: list(range(hot_per_layer)) for l in LAYERS})


def _settings(**kw):
    base = dict(expert_slots=SLOTS, profile=_counts(), residency=_residency(), upload_threshold=32,
                offload_threshold=32, cpu_backend="torch", allow_over_budget=True)
    return PolicySettings(**{**base, **kw})


def _routing(ids: list[list[int]]) -> TopKOutput:
    t = torch.tensor(ids, dtype=torch.int64)
    w = torch.full(t.shape, 1.0 / t.shape[1])
    return TopKOutput(t, w)


def _x(T, seed=0):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("name", POLICIES)
def test_policy_matches_reference(name, tokens, device):
    policy = build_policy(name, _spec(device), _settings())
    g = torch.Generator().manual_seed(tokens)
    for rep in range(2):  # the second time caches hit
        for layer in LAYERS:
            x = torch.randn(tokens, D, generator=g)
            topk = route(torch.randn(tokens, E, generator=g), K, True, x.dtype)
            got = policy(layer, x.to(device), TopKOutput(topk.ids.to(device), topk.weights.to(device))).cpu()
            want = moe_forward(x, topk, WEIGHTS[layer])
            assert got.shape == want.shape and got.dtype == want.dtype
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (name, (got - want).abs().max())
    stats = policy.stats()
    assert stats["routes"] == 2 * len(LAYERS) * tokens * K
    assert stats.get("cold_routes", 0) <= stats["routes"]
    policy.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", POLICIES)
def test_policy_over_a_kept_store_reads_it_and_matches_reference(name, device):
    """A bench keeps its first placement's host copies of every expert (engine/experts.py keep_host_experts):
    every policy built afterwards takes its host copies as views of that store (no copy: the same memory)
    and its pools' fill from it, never the model's load, and computes what the reference MoE does."""
    from ostinato.engine.experts import expert_loader

    first = build_policy("cpu", _spec(device), _settings())  # nothing resident: every expert on the host
    store = first.unwrapped.host
    store.keep()
    first.close()  # as release() closes it: the kept store stays usable

    spec = _spec(device)  # no source to load from: the store's loader or nothing
    spec.load, spec.store = expert_loader(None, {}, torch.device(device), torch.float32, store), store
    policy = build_policy(name, spec, _settings())
    host = getattr(policy.unwrapped, "host", None)
    for layer, w in (host.layers if host is not None else {}).items():
        assert w.w13.data_ptr() == store.layers[layer].w13.data_ptr()
    g = torch.Generator().manual_seed(3)
    for tokens in (1, 64):
        for layer in LAYERS:
            x = torch.randn(tokens, D, generator=g)
            topk = route(torch.randn(tokens, E, generator=g), K, True, x.dtype)
            got = policy(layer, x.to(device), TopKOutput(topk.ids.to(device), topk.weights.to(device))).cpu()
            want = moe_forward(x, topk, WEIGHTS[layer])
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (name, (got - want).abs().max())
    policy.close()


def test_only_a_store_of_every_expert_is_kept_and_shared():
    from ostinato.layers.moe.pool import HostExperts

    some = build_policy("layers", _spec(), _settings()).unwrapped.host  # layers keeps some layers resident
    assert not some.holds_every_expert()
    with pytest.raises(ValueError, match="every expert"):
        some.keep()
    store = build_policy("cpu", _spec(), _settings()).unwrapped.host
    with pytest.raises(ValueError, match="kept store"):
        HostExperts.over(store, {0: [1]})
    store.keep()
    view = HostExperts.over(store, {0: [1, 5], 2: []})
    assert set(view.layers) == {0}
    assert view.compact[0].tolist() == [-1, 1, -1, -1, -1, 5] + [-1] * (E - 6)
    assert torch.equal(view.rows[0], view.compact[0]) and view.rows[0] is not view.compact[0]


def test_cpu_policy_computes_every_route_on_the_cpu():
    p = build_policy("cpu", _spec(), _settings())
    p(0, _x(2), _routing([[0, 1, 2, 3], [2, 3, 4, 5]]))
    s = p.stats()
    assert s["cold_routes"] == 8 and s["cpu_experts"] == 6 and s.get("bytes_uploaded", 0) == 0
    assert all(bool((p.pool.table_host[l] < 0).all()) for l in LAYERS)  # nothing resident
    p(0, _x(64), _routing([[e % E, (e + 1) % E, (e + 2) % E, (e + 3) % E] for e in range(64)]))
    assert p.stats().get("uploaded_experts", 0) == 0


def test_gpu_policy_fits_or_fails_clearly():
    with pytest.raises(ConfigError, match="do not fit the budget"):
        build_policy("gpu", _spec(), _settings(allow_over_budget=False))
    p = build_policy("gpu", _spec(), _settings(expert_slots=3 * E + K, allow_over_budget=False))
    p(2, _x(3), _routing([[0, 1, 2, 3]] * 3))
    s = p.stats()
    assert s.get("cold_routes", 0) == 0 and s["routes"] == 12 and p.resident_experts() == 3 * E
    assert p.capturable  # every step from the pool: the runner captures decode without a handshake


def test_layers_policy_places_whole_layers_and_offloads_large_passes():
    p = build_policy("layers", _spec(), _settings(offload_threshold=32))
    # 36 slots = 4 zero + 16 staging + one layer of 16 experts, the last
    assert [l for l in LAYERS if not p.has_cold[l]] == [3] and p.pool.num_slots - p.pool.flex_lo == E
    assert not p.capturable  # host layers decode through the graph handshake (the runner's wrapper)
    routing = [[0, 1, 2, 3], [1, 2, 3, 4]]
    p(3, _x(2), _routing(routing))
    assert p.stats().get("cold_routes", 0) == 0
    p(0, _x(2), _routing(routing))  # host layer, below the threshold: every expert on the CPU
    s = p.stats()
    assert s["cold_routes"] == 8 and s["cpu_experts"] == 5 and s.get("uploaded_experts", 0) == 0
    big = [[0, 1, 2, 3]] * 40 + [[4, 5, 6, 7]] * 24  # 64 tokens >= 32: upload the 8 used experts
    p(0, _x(64), _routing(big))
    s = p.stats()
    assert s["uploaded_experts"] == 8 and s["bytes_uploaded"] == 8 * 3 * D * F * 4
    assert s["cpu_experts"] == 5  # unchanged: nothing of the large pass ran on the CPU
    p.offload_threshold = 128  # tuned higher: the same pass stays on the CPU
    p(0, _x(64), _routing(big))
    assert p.stats()["uploaded_experts"] == 8 and p.stats()["cpu_experts"] == 13


def test_expert_cache_lru():
    p = build_policy("expert-cache", _spec(), _settings(expert_slots=6 + K + E, offload_threshold=512))
    p(0, _x(1), _routing([[0, 1, 2, 3]]))  # 4 misses: uploaded into the cache, computed on the GPU
    s = p.stats()
    assert s["uploaded_experts"] == 4 and s["cold_routes"] == 4 and s.get("cpu_experts", 0) == 0
    assert sorted(p.admission.cached(0)) == [0, 1, 2, 3]
    p(0, _x(1), _routing([[0, 1, 2, 3]]))  # 4 hits
    s = p.stats()
    assert s["uploaded_experts"] == 4 and s["routes"] - s["cold_routes"] == 4  # 4 hits
    p(2, _x(1), _routing([[0, 1, 8, 9]]))  # layer 2: 2 free slots, then evicts layer 0's LRU (0 and 1... )
    assert sorted(p.admission.cached(2)) == [0, 1, 8, 9]
    assert sorted(p.admission.cached(0)) == [2, 3] and p.stats()["evictions"] == 2
    p(0, _x(1), _routing([[2, 3, 4, 5]]))  # hits 2, 3; misses 4, 5 evict layer 2's least recent (0, 1)
    assert sorted(p.admission.cached(0)) == [2, 3, 4, 5] and sorted(p.admission.cached(2)) == [8, 9]
    before = p.stats()
    p(0, _x(40), _routing([[2, 10, 11, 12]] * 40))  # 40 > 32 tokens, below 512: split over the cache as it is
    s = p.stats()
    assert s["cpu_experts"] - before.get("cpu_experts", 0) == 3 and s["uploaded_experts"] == before["uploaded_experts"]
    assert s["cold_routes"] - before["cold_routes"] == 120  # expert 2 from its cached copy
    assert sorted(p.admission.cached(0)) == [2, 3, 4, 5]
    p.offload_threshold = 32
    x = _x(40)
    out = p(0, x, _routing([[2, 3, 12, 13]] * 40))  # upload rule: the uncached experts staged, the cached read
    assert p.stats()["uploaded_experts"] == before["uploaded_experts"] + 2
    assert sorted(p.admission.cached(0)) == [2, 3, 4, 5]
    assert torch.allclose(out, moe_forward(x, _routing([[2, 3, 12, 13]] * 40), WEIGHTS[0]), rtol=1e-4, atol=1e-5)


def test_expert_cache_smaller_than_a_pass_computes_the_rest_on_the_cpu():
    p = build_policy("expert-cache", _spec(), _settings(expert_slots=2 + K + E))
    x = _x(2)
    out = p(0, x, _routing([[0, 1, 2, 3], [4, 5, 6, 7]]))
    s = p.stats()
    assert s["uploaded_experts"] == 2 and len(p.admission.cached(0)) == 2 and s["cpu_experts"] == 6
    assert s["cold_routes"] == 8
    want = moe_forward(x, _routing([[0, 1, 2, 3], [4, 5, 6, 7]]), WEIGHTS[0])
    assert torch.allclose(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_baselines_under_a_budget_smaller_than_a_layer(device):
    """12 slots, fewer than K zero + E staging (DeepSeek-V3's bf16 layers under 24 GiB): layers keeps no
    layer and stages a quarter of the budget (3 slots), expert-cache the same 3 beside a cache of 5; a
    pass at the threshold uploads all its experts in waves of 3, and nothing runs on the CPU."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    spec, big = _spec(device), _routing([[0, 1, 2, 3]] * 40 + [[4, 5, 6, 7]] * 24)
    x = _x(64)
    want = moe_forward(x, big, WEIGHTS[0])
    dev = lambda t: TopKOutput(t.ids.to(device), t.weights.to(device))  # noqa: E731
    lay = build_policy("layers", spec, _settings(expert_slots=12, offload_threshold=32))
    assert lay.resident_experts() == 0 and lay.pool.num_slots - lay.pool.flex_lo == 3
    assert torch.allclose(lay(0, x.to(device), dev(big)).cpu(), want, rtol=1e-4, atol=1e-5)
    s = lay.stats()
    assert s["uploaded_experts"] == 8 and s["wave_passes"] == 1 and s.get("cpu_experts", 0) == 0
    lay(0, _x(2).to(device), dev(_routing([[0, 1, 2, 3]] * 2)))  # below the threshold: the CPU
    assert lay.stats()["cpu_experts"] == 4 and lay.stats()["uploaded_experts"] == 8
    cache = build_policy("expert-cache", spec, _settings(expert_slots=12, offload_threshold=32))
    assert cache.resident_experts() == 5 and cache.pool.num_slots - cache.pool.flex_lo == 5 + 3
    cache(0, _x(1).to(device), dev(_routing([[8, 9, 10, 11]])))  # admitted: 4 misses into the cache
    assert sorted(cache.admission.cached(0)) == [8, 9, 10, 11]
    assert torch.allclose(cache(0, x.to(device), dev(big)).cpu(), want, rtol=1e-4, atol=1e-5)
    s = cache.stats()
    assert s["uploaded_experts"] == 4 + 8 and s["wave_passes"] == 1 and s.get("cpu_experts", 0) == 0
    assert sorted(cache.admission.cached(0)) == [8, 9, 10, 11]  # the waves stage above the cache's entries
    for name in ("layers", "expert-cache"):
        with pytest.raises(ConfigError, match="zero"):
            build_policy(name, spec, _settings(expert_slots=K - 1))


def test_decaying_cache_warm_start_and_admission():
    p = build_policy("decaying-cache", _spec(), _settings(expert_slots=4 + K + E, decay=0.9))
    # scores: decode rate / (1 - decay): expert 0: 5.0, 1: 4.7, 13: 1.1, 14: 0.8, 15: 0.5 in every layer;
    # warm: the 4 highest (expert 0 of the three layers, then expert 1 of the first)
    assert sorted(p.admission.cached(0)) == [0, 1] and p.admission.cached(2) == [0] and p.admission.cached(3) == [0]
    p(0, _x(1), _routing([[0, 13, 14, 15]]))  # 13..15: 2.1, 1.8, 1.5 after this use < 4.7: CPU
    s = p.stats()
    assert s["routes"] - s["cold_routes"] == 1 and s["cpu_experts"] == 3 and s.get("uploaded_experts", 0) == 0
    assert p.table_row(0)[14] < 0 and p.table_row(0)[0] >= 0  # 14 ran on the CPU, 0 from the pool
    for _ in range(10):  # a cached expert unused decays; a newcomer used every step overtakes it
        p(0, _x(1), _routing([[0, 13, 14, 15]]))
    assert {13, 14, 15} & set(p.admission.cached(0)) and 1 not in p.admission.cached(0)
    assert p.stats()["uploaded_experts"] >= 1 and p.stats()["evictions"] >= 1
    before, cached = p.stats(), set(p.admission.cached(0))
    p(0, _x(7), _routing([[0, 1, 2, 3]] * 7))  # prefill below the threshold: no admission, the cache as it is
    assert set(p.admission.cached(0)) == cached and p.stats().get("uploaded_experts") == before["uploaded_experts"]
    assert p.stats()["cpu_experts"] - before["cpu_experts"] == len({0, 1, 2, 3} - cached)


def test_fixed_per_layer_ranks_each_layer_by_the_profile():
    p = build_policy("fixed-per-layer", _spec(), _settings())
    assert p.resident_experts() == 30  # (36 - 4 zero slots) // 3 = 10 per layer: experts 0..9 (the most routed)
    p(0, _x(64), _routing([[0, 9, 10, 15]] * 64))  # large pass: no upload, cold on the CPU
    s = p.stats()
    assert s.get("uploaded_experts", 0) == 0 and s["cold_routes"] == 128 and s["cpu_experts"] == 2
    assert [int(p.pool.table_host[0][e]) >= 0 for e in (0, 9, 10, 15)] == [True, True, False, False]
    with pytest.raises(ConfigError, match="profile"):
        build_policy("fixed-per-layer", _spec(), _settings(profile=None))


def test_fixed_uniform_keeps_the_same_ids_in_every_layer_without_a_profile():
    counts = _counts()
    for l in LAYERS:  # a profile that ranks the last experts first: uniform ignores it
        counts.prefill[l] = torch.arange(E)
    p = build_policy("fixed-uniform", _spec(), _settings(profile=counts))
    assert p.resident_experts() == 30 and p.pool.num_slots - p.pool.flex_lo == 0  # no upload path
    for l in LAYERS:
        assert (p.pool.table_host[l] >= 0).nonzero()[:, 0].tolist() == list(range(10))
    p(2, _x(40), _routing([[0, 1, 12, 13]] * 40))
    assert p.stats().get("uploaded_experts", 0) == 0 and p.stats()["cpu_experts"] == 2


def test_ktransformers_runs_the_cross_layer_residency_by_its_rules():
    """Ostinato's residency; below the threshold the cold routes on the CPU, at or above it the
    layer's every cold expert uploaded (not only the pass's), all on the GPU."""
    p = build_policy("ktransformers", _spec(), _settings(offload_threshold=32))
    assert p.resident_experts() == 24 and not p.capturable
    p(0, _x(8), _routing([[0, 1, 8, 9]] * 8))  # below the threshold: split
    s = p.stats()
    assert s["cpu_experts"] == 2 and s.get("uploaded_experts", 0) == 0
    p(0, _x(32), _routing([[0, 1, 8, 9]] * 32))  # at the threshold: all 8 cold experts of layer 0
    s = p.stats()
    assert s["uploaded_experts"] == 8 and s["cpu_experts"] == 2
    with pytest.raises(ConfigError, match="residency"):
        build_policy("ktransformers", _spec(), _settings(residency=None))


def test_ktransformers_runs_the_fill_by_routes_where_ostinato_filled_again_by_time():
    """KTransformers' frequency strategy ranks by routes: a plan the planner filled again by time
    saved (calibration.fill) gives it back its experts by routes; Ostinato runs the plan as made."""
    res = _residency()
    res.calibration = {"fill": {"by": "time saved", "moved": 2, "in": {"0": [12, 13]}, "out": {"0": [6, 7]}}}
    res.hot[0] = [0, 1, 2, 3, 4, 5, 12, 13]
    kt = build_policy("ktransformers", _spec(), _settings(residency=res))
    ours = build_policy("ostinato", _spec(), _settings(residency=res))
    resident = lambda p: (p.pool.table_host[0] >= 0).nonzero()[:, 0].tolist()  # noqa: E731
    assert resident(kt) == list(range(8)) and resident(ours) == [0, 1, 2, 3, 4, 5, 12, 13]


def test_ostinato_policy_split_and_upload_paths():
    p = build_policy("ostinato", _spec(), _settings(upload_threshold=32))
    assert p.resident_experts() == 24 and not p.capturable
    p(0, _x(1), _routing([[0, 1, 8, 9]]))  # decode: 2 hot, 2 cold on the CPU
    s = p.stats()
    assert s["cold_routes"] == 2 and s["cpu_experts"] == 2 and s.get("bytes_uploaded", 0) == 0
    p(0, _x(64), _routing([[0, 1, 8, 9]] * 32 + [[2, 3, 10, 11]] * 32))  # >= Np: upload 4 distinct cold
    s = p.stats()
    assert s["uploaded_experts"] == 4 and s["cold_routes"] == 2 + 128 and s["routes"] - s["cold_routes"] == 2 + 128
    with pytest.raises(ConfigError, match="budget"):
        build_policy("ostinato", _spec(), _settings(expert_slots=8))


def test_bounded_flex_residency_on_the_policies():
    """A plan whose flex slots are bounded (Residency.max_flex): Ostinato's pool has that many, its
    budget (what the baselines share) counts them, an upload-path pass with more distinct cold
    experts uploads them all in waves of that many, and so does ktransformers (its fill's most cold experts
    of a layer, at most the bound); the layers policy keeps its E slots."""
    bounded = Residency("sha256:test", E, {l: list(range(8)) for l in LAYERS}, max_flex=3)
    spec = _spec()
    p = build_policy("ostinato", spec, _settings(residency=bounded, expert_slots=None))
    assert [g.num_slots - g.flex_lo for g in p.pools.groups] == [3]
    assert budget_bytes(spec, PolicySettings(residency=bounded)) == (24 + K + 3) * spec.expert_bytes
    x, ids = _x(64), _routing([[0, 8, 9, 10]] * 32 + [[1, 8, 11, 12]] * 16 + [[2, 9, 13, 12]] * 16)
    got = p(0, x, ids)
    assert torch.allclose(got, moe_forward(x, ids, WEIGHTS[0]), rtol=1e-4, atol=1e-5)
    s = p.stats()  # cold 8-13: two waves of 3, by ascending id, nothing on the CPU
    assert s["uploaded_experts"] == 6 and s.get("cpu_experts", 0) == 0 and s["wave_passes"] == 1
    pool = p.pools.groups[0]
    staged = [next(e for e in range(E) if torch.equal(pool.w13[i], WEIGHTS[0].w13[e]))
              for i in range(pool.flex_lo, pool.num_slots)]
    assert sorted(staged) == [11, 12, 13]
    assert s["cold_routes"] == 64 * 3
    kt = build_policy("ktransformers", spec, _settings(residency=bounded, expert_slots=None, offload_threshold=32))
    assert [g.num_slots - g.flex_lo for g in kt.pools.groups] == [3]
    assert torch.allclose(kt(0, x, ids), moe_forward(x, ids, WEIGHTS[0]), rtol=1e-4, atol=1e-5)
    s = kt.stats()  # every cold expert of the layer (its rule), in waves of 3
    assert s["uploaded_experts"] == E - 8 and s.get("cpu_experts", 0) == 0 and s["wave_passes"] == 1
    build_policy("ktransformers", spec, _settings(residency=bounded, expert_slots=24 + K + 3))  # Ostinato's pool
    with pytest.raises(ConfigError, match="budget"):
        build_policy("ktransformers", spec, _settings(residency=bounded, expert_slots=24 + K + 2))
    build_policy("ostinato", spec, _settings(residency=bounded, expert_slots=24 + K + 3))


def test_budget_is_the_same_for_every_policy():
    spec = _spec()
    assert budget_bytes(spec, PolicySettings(expert_slots=5)) == 5 * spec.expert_bytes
    assert budget_bytes(spec, PolicySettings(budget_bytes=5 * spec.expert_bytes + 7)) == 5 * spec.expert_bytes + 7
    # a residency's pools: its hot experts, the K zero slots and the flex slots (most cold experts of a layer)
    assert budget_bytes(spec, PolicySettings(residency=_residency(3))) == (9 + K + 13) * spec.expert_bytes
    with pytest.raises(ConfigError, match="budget"):
        budget_bytes(spec, PolicySettings())
    with pytest.raises(ConfigError, match="unknown policy"):
        build_policy("nope", spec, _settings())


@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_policies_in_the_whole_model(tiny_dir, device, kept, monkeypatch):
    """Every policy plugged into the engine gives the reference model's logits; also (kept) as the bench
    builds them, over the first placement's host copies of every expert kept as a store, the model's
    experts never loaded again."""
    from ostinato.engine.experts import keep_host_experts
    from ostinato.engine.residency import model_fingerprint
    from ostinato.engine.runner import RunnerSettings
    from ostinato.load import load_engine
    from ostinato.planner.fill import fill
    from ostinato.policies.factory import make_policy, policy_factory, use_policy

    settings = RunnerSettings(device=device, dtype="fp32", max_context=256, prefill_chunk=64)
    ref = load_engine(str(tiny_dir), settings)
    ids = list(range(5, 5 + 80))
    want = ref.runner.forward(ids, 0, all_logits=True)
    want_step = ref.runner.forward([7], len(ids))
    cfg = ref.source.config
    counts = RouteCounts.zeros(cfg.moe_layers, cfg.num_experts)
    for l in cfg.moe_layers:
        counts.decode[l] = torch.arange(cfg.num_experts, 0, -1)
    counts.tokens["decode"] = 10
    ps = PolicySettings(expert_slots=cfg.num_experts * len(cfg.moe_layers) // 2 + 20, profile=counts,
                        offload_threshold=32, cpu_backend="torch", allow_over_budget=True)
    loaded = load_engine(str(tiny_dir), settings, experts_factory=policy_factory("cpu" if kept else "layers", ps))
    if kept:
        assert keep_host_experts(loaded.source, loaded.runner.experts.unwrapped.host)

        def no_load(*a, **kw):
            raise AssertionError("a placement over the kept store loaded the model's experts")
        monkeypatch.setattr("ostinato.engine.experts.load_layer_experts", no_load)
    hot = fill({l: torch.arange(cfg.num_experts, 0, -1) for l in cfg.moe_layers}, 24)
    ps = ps.with_(residency=Residency(model_fingerprint(loaded.source), cfg.num_experts, hot), upload_threshold=32)
    for name in ("layers", "expert-cache", "decaying-cache", "fixed-per-layer", "fixed-uniform", "ktransformers",
                 "cpu", "gpu", "ostinato-split", "ostinato-upload", "ostinato", "ostinato-borrow"):
        if name != "layers" or kept:
            use_policy(loaded, make_policy(name, loaded.source, settings, ps))
        got = loaded.runner.forward(ids, 0, all_logits=True)
        step = loaded.runner.forward([7], len(ids))  # a decode pass too
        assert ((got - want).abs().max() / want.abs().max()) < 1e-4, name
        assert ((step - want_step).abs().max() / want_step.abs().max()) < 1e-4, name
        assert loaded.runner.placement_stats()["routes"] > 0
        if name == "ostinato-split":  # the ablation's first Ostinato step has no upload path
            assert loaded.runner.experts.upload_threshold is None and loaded.runner.experts.borrow is None
    use_policy(loaded, make_policy("cpu", loaded.source, settings, ps))  # closes (and unpins) the last one


def test_release_frees_the_backend_at_once(tiny_dir, tmp_path):
    """bench builds each policy's pool after releasing the last one: the old backend (with its
    borrowing, a reference cycle) must be gone by then, not at some later garbage collection."""
    import gc
    import weakref

    from ostinato.engine.placement import PlacementSettings
    from ostinato.engine.runner import RunnerSettings
    from ostinato.load import load_engine
    from ostinato.loader.source import CheckpointSource
    from ostinato.policies.factory import release
    from tests.test_hybrid import _residency_for

    _residency_for(CheckpointSource(tiny_dir), 0.5).save(tmp_path / "half.json")
    loaded = load_engine(str(tiny_dir), RunnerSettings(device="cpu", max_context=256),
                         PlacementSettings(residency=str(tmp_path / "half.json"), borrow=True))
    backend = loaded.runner.experts
    assert backend.borrow is not None  # the cycle: hybrid -> borrowing -> hybrid
    ref = weakref.ref(backend)
    del backend
    gc.disable()  # only release() may collect
    try:
        release(loaded)
        assert ref() is None
    finally:
        gc.enable()


def test_a_policy_that_runs_out_of_gpu_memory_says_what_did_not_fit(tiny_dir, monkeypatch):
    """The allocator's own first line (what it tried to allocate, what was free) reaches the
    refusal: a bench run that skips a policy says why."""
    from ostinato.engine.runner import RunnerSettings
    from ostinato.sources import open_source
    from ostinato.policies import factory

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 384.00 MiB. GPU 0 ...\nthe allocator's advice")

    monkeypatch.setattr(factory, "build_policy", out_of_memory)
    with pytest.raises(ConfigError, match=r"decaying-cache: .*\(CUDA out of memory. Tried to allocate 384.00 MiB"):
        factory.make_policy("decaying-cache", open_source(str(tiny_dir)),
                            RunnerSettings(device="cpu", dtype="fp32", max_context=64), PolicySettings(expert_slots=10))
