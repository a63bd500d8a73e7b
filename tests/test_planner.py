"""Residency planning: fill, capacity test, cost model, one-switch Np; plan / calibrate CLI on tiny."""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ostinato.config import ModelConfig
from ostinato.engine.sizes import dense_parts, dense_weight_bytes
from ostinato.planner import cost_model as cm
from ostinato.planner.capacity import (GiB, CapacityError, CapacitySettings, activation_bytes, flex_slots,
                                       max_hot_slots, plan_capacity)
from ostinato.planner.fill import cold_routes, fill
from ostinato.synth.presets import preset_config

FAST = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def route_counts(draw, max_layers=3, max_experts=4):
    L = draw(st.integers(1, max_layers))
    E = draw(st.integers(1, max_experts))
    layers = sorted(draw(st.sets(st.integers(0, 9), min_size=L, max_size=L)))
    vals = draw(st.lists(st.integers(0, 50), min_size=L * E, max_size=L * E))
    return {l: torch.tensor(vals[i * E:(i + 1) * E]) for i, l in enumerate(layers)}


def _cold(counts, chosen: set[tuple[int, int]]) -> float:
    hot = {l: [e for (ll, e) in chosen if ll == l] for l in counts}
    return cold_routes(counts, hot)[0]


@FAST
@given(route_counts(), st.data())
def test_fill_minimises_cold_routes_brute_force(counts, data):
    items = [(l, e) for l, c in counts.items() for e in range(c.numel())]
    slots = data.draw(st.integers(0, len(items)))
    got = cold_routes(counts, fill(counts, slots))[0]
    best = min(_cold(counts, set(s)) for s in itertools.combinations(items, slots))
    assert got == best
    assert sum(map(len, fill(counts, slots).values())) == slots


@FAST
@given(route_counts(max_layers=4, max_experts=16), st.data())
def test_fill_beats_any_alternative_of_the_same_size(counts, data):
    items = [(l, e) for l, c in counts.items() for e in range(c.numel())]
    slots = data.draw(st.integers(0, len(items)))
    other = data.draw(st.permutations(items))[:slots]
    assert cold_routes(counts, fill(counts, slots))[0] <= _cold(counts, set(other))


@FAST
@given(route_counts(max_layers=4, max_experts=16), st.data())
def test_bigger_capacity_never_adds_cold_routes(counts, data):
    n = sum(c.numel() for c in counts.values())
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    small, big = fill(counts, a), fill(counts, b)
    assert cold_routes(counts, big)[0] <= cold_routes(counts, small)[0]
    assert all(set(small[l]) <= set(big[l]) for l in counts)  # nested: the flex fixed point relies on it


def _tiny_cfg(**over) -> ModelConfig:
    return ModelConfig.from_dict({**preset_config("tiny"), **over})


def test_dense_weights_and_activations_are_counted_from_the_config():
    cfg = _tiny_cfg()
    D, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    attn = D * cfg.num_attention_heads * cfg.head_dim * 2 + D * cfg.num_key_value_heads * cfg.head_dim * 2
    norms = 2 * cfg.head_dim + 2 * D
    params = V * D + L * (attn + norms + cfg.num_experts * D) + D  # the head; the embedding stays on the host
    assert not cfg.tie_word_embeddings and dense_weight_bytes(cfg, torch.bfloat16) == 2 * params
    tied = _tiny_cfg(tie_word_embeddings=True)  # one table, read by the head on the GPU every step
    assert dense_weight_bytes(tied, torch.bfloat16) == 2 * params
    assert dense_parts(cfg, torch.bfloat16)[1] == 0 and dense_parts(tied, torch.bfloat16)[1] == 2 * V * D
    a = activation_bytes(cfg, 64, 1000, torch.bfloat16, score_share=1.0)  # torch's math kernel
    assert a["total"] == sum(v for k, v in a.items() if k != "total")
    assert activation_bytes(cfg, 64, 2000, torch.bfloat16, score_share=1.0)["attention"] > a["attention"]
    unscored = activation_bytes(cfg, 64, 1000, torch.bfloat16, score_share=0.0)  # the math kernel, no scores held
    assert a["attention"] - unscored["attention"] == 13 * cfg.num_attention_heads * 64 * 1000
    # by default, the model's: Qwen3's prefill attends in SDPA's fused kernels on a GPU in half precision: no
    # scores, no mask, nothing in fp32 but the log-sum-exp; K/V repeated to H heads beside the window as read
    H, Hkv, Hd, b = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 2
    fused = activation_bytes(cfg, 64, 1000, torch.bfloat16)
    assert fused["attention"] == 64 * H * 3 * Hd * b + 64 * H * 4 + (H + Hkv) * 1000 * 2 * Hd * b
    assert fused["attention"] < unscored["attention"] and {k: v for k, v in fused.items() if k not in (
        "attention", "total")} == {k: v for k, v in unscored.items() if k not in ("attention", "total")}
    assert activation_bytes(cfg, 64, 1000, torch.float32) == activation_bytes(cfg, 64, 1000, torch.float32, 1.0)
    # the bound the plan counts for its largest pass is pass_bound's (what profile_decode --prefill sets beside
    # a measured pass)
    from ostinato.planner.capacity import pass_bound

    counts = {l: torch.ones(cfg.num_experts) for l in cfg.moe_layers}
    cap = plan_capacity(cfg, counts, 2**40, 1000, torch.bfloat16, CapacitySettings(prefill_chunk=64,
                                                                                   pass_graph_rows=0))
    assert cap.activations == pass_bound(cfg, 64, 1000, torch.bfloat16)["total"] == fused["total"]
    # captured prefill passes (engine/graph.py PassGraphs) keep a pool of their own: the largest's buffers
    # attending to its own rows (the split-K kernel reads the cache in place) and the kernel's partials: 32
    # tokens' 64 rows a KV head (G = 2) in one block, its window of at most 1000 keys in 16 splits of 64
    graphed = plan_capacity(cfg, counts, 2**40, 1000, torch.bfloat16, CapacitySettings(prefill_chunk=64,
                                                                                       pass_graph_rows=32))
    assert cfg.num_attention_heads // cfg.num_key_value_heads == 2
    partials = cfg.num_key_value_heads * 16 * 64 * (cfg.head_dim + 2) * 4
    join_rows = 32 * cfg.hidden_size * 4  # the CPU worker's partial copied into device rows (CopyJoin)
    assert graphed.activation_parts["pass_graphs"] == pass_bound(cfg, 32, 32, torch.bfloat16, score_share=0.0)[
        "total"] + partials + join_rows
    assert graphed.activations == cap.activations + graphed.activation_parts["pass_graphs"]
    big = plan_capacity(cfg, counts, 2**40, 1000, torch.bfloat16, CapacitySettings(prefill_chunk=64,
                                                                                   pass_graph_rows=5000))
    assert big.activation_parts["pass_graphs"] > graphed.activation_parts["pass_graphs"]  # at most the cache's rows
    assert big.activation_parts["pass_graphs"] == plan_capacity(
        cfg, counts, 2**40, 1000, torch.bfloat16, CapacitySettings(prefill_chunk=64, pass_graph_rows=1000)
    ).activation_parts["pass_graphs"]
    # one device of a split model captures no passes: nothing counted for them
    half = plan_capacity(cfg, counts, 2**40, 1000, torch.bfloat16,
                         CapacitySettings(prefill_chunk=64, pass_graph_rows=32),
                         layers=list(range(cfg.num_hidden_layers // 2)), last=False)
    assert "pass_graphs" not in half.activation_parts and half.activations == cap.activations


@FAST
@given(st.integers(0, 200), st.integers(16, 4096))
def test_capacity_is_the_flex_fixed_point(extra_slots, kv_tokens):
    cfg = _tiny_cfg()
    g = torch.Generator().manual_seed(extra_slots)
    counts = {l: torch.randint(0, 100, (cfg.num_experts,), generator=g) for l in cfg.moe_layers}
    s = CapacitySettings(margin_bytes=0, margin_fraction=0.0, prefill_chunk=512)
    probe = plan_capacity(cfg, counts, 2**40, kv_tokens, torch.float32, s)
    budget = probe.fixed + (cfg.num_experts_per_tok + cfg.num_experts + extra_slots) * probe.expert_bytes
    cap = plan_capacity(cfg, counts, budget, kv_tokens, torch.float32, s)
    slots = (budget - cap.fixed) // cap.expert_bytes
    K, E, total = cfg.num_experts_per_tok, cfg.num_experts, len(cfg.moe_layers) * cfg.num_experts
    # the flex bound: a quarter of the pool's bytes (one format group)
    assert cap.max_flex == int(0.25 * (budget - cap.fixed)) // cap.expert_bytes
    assert cap.flex_slots == flex_slots(counts, cap.hot_slots, E, cap.max_flex) <= cap.max_flex
    assert cap.hot_slots + K + cap.flex_slots <= slots and cap.unused >= 0
    if cap.hot_slots < total:  # one more hot expert does not fit
        assert cap.hot_slots + 1 + K + flex_slots(counts, cap.hot_slots + 1, E, cap.max_flex) > slots
    bigger = plan_capacity(cfg, counts, budget + 7 * cap.expert_bytes, kv_tokens, torch.float32, s)
    assert bigger.hot_slots >= cap.hot_slots


@FAST
@given(route_counts(max_layers=4, max_experts=16), st.data())
def test_bounded_flex_keeps_the_bisection_exact(counts, data):
    """flex(s) = min(M, most cold experts of a layer under fill(s)): s + K + flex(s) never decreases
    in s, so the bisection finds the largest s that fits, as a scan does; flex never exceeds M."""
    E = max(c.numel() for c in counts.values())
    counts = {l: torch.nn.functional.pad(c, (0, E - c.numel())) for l, c in counts.items()}
    total, K = len(counts) * E, 2
    M = data.draw(st.integers(0, E + 1))
    slots = data.draw(st.integers(0, total + K + E))
    need = [s + K + flex_slots(counts, s, E, M) for s in range(total + 1)]
    assert all(a <= b for a, b in zip(need, need[1:]))
    assert all(flex_slots(counts, s, E, M) <= M for s in range(total + 1))
    fits = [s for s in range(total + 1) if need[s] <= slots]
    assert max_hot_slots(counts, slots, K, E, M) == (max(fits) if fits else -1)


def _skewed(cfg, seed=0, a=0.8):
    """Zipf-like routes per layer (experts in a random order per layer)."""
    g = torch.Generator().manual_seed(seed)
    E = cfg.num_experts
    return {l: (1e5 / torch.arange(1, E + 1).double() ** a)[torch.randperm(E, generator=g)].long()
            for l in cfg.moe_layers}


def test_deepseek_v3_shape_plans_under_24_gib_with_bounded_flex():
    """Issue [O]: DeepSeek-V3's 256 experts of 84 MiB (bf16). Unbounded, the flex slots (a layer's
    cold experts, up to 256: 21 GiB) refuse the plan before any expert is resident; bounded (a
    quarter of the pool's bytes), it keeps experts resident. The activations are taken as a fused
    attention kernel's (--attention-scores 0): MLA's materialised scores are another matter."""
    cfg = ModelConfig.from_dict(preset_config("deepseek-v3-shaped"))
    E, counts = cfg.num_experts, _skewed(cfg)
    s = CapacitySettings(attention_score_share=0.0)
    with pytest.raises(CapacityError, match="zero and flex slots"):
        plan_capacity(cfg, counts, 24 * GiB, 4096, torch.bfloat16, CapacitySettings(attention_score_share=0.0,
                                                                                    max_flex=E))
    cap = plan_capacity(cfg, counts, 24 * GiB, 4096, torch.bfloat16, s)
    pool = cap.budget - cap.fixed
    assert cap.expert_bytes == 84 * 2**20 and cap.max_flex == int(0.25 * pool) // cap.expert_bytes < E
    assert cap.hot_slots > 0 and cap.flex_slots == cap.max_flex and cap.unused >= 0
    assert cap.flex_slots * cap.expert_bytes <= 0.25 * pool
    assert cap.to_json()["max_flex"] == cap.max_flex and any(f"flex <= {cap.max_flex}" in w for w, _ in cap.table())
    pinned = plan_capacity(cfg, counts, 24 * GiB, 4096, torch.bfloat16, CapacitySettings(attention_score_share=0.0,
                                                                                        max_flex=8))
    assert pinned.flex_slots == 8 and pinned.hot_slots > cap.hot_slots


@pytest.mark.parametrize("preset,cap_gib", [("qwen3-30b-a3b", 12), ("qwen3-30b-a3b", 32)])
def test_default_flex_bound_leaves_128_expert_plans_unchanged(preset, cap_gib):
    """The default bound (a quarter of the pool) does not bind on a 128-expert model at these caps, even
    with a profile that leaves some layer nearly all cold."""
    cfg = ModelConfig.from_dict(preset_config(preset))
    counts = _skewed(cfg, a=1.5)
    s = CapacitySettings(attention_score_share=0.0)
    bounded = plan_capacity(cfg, counts, cap_gib * GiB, 4096, torch.bfloat16, s)
    free = plan_capacity(cfg, counts, cap_gib * GiB, 4096, torch.bfloat16,
                         CapacitySettings(attention_score_share=0.0, max_flex=cfg.num_experts))
    assert (bounded.hot_slots, bounded.flex_slots) == (free.hot_slots, free.flex_slots)
    assert bounded.max_flex >= cfg.num_experts


def test_pool_sizing_the_three_ways():
    """planner/pipeline.py, which `plan` and `bench` share: a cap sizes the pool by the capacity
    test, a hot fraction as its experts + K zero + flex slots (and must fit a cap given with it),
    bytes for slots directly; with none of them it says what to give."""
    from ostinato.config import ConfigError
    from ostinato.planner.pipeline import size_pool

    cfg = _tiny_cfg()
    g = torch.Generator().manual_seed(3)
    counts = {l: torch.randint(0, 100, (cfg.num_experts,), generator=g) for l in cfg.moe_layers}
    K, E, total = cfg.num_experts_per_tok, cfg.num_experts, len(cfg.moe_layers) * cfg.num_experts
    s = CapacitySettings(margin_bytes=0, margin_fraction=0.0, prefill_chunk=512)
    probe = plan_capacity(cfg, counts, 2**40, 256, torch.float32, s)
    budget = probe.fixed + (K + E + total // 2) * probe.expert_bytes
    by_cap = size_pool(cfg, counts, torch.float32, gpu_memory=budget, kv_tokens=256, capacity=s)
    cap = plan_capacity(cfg, counts, budget, 256, torch.float32, s)
    assert by_cap.hot == cap.hot_slots and by_cap.pool_slots == (budget - cap.fixed) // cap.expert_bytes
    assert by_cap.capacity == cap
    assert by_cap.max_flex == cap.max_flex is not None  # the bound goes into the plan
    by_f = size_pool(cfg, counts, torch.float32, hot_fraction=0.25)
    hot = round(0.25 * total)
    assert by_f.hot == hot and by_f.pool_slots == hot + K + flex_slots(counts, hot, E) and by_f.capacity is None
    assert by_f.max_flex is None  # no pool's bytes to take a share of: unbounded unless max_flex says
    pinned = size_pool(cfg, counts, torch.float32, hot_fraction=0.25, capacity=CapacitySettings(max_flex=1))
    assert pinned.max_flex == 1 and pinned.pool_slots == hot + K + flex_slots(counts, hot, E, 1)
    with pytest.raises(CapacityError, match="do not fit"):
        size_pool(cfg, counts, torch.float32, hot_fraction=1.0, gpu_memory=budget, kv_tokens=256, capacity=s)
    by_b = size_pool(cfg, counts, torch.float32, expert_budget=by_cap.pool_slots * by_cap.expert_bytes)
    assert (by_b.pool_slots, by_b.hot) == (by_cap.pool_slots, by_cap.hot)
    with pytest.raises(ConfigError, match="give --gpu-memory"):
        size_pool(cfg, counts, torch.float32)
    with pytest.raises(ConfigError, match="cannot hold"):
        size_pool(cfg, counts, torch.float32, expert_budget=K * by_cap.expert_bytes)


def test_capacity_fails_clearly_when_dense_and_kv_do_not_fit():
    cfg = ModelConfig.from_dict(preset_config("qwen3-30b-a3b"))
    counts = {l: torch.ones(cfg.num_experts) for l in cfg.moe_layers}
    with pytest.raises(CapacityError) as e:
        plan_capacity(cfg, counts, 4 * 2**30, 16384, torch.bfloat16)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("--gpu-memory 4.0 GiB cannot hold the dense weights (")
    assert "KV cache of 16384 tokens (1.5 GiB)" in msg and "need at least" in msg
    with pytest.raises(CapacityError, match="do not fit"):
        plan_capacity(cfg, counts, 32 * 2**30, 16384, torch.bfloat16, slots=len(counts) * cfg.num_experts)
    cap = plan_capacity(cfg, counts, 32 * 2**30, 4096, torch.bfloat16)
    assert 0.35 < cap.hot_slots / (len(counts) * cfg.num_experts) < 0.5  # BENCHMARK.md: about 40% fit


@st.composite
def monotone_curves(draw):
    n = draw(st.integers(1, 8))
    sizes = sorted(draw(st.sets(st.integers(1, 4096), min_size=n, max_size=n)))
    inc = draw(st.lists(st.floats(0.01, 10), min_size=n, max_size=n))
    dec = draw(st.lists(st.floats(0.01, 10), min_size=n, max_size=n))
    start = draw(st.floats(-20, 40))
    split = list(itertools.accumulate(inc))  # grows with cold routes
    diff = [start - x for x in itertools.accumulate(dec)]  # upload - split: strictly decreasing
    return sizes, split, [s + d for s, d in zip(split, diff)]


@FAST
@given(monotone_curves())
def test_np_switches_once_on_monotone_curves(curves):
    sizes, split, upload = curves
    np_, crossings = cm.one_switch(sizes, split, upload)
    cheaper = [u < s for s, u in zip(split, upload)]
    assert crossings <= 1
    if np_ is None:
        assert not cheaper[-1]
    else:
        assert cheaper == [n >= np_ for n in sizes]  # split below Np, upload from Np on: one switch


@FAST
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 10)), min_size=1, max_size=10))
def test_np_on_noisy_curves_is_the_last_crossing(points):
    sizes = [64 * (i + 1) for i in range(len(points))]
    split, upload = [p[0] for p in points], [p[1] for p in points]
    np_, crossings = cm.one_switch(sizes, split, upload)
    cheaper = [u < s for s, u in points]
    assert crossings == sum(a != b for a, b in zip(cheaper, cheaper[1:]))
    if np_ is None:
        assert not cheaper[-1]
        return
    i = sizes.index(np_)
    assert all(cheaper[i:]) and (i == 0 or not cheaper[i - 1])


def test_np_noisy_example():
    sizes = [64, 128, 256, 512, 1024, 2048]
    split = [1, 2, 3, 4, 5, 6]
    upload = [3, 1.5, 3.5, 3, 4, 5]  # cheaper at 128, not at 256, cheaper from 512 on
    assert cm.one_switch(sizes, split, upload) == (512, 3)
    assert cm.one_switch(sizes, split, [9] * 6) == (None, 0)
    assert cm.one_switch(sizes, split, [0] * 6) == (64, 0)


@st.composite
def layer_case(draw):
    E = draw(st.integers(2, 10))
    K = draw(st.integers(1, min(4, E)))
    w = torch.tensor(draw(st.lists(st.floats(0.05, 1.0), min_size=E, max_size=E)), dtype=torch.float64)
    p = (K * w / w.sum()).clamp(max=0.97)
    hot = torch.tensor(draw(st.lists(st.booleans(), min_size=E, max_size=E)))
    cost = cm.LayerCost(*(draw(st.floats(0.0, 1.0)) for _ in range(4)))
    return p, hot, K, cost


@FAST
@given(layer_case())
def test_expected_max_matches_monte_carlo(case):
    p, hot, K, cost = case
    law = cm.route_law(p, K)
    exact = cm.expected_layer_time(cm.cold_route_distribution(p, hot, K, law=law), cost)
    # sample the law: independent Bernoulli(w / (1 + w)) conditioned on exactly K selected
    g = torch.Generator().manual_seed(0)
    w = torch.from_numpy(law.w)
    x = torch.rand(80000, p.numel(), generator=g, dtype=torch.float64) < w / (1 + w)
    x = (x | torch.from_numpy(law.always))[x.sum(1) == law.k]
    assume(x.shape[0] >= 2000)
    r = (x & ~hot).sum(1)
    table = torch.tensor([cost.layer(v) for v in range(K + 1)], dtype=torch.float64)
    vals = table[r]
    se = float(vals.std()) / math.sqrt(vals.numel())
    assert abs(exact - float(vals.mean())) <= 5 * se + 1e-9
    # the law keeps the profile's per-expert route probabilities
    pn = p * K / p.sum()
    if (pn < 1).all():
        assert torch.allclose(x.double().mean(0), pn, atol=5 * 0.5 / math.sqrt(x.shape[0]))
    # the binomial law against its own sampling
    q = float(p[~hot].sum() / p.sum())
    exact_b = cm.expected_layer_time(cm.cold_route_distribution(p, hot, K, "binomial"), cost)
    rb = (torch.rand(40000, K, generator=g, dtype=torch.float64) < q).sum(1)
    vb = table[rb]
    assert abs(exact_b - float(vb.mean())) <= 5 * float(vb.std()) / math.sqrt(vb.numel()) + 1e-9


@FAST
@given(layer_case())
def test_cold_route_law_respects_top_k_and_the_profile(case):
    p, hot, K, _ = case
    p = p * K / p.sum()  # a profile's probabilities sum to K
    assume(bool((p < 1).all()))
    dist = cm.cold_route_distribution(p, hot, K)
    assert dist.shape == (K + 1,) and abs(float(dist.sum()) - 1) < 1e-9 and (dist >= 0).all()
    n_cold, n_hot = int((~hot).sum()), int(hot.sum())
    for r in range(K + 1):
        if r > n_cold or K - r > n_hot:
            assert dist[r] == 0
    assert cm.expected_cold_routes(dist) == pytest.approx(float(p[~hot].sum()), abs=1e-6)


def test_decode_prediction_and_pool_saving():
    K, E = 2, 8
    counts = {0: torch.tensor([90, 60, 20, 10, 10, 5, 3, 2]), 1: torch.tensor([50] * 4 + [0] * 4)}
    costs = {0: cm.LayerCost(G=0.05, gamma0=0.01, alpha=0.03, beta=0.13), 1: cm.LayerCost(0.05, 0.01, 0.03, 0.13)}
    hot_all = {0: list(range(E)), 1: list(range(E))}
    pred = cm.predict_decode_step(counts, 100, hot_all, costs, K, dense_ms=1.0)
    assert pred.total_ms == pytest.approx(1.0 + 2 * 0.05)  # no cold expert: GPU only
    small, big = {0: [0], 1: [0, 1]}, {0: [0, 1, 2], 1: [0, 1, 2, 3]}
    saving, s, b = cm.pool_saving(counts, 100, small, big, costs, K, dense_ms=1.0)
    assert saving > 0 and s.cold_routes_per_layer > b.cold_routes_per_layer
    assert b.cold_routes[1] == pytest.approx(0.0)  # layer 1 routes only to its 4 hot experts
    # expected cold routes are the profile's: K times the cold share
    q0 = float(counts[0][3:].sum() / counts[0].sum())
    assert b.cold_routes[0] == pytest.approx(K * q0, rel=1e-6)


def test_prefill_model_saturates_and_picks_np():
    p = torch.tensor([0.5, 0.4, 0.3, 0.3, 0.2, 0.1, 0.1, 0.1], dtype=torch.float64)
    assert cm.expected_distinct(p[4:], 1) == pytest.approx(0.5)
    assert cm.expected_distinct(p[4:], 10_000) == pytest.approx(4.0)
    pc = cm.PassCosts(alpha=0.05, beta_expert=0.1, beta_route=0.01, upload_gbps=50, expert_bytes=9_437_184,
                      sizes=(64, 2048), gpu_hot_ms=(0.1, 1.0), gpu_all_ms=(0.12, 1.2))
    sizes = [16 * i for i in range(1, 129)]
    np_, crossings, curve = cm.model_threshold({0: p, 1: p}, {0: [0, 1, 2, 3], 1: [0, 1]}, pc, sizes)
    assert crossings == 1 and np_ is not None
    assert all((u < s) == (n >= np_) for n, s, u in curve)


def _cli(*args) -> int:
    from ostinato.cli import main

    return main([str(a) for a in args])


@pytest.fixture(scope="module")
def tiny_profile(tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "profile.json"
    assert _cli("profile", "--model", tiny_dir, "--sessions", "embedded:2", "--max-context", 384,
                "--device", "cpu", "-o", path) == 0
    return path


def test_profile_records_longest_request_and_skew(tiny_profile, capsys):
    from ostinato.engine.routes import RouteCounts

    prof = RouteCounts.load(tiny_profile)
    assert prof.sessions == 2 and prof.max_tokens == 384  # the streams are cut at --max-context
    shares = prof.layer_top_shares(0.4)
    assert all(0.4 <= v <= 1 for v in shares.values())
    assert RouteCounts.from_json(json.loads(json.dumps(prof.to_json()))).max_tokens == 384


def test_plan_and_calibrate_end_to_end(tiny_dir, tiny_profile, tmp_path, capsys):
    from ostinato.engine.placement import PlacementSettings
    from ostinato.engine.residency import Residency
    from ostinato.engine.routes import RouteCounts
    from ostinato.engine.runner import RunnerSettings
    from ostinato.load import load_engine
    from ostinato.sources import open_source

    cfg = open_source(tiny_dir).config
    counts = RouteCounts.load(tiny_profile).total("all")
    s = CapacitySettings(margin_bytes=0, margin_fraction=0.0)
    probe = plan_capacity(cfg, counts, 2**40, 384, torch.float32, s)
    budget = probe.fixed + (cfg.num_experts_per_tok + 40) * probe.expert_bytes
    res_path = tmp_path / "res.json"
    common = ["--model", tiny_dir, "--profile", tiny_profile, "--device", "cpu", "--margin", 0, "--margin-fraction", 0]
    assert _cli("plan", *common, "--held-out", tiny_profile, "--gpu-memory", budget, "-o", res_path) == 0
    out = capsys.readouterr().out
    assert "capacity test" in out and "held-out routes on the GPU" in out and "verification skipped" in out
    res = Residency.load(res_path)
    total = len(cfg.moe_layers) * cfg.num_experts
    assert 0 < res.hot_count < total and res.gpu_memory == budget
    assert res.capacity["hot_slots"] == res.hot_count and res.capacity["kv_tokens"] == 384
    assert "cold_routes_per_token_layer" in res.notes["report"]["development"]
    # the flex bound the test counted goes into the plan: a quarter of the pool's 44 slots
    assert res.max_flex == res.capacity["max_flex"] == 11 and res.capacity["flex_slots"] <= 11
    assert _cli("plan", *common, "--gpu-memory", budget, "--max-flex", 3, "-o", tmp_path / "f.json") == 0
    pinned = Residency.load(tmp_path / "f.json")
    assert pinned.max_flex == 3 and pinned.capacity["flex_slots"] <= 3 and pinned.hot_count >= res.hot_count
    assert "flex <= 3 a group" in capsys.readouterr().out

    # too small a budget: one clear line, exit status 2
    assert _cli("plan", *common, "--gpu-memory", probe.fixed // 2, "-o", tmp_path / "x.json") == 2
    err = capsys.readouterr().err.strip()
    assert "cannot hold the dense weights" in err and "\n" not in err
    # several GPUs: --gpu-memory per device, layers split (more in tests/test_multi_device.py)
    assert _cli("plan", *common, "--gpu-memory", budget, "--devices", "cuda:0,cuda:1", "-o", tmp_path / "y.json") == 0
    split = Residency.load(tmp_path / "y.json")
    assert list(split.devices) == ["cuda:0", "cuda:1"]
    assert split.max_flex == min(d["max_flex"] for d in split.capacity["devices"].values())
    capsys.readouterr()

    assert _cli("calibrate", "--model", tiny_dir, "--residency", res_path, "--device", "cpu", "--cpu-threads", 1,
                "--sizes", "8,16,32", "--reps", 2, "--pass-layers", 2, "--sessions", "embedded:1",
                "--cpu-backend", "torch") == 0
    out = capsys.readouterr().out
    assert "Np (upload_threshold) measured" in out
    cal = Residency.load(res_path).calibration
    assert set(cal["layers"]) == {str(l) for l in cfg.moe_layers}
    assert all(d["G_ms"] > 0 and len(d["C_ms"]) == cfg.num_experts_per_tok + 1 for d in cal["layers"].values())
    assert cal["upload_gbps"] > 0 and cal["passes"]["sizes"] == [8, 16, 32]
    assert isinstance(cal["upload_threshold"], int) and cal["model"]["decode_step_ms"] > 0
    assert cal["host_read_gbps"] > 0 and cal["host_read_probe"] == "torch-sum"  # the torch backend's probe
    for key in ("device", "date", "torch", "global", "cpu_pass", "dense_step_ms"):
        assert key in cal
    loaded = load_engine(str(tiny_dir), RunnerSettings(device="cpu", max_context=64),
                         PlacementSettings(residency=str(res_path), cpu_backend="torch"))
    # the plan kept the upload path and the engine uses the measured Np, or it dropped it (its gain and
    # cost recorded) for more hot experts in the same pool bytes, and the engine has no Np and no flex slots
    up = cal["upload_path"]
    assert "upload path " in out and {"gain_ms", "cost_ms", "hot_with_flex", "hot_without_flex"} <= set(up)
    h, res = loaded.runner.experts, Residency.load(res_path)
    if up["on"]:
        assert h.upload_threshold == cal["upload_threshold"] and res.hot_count == up["hot_with_flex"]
    else:
        assert h.upload_threshold is None and all(p.num_slots == p.flex_lo for p in h.pools.groups)
        assert res.hot_count == up["hot_without_flex"] >= up["hot_with_flex"] and up["gain_ms"] <= up["cost_ms"]
        assert res.upload_plan().hot_count == up["hot_with_flex"]


def test_spread_shares_a_small_sample_between_sources():
    from types import SimpleNamespace

    from ostinato.sessions.read import spread

    items = [SimpleNamespace(source="swe", i=i) for i in range(3)] + [SimpleNamespace(source="tau2", i=i)
                                                                      for i in range(40)]
    two = spread(items, 2)
    assert sorted(x.source for x in two) == ["swe", "tau2"]
    five = spread(items, 5)
    assert sum(x.source == "swe" for x in five) == 3 and len(five) == 5 and len({id(x) for x in five}) == 5
    assert spread(list(range(10)), 3) == [0, 3, 6] and spread(items, 100) == items


def test_graph_step_fit_recovers_the_constants_it_was_built_from():
    from ostinato.planner.measure.decode import fit_graph_steps

    costs = {l: cm.LayerCost(G=0.02, gamma0=0.03, alpha=0.5, beta=0.5) for l in range(6)}
    rs = [0, 1, 2, 4, 8]
    # layer 5 has no cold expert: it is never forced cold
    r_of = {r: {l: (0 if l == 5 else r) for l in range(6)} for r in rs}
    dense, alpha, beta = 3.0, 0.04, 0.07
    measured = {r: dense + sum(max(alpha + beta * r_of[r][l], 0.02) if r_of[r][l] else 0.02 for l in range(6))
                for r in rs}
    out = fit_graph_steps(measured, measured[0] + 0.5, 32 + 1000, r_of, costs)
    assert out["dense_step_ms"] == pytest.approx(dense)
    assert out["graph_fit"]["alpha_ms"] == pytest.approx(alpha) and out["graph_fit"]["beta_ms"] == pytest.approx(beta)
    assert out["forced_steps"]["model_ms"] == pytest.approx([measured[r] for r in rs])
    assert out["dense_ms_per_1k_context"] == pytest.approx(0.5)
    # the cost model then uses the graph fit for every layer, not the host-side constants
    layer = cm.layer_costs({"global": {"G_ms": 0.02, "gamma0_ms": 0.03, "alpha_ms": 0.5, "beta_ms": 0.5},
                            "graph_fit": out["graph_fit"]}, [0])[0]
    assert layer.cpu(2) == pytest.approx(alpha + 2 * beta) and layer.cpu(0) == 0.0
    # and the GPU branch as timed inside a graph, where the calibration has it; host-driven, the eager one
    glob = {"G_ms": 0.25, "G_graph_ms": 0.03, "gamma0_ms": 0.03, "alpha_ms": 0.5, "beta_ms": 0.5}
    assert cm.layer_costs({"global": glob, "graph_fit": out["graph_fit"]}, [0])[0].G == 0.03
    assert cm.layer_costs({"global": glob}, [0])[0].G == 0.25


def test_bound_reads_at_the_best_measured_rate():
    eb = 9_437_184
    # the kernel's own rate per cold route (eb / beta) beat the probe: the bound takes it
    cal = {"expert_bytes": eb, "host_read_gbps": 80.0, "graph_fit": {"beta_ms": 0.077}, "global": {"beta_ms": 0.5}}
    assert cm.read_gbps(cal) == pytest.approx(eb / 0.077e6)
    assert cm.read_gbps({**cal, "host_read_gbps": 200.0}) == 200.0
    assert cm.read_gbps({"expert_bytes": eb, "global": {"beta_ms": 0.1}}) == pytest.approx(eb / 0.1e6)
    assert cm.read_gbps({}) is None


def test_quantized_experts_count_the_dequantized_paths_scratch(dequant_from_512):
    """Where a tuning takes it (here from 512 tokens), a pass the dequantized path serves (gpu_quant: T >=
    dequant_min_tokens) holds a chunk of bf16
    experts beside the pool: the capacity test counts it for quantized experts, not for bf16 ones nor
    for passes below the threshold, and the pool holds that much less."""
    from ostinato.engine.sizes import expert_sizes
    from ostinato.layers.moe.gpu_quant import DEFAULT_QUANT_TUNING, dequant_scratch_bytes
    from ostinato.loader.build import WeightFormats

    cfg = _tiny_cfg()
    counts = {l: torch.arange(cfg.num_experts, dtype=torch.float32) for l in cfg.moe_layers}
    q8 = {l: ("Q8_0", "Q8_0") for l in cfg.moe_layers}  # blocks of 32: the tiny rows hold them
    big, small = CapacitySettings(prefill_chunk=2048), CapacitySettings(prefill_chunk=256)
    assert small.prefill_chunk < DEFAULT_QUANT_TUNING["dequant_min_tokens"] == dequant_from_512 <= big.prefill_chunk
    qb = expert_sizes(cfg, torch.bfloat16, q8)[cfg.moe_layers[0]][1]
    want = dequant_scratch_bytes(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, 2, qb)
    budget = 8 * 2**30
    quant = plan_capacity(cfg, counts, budget, 2048, torch.bfloat16, big, formats=WeightFormats(q8))
    assert quant.activation_parts["dequant_scratch"] == want > 0
    assert plan_capacity(cfg, counts, budget, 2048, torch.bfloat16, big).activation_parts["dequant_scratch"] == 0
    below = plan_capacity(cfg, counts, budget, 2048, torch.bfloat16, small, formats=WeightFormats(q8))
    assert below.activation_parts["dequant_scratch"] == 0


def test_the_calibration_printout_shows_the_paired_timing(capsys):
    """`ostinato calibrate` prints the split with uploads beside the split path timed with it, and on
    how many layers it won (what MixedPass.from_calibration decides on), on session 16's H200 figures."""
    import json
    from pathlib import Path

    from ostinato.jobs.plan import print_calibration

    path = Path(__file__).resolve().parents[1] / "results/2026-12-02-h200-s16/bench/res-cap.json"
    cal = json.loads(path.read_text())["calibration"]
    cal["passes"].update(split_paired_ms=[4.5, 5.6, 6.3, 7.1, 7.2, 8.0, 9.0, 13.2], mixed_wins=[3, 4, 4, 4, 4, 4, 4, 4],
                         paired_layers=4)
    print_calibration(cal)
    out = capsys.readouterr().out
    assert "paired split  layers won (of 4)" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("64 "))
    assert row.split()[-2:] == ["4.500", "3"]


def test_calibrating_a_plan_again_starts_from_its_fill_by_routes(tiny_dir, tiny_profile, tmp_path, capsys,
                                                                  monkeypatch):
    """`ostinato calibrate` on a plan it filled again by time saved: measured on the plan by routes
    (Residency.frequency_plan), filled again the same way; the record of what moved survives, so the
    ktransformers baseline still runs the fill by routes."""
    import ostinato.planner.calibrate as calibrate
    from ostinato.engine.residency import Residency
    from ostinato.engine.routes import RouteCounts

    cfg_counts = RouteCounts.load(tiny_profile)
    measure = calibrate.calibrate

    def priced(*a, **kw):  # the H200 machine's prices of a cold route (a 2-core quick fit can find none)
        cal = measure(*a, **kw)
        return {**cal, "global": {**cal["global"], "beta_ms": 0.079},
                "layers": {l: {**c, "beta_ms": 0.079} for l, c in cal["layers"].items()},
                "cpu_pass": {**cal["cpu_pass"], "beta_expert_ms": 0.080, "beta_route_ms": 0.0028}}

    monkeypatch.setattr(calibrate, "calibrate", priced)
    res_path = tmp_path / "res.json"
    common = ["--model", tiny_dir, "--device", "cpu", "--max-context", 64]
    assert _cli("plan", *common, "--profile", tiny_profile, "--hot-fraction", 0.4, "--no-verify", "-o", res_path) == 0
    by_routes = Residency.load(res_path).hot
    calib = ["calibrate", *common[:4], "--residency", res_path, "--cpu-threads", 1, "--sizes", "8,16", "--reps", 1,
             "--pass-layers", 1, "--sessions", "embedded:1", "--cpu-backend", "torch"]
    assert _cli(*calib) == 0
    first = Residency.load(res_path)
    assert first.calibration["fill"]["moved"] > 0 and first.frequency_plan().hot == by_routes
    assert cfg_counts.prompts and "fill by time saved" in capsys.readouterr().out
    assert _cli(*calib) == 0
    again = Residency.load(res_path)
    assert again.calibration["fill"]["moved"] == first.calibration["fill"]["moved"]
    assert again.frequency_plan().hot == by_routes and again.upload_plan().hot == first.upload_plan().hot


def test_plan_and_bench_share_the_margin_flags():
    """--margin and --margin-fraction reach the capacity test from plan and from bench alike; left out,
    CapacitySettings' defaults hold (1 GiB, no share of the budget)."""
    from ostinato.bench.cli import _bench_settings
    from ostinato.cli import build_parser
    from ostinato.jobs.plan import _capacity_settings

    p = build_parser()
    flags = ["--margin", "512MiB", "--margin-fraction", "0.02"]
    bench = _bench_settings(p.parse_args(["bench", "--model", "synth:tiny", *flags]))
    assert bench.margin == {"margin_bytes": 512 * 2**20, "margin_fraction": 0.02}
    planned = _capacity_settings(p.parse_args(["plan", "--model", "synth:tiny", "-o", "r.json", *flags]))
    assert (planned.margin_bytes, planned.margin_fraction) == (512 * 2**20, 0.02)
    assert _bench_settings(p.parse_args(["bench", "--model", "synth:tiny"])).margin == {}
    default = _capacity_settings(p.parse_args(["plan", "--model", "synth:tiny", "-o", "r.json"]))
    assert (default.margin_bytes, default.margin_fraction) == (2**30, 0.0) == (CapacitySettings().margin_bytes,
                                                                                 CapacitySettings().margin_fraction)
    from ostinato.config import ConfigError

    for bad in (["--margin-fraction", "-0.1"], ["--margin-fraction", "1"], ["--margin", "lots"]):  # refused when read
        with pytest.raises(ConfigError, match="margin|size"):
            _bench_settings(p.parse_args(["bench", "--model", "synth:tiny", *bad]))
