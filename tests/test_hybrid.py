"""Hybrid experts (pool + index tables + zero slots + CPU branch + upload) against the
plain-PyTorch reference MoE, on every path; and a whole model under a residency."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from ostinato.config import ConfigError
from ostinato.engine.residency import Residency, model_fingerprint
from ostinato.layers.moe.cpu_experts import CpuExperts
from ostinato.layers.moe.hybrid import HybridExperts, MixedPass, choose_path, upload_plan
from ostinato.layers.moe.pool import ExpertPool, HostExperts, gather_rows
from ostinato.layers.moe.reference import moe_forward
from ostinato.layers.moe.router import route
from ostinato.layers.moe.types import ExpertWeights, TopKOutput

E, K, D, F = 16, 4, 64, 32
LAYERS = [0, 2]


def _experts(seed):
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(torch.randn(E, 2 * F, D, generator=g) / D ** 0.5, torch.randn(E, D, F, generator=g) / F ** 0.5)


def _hybrid(hot_fraction, upload_threshold, backend="torch", device="cpu", dtype=torch.float32, flex=None):
    """flex: the pool's flex slots (default: the most cold experts of a layer, unbounded)."""
    weights = {l: _experts(l) for l in LAYERS}
    n_hot = round(hot_fraction * E)
    g = torch.Generator().manual_seed(7)
    hot = {l: torch.randperm(E, generator=g)[:n_hot].tolist() for l in LAYERS}
    cold = {l: sorted(set(range(E)) - set(hot[l])) for l in LAYERS}
    flex = max(len(c) for c in cold.values()) if flex is None else flex
    pool = ExpertPool(hot, 3, E, K, flex, (2 * F, D), (D, F), device, dtype)
    host = HostExperts(cold, E, (2 * F, D), (D, F), dtype)
    for l in LAYERS:
        w = ExpertWeights(weights[l].w13.to(dtype), weights[l].w2.to(dtype))
        pool.fill_layer(l, w)
        host.fill_layer(l, w)
    cpu = CpuExperts(host.layers, num_threads=1, backend=backend)
    return HybridExperts(pool, host, cpu, upload_threshold, max_tokens=512), weights


# split with uploads: one upload costs about a CPU expert's routes, so passes of several
# tokens upload some cold experts and compute the others on the CPU
MIXED = MixedPass(upload_ms=0.2, alpha_ms=0.1, beta_expert_ms=0.05, beta_route_ms=0.05)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tokens", [1, 7, 64, 512])
@pytest.mark.parametrize("hot_fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("path", ["split", "upload", "mixed"])
def test_hybrid_matches_reference(tokens, hot_fraction, path, device):
    """CPU: fp32 and the torch CPU backend; CUDA: bf16, the Triton slot kernels and the
    native CPU kernel (torch where it cannot build), against the fp32 reference."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    hybrid, weights = _hybrid(hot_fraction, upload_threshold=1 if path == "upload" else 10**9,
                              backend="torch" if device == "cpu" else "auto", device=device, dtype=dtype)
    if path == "mixed":
        hybrid.mixed = MIXED
    g = torch.Generator().manual_seed(tokens)
    for layer in LAYERS:
        x = torch.randn(tokens, D, generator=g)
        topk = route(torch.randn(tokens, E, generator=g), K, True, x.dtype)
        if device == "cpu":
            got = hybrid(layer, x, topk)
            want = moe_forward(x, topk, weights[layer])
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
            continue
        xb = x.to(dtype)  # the reference on the same bf16 inputs and weights, in fp32
        w = weights[layer]
        rounded = type(w)(w.w13.to(dtype).float(), w.w2.to(dtype).float())
        want = moe_forward(xb.float(), topk, rounded)
        got = hybrid(layer, xb.to(device), TopKOutput(topk.ids.to(device), topk.weights.to(device))).float().cpu()
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 2e-2, err
    stats = hybrid.stats()
    assert stats["routes"] == 2 * tokens * K
    if hot_fraction == 1.0:
        assert stats.get("cold_routes", 0) == 0 and stats.get("bytes_uploaded", 0) == 0
    if hot_fraction == 0.0:
        assert stats["cold_routes"] == 2 * tokens * K
        assert (stats.get("bytes_uploaded", 0) > 0) == (path == "upload" or path == "mixed" and tokens > 1)
    if path == "mixed" and hot_fraction < 1.0:  # decode never uploads; a pass of 7+ tokens does
        assert stats.get("mixed_passes", 0) == (2 if tokens > 1 else 0)
        if tokens == 7:  # both links: some cold experts uploaded, the others on the CPU
            assert 0 < stats["uploaded_experts"] and stats["cpu_experts"] > 0


# split with uploads on a CPU so slow that it would upload every cold expert: the flex slots decide
UPLOAD_ALL = MixedPass(upload_ms=1.0, alpha_ms=0.0, beta_expert_ms=0.0, beta_route_ms=100.0)
FLEX = 2  # flex slots, fewer than the distinct cold experts of most passes (E = 16, K = 4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tokens", [1, 7, 64, 512])
@pytest.mark.parametrize("hot_fraction", [0.0, 0.5])
@pytest.mark.parametrize("path", ["upload", "mixed"])
def test_fewer_flex_slots_than_cold_experts(tokens, hot_fraction, path, device):
    """A bounded flex region (planner/capacity.py): a pass routing to more distinct cold experts than
    the FLEX slots uploads them all in waves of FLEX on the upload path, and the FLEX most-routed in a
    split with uploads, the others on the CPU; the result is the reference MoE's, and the counters say
    what went where."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    hybrid, weights = _hybrid(hot_fraction, upload_threshold=1 if path == "upload" else 10**9,
                              backend="torch" if device == "cpu" else "auto", device=device, dtype=dtype, flex=FLEX)
    if path == "mixed":
        hybrid.mixed = UPLOAD_ALL
    pool = hybrid.pool
    assert pool.num_slots - pool.flex_lo == FLEX
    g = torch.Generator().manual_seed(100 + tokens)
    uploaded = on_cpu = waves = cold_routes = 0
    for layer in LAYERS:
        x = torch.randn(tokens, D, generator=g)
        topk = route(torch.randn(tokens, E, generator=g), K, True, x.dtype)
        cold = pool.table_host[layer][topk.ids] < 0
        experts, routes = torch.unique(topk.ids[cold], return_counts=True)
        order = torch.argsort(routes, descending=True, stable=True)
        distinct, cold_routes = experts.numel(), cold_routes + int(cold.sum())
        # decode takes the split path with no upload where `mixed` runs it; the upload path uploads
        # every distinct cold expert, in waves of FLEX
        ups = distinct if path == "upload" else min(distinct, FLEX) if tokens > 1 else 0
        uploaded, on_cpu = uploaded + ups, on_cpu + distinct - ups
        waves += path == "upload" and distinct > FLEX
        if device == "cpu":
            got = hybrid(layer, x, topk)
            want = moe_forward(x, topk, weights[layer])
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
        else:
            w = weights[layer]
            rounded = type(w)(w.w13.to(dtype).float(), w.w2.to(dtype).float())
            want = moe_forward(x.to(dtype).float(), topk, rounded)
            got = hybrid(layer, x.to(dtype).to(device), TopKOutput(topk.ids.to(device), topk.weights.to(device)))
            err = float((got.float().cpu() - want).abs().max() / want.abs().max())
            assert err < 2e-2, err
        if ups and distinct > FLEX:  # the staging slots hold the mixed pass's most-routed cold experts, the
            # upload path's last wave (its experts in ascending ids)
            staged = {int(e) for e in (experts[order[:FLEX]] if path == "mixed" else experts[-FLEX:])}
            held = [next(e for e in staged if torch.equal(pool.w13[s].cpu().float(), weights[layer].w13[e].to(dtype)
                                                          .float())) for s in range(pool.flex_lo, pool.num_slots)]
            assert set(held) == staged
    stats = hybrid.stats()
    assert waves == 2 or tokens == 1 or path == "mixed"  # a pass of 7+ tokens routes to more than FLEX
    assert stats.get("uploaded_experts", 0) == uploaded and stats.get("cpu_experts", 0) == on_cpu
    assert stats.get("wave_passes", 0) == waves
    assert path == "mixed" or tokens == 1 or on_cpu == 0
    assert stats.get("mixed_passes", 0) == (2 if path == "mixed" and tokens > 1 else 0)
    assert stats["cold_routes"] == cold_routes and stats["routes"] == 2 * tokens * K


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_calibrations_all_staged_branch_under_fewer_flex_slots_than_cold_experts(device):
    """The calibration's GPU branch over a pass's cold experts staged (planner/measure/prefill.py
    all_staged_slots) under a bounded flex region: the first FLEX of them in the flex slots, the others at
    the zero slots, so the branch is the reference MoE over the hot and staged experts' routes alone. It
    gave the others slot -1: on the CPU the last flex slot's expert, on CUDA a device-side assert in the
    prefill kernels' alignment (DeepSeek-V3-shaped, 31 flex slots of 256 experts, session 51)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from ostinato.planner.measure.prefill import all_staged_slots
    from ostinato.planner.measure.timing import gpu_branch

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    hybrid, weights = _hybrid(0.5, upload_threshold=10**9, device=device, dtype=dtype, flex=FLEX)
    pool, layer, T = hybrid.pool, 2, 512
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, D, generator=g)
    topk = route(torch.randn(T, E, generator=g), K, True, x.dtype)
    cold_ids = torch.unique(topk.ids[pool.table_host[layer][topk.ids] < 0])
    assert cold_ids.numel() > FLEX
    staged = cold_ids[:FLEX]
    pool.upload(list(range(pool.flex_lo, pool.num_slots)), hybrid.host, layer, staged.tolist())
    ids = topk.ids.to(device)
    slots = all_staged_slots(pool, layer, cold_ids, ids).cpu()
    on_gpu = (pool.table_host[layer][topk.ids] >= 0) | torch.isin(topk.ids, staged)
    assert torch.equal(slots >= pool.flex_lo, torch.isin(topk.ids, staged))
    assert ((slots >= pool.zero_lo) & (slots < pool.zero_hi)).eq(~on_gpu).all()
    w = weights[layer]
    rounded = type(w)(w.w13.to(dtype).float(), w.w2.to(dtype).float())
    want = moe_forward(x.to(dtype).float(), TopKOutput(topk.ids, topk.weights * on_gpu), rounded)
    got = gpu_branch(hybrid, layer, x.to(dtype).to(device), ids, topk.weights.to(device), slots.to(device))
    err = float((got.float().cpu() - want).abs().max() / want.abs().max())
    assert err < (1e-5 if device == "cpu" else 2e-2), err


def test_no_flex_slot_runs_the_upload_path_as_the_split_path():
    """flex 0 (a bound of 0, or a pool too small for any): every cold route on the CPU, nothing uploaded."""
    hybrid, weights = _hybrid(0.5, upload_threshold=1, flex=0)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, D, generator=g)
    topk = route(torch.randn(64, E, generator=g), K, True, x.dtype)
    assert torch.allclose(hybrid(0, x, topk), moe_forward(x, topk, weights[0]), rtol=1e-4, atol=1e-5)
    s = hybrid.stats()
    assert s.get("uploaded_experts", 0) == 0 and s.get("wave_passes", 0) == 0 and s["cpu_experts"] == 8


def test_mixed_pass_choice_balances_the_two_links():
    m = MixedPass(upload_ms=1.0, alpha_ms=0.0, beta_expert_ms=0.0, beta_route_ms=1.0)
    assert m.choose([1, 1, 1, 1], limit=10) == 2  # 2 uploads || 2 CPU routes
    assert m.choose([6, 1, 1], limit=10) == 1  # the busiest expert goes over PCIe
    assert m.choose([6, 1, 1], limit=0) == 0  # no free flex slot: the plain split path
    assert m.choose([1], limit=10) == 0  # a tie keeps the CPU (no transfer)
    slow_cpu = MixedPass(upload_ms=1.0, alpha_ms=0.0, beta_expert_ms=0.0, beta_route_ms=100.0)
    assert slow_cpu.choose([3, 2, 1], limit=10) == 3  # the upload path's transfers
    fast_cpu = MixedPass(upload_ms=100.0, alpha_ms=0.0, beta_expert_ms=0.0, beta_route_ms=1.0)
    assert fast_cpu.choose([3, 2, 1], limit=10) == 0
    for routes in ([5, 3, 3, 2, 1], [9, 1], [2, 2, 2]):  # choose = the minimum of cost_ms
        k = m.choose(routes, limit=10)
        assert m.cost_ms(routes, k) == min(m.cost_ms(routes, j) for j in range(len(routes) + 1))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=70), st.integers(0, 80),
       st.tuples(*[st.floats(0.0, 1.0, allow_nan=False)] * 4))
def test_mixed_pass_choice_is_the_first_least_cost(routes, limit, costs):
    """choose: the smallest count of the least cost_ms over 0..min(n, limit), as a loop over every
    count finds it."""
    routes = sorted(routes, reverse=True)
    m = MixedPass(*costs)
    k = m.choose(np.array(routes, dtype=np.int64), limit)
    cost = [m.cost_ms(routes, j) for j in range(min(len(routes), limit) + 1)]
    assert k == cost.index(min(cost))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(1, 8), st.integers(0, 2**32 - 1), st.integers(0, 20))
def test_upload_plan_takes_the_most_routed_cold_experts_first(tokens, k, seed, limit):
    rng = np.random.default_rng(seed)
    num_experts = 16
    ids = np.stack([rng.choice(num_experts, k, replace=False) for _ in range(tokens)])
    cold = np.isin(ids, rng.choice(num_experts, 9, replace=False))
    up = upload_plan(ids, cold, num_experts, lambda routes, n: min(len(routes), n), limit)
    counts = Counter(ids[cold].tolist())
    expected = sorted(counts, key=lambda e: (-counts[e], e))[:limit]
    assert up.tolist() == expected


def test_zero_slots_and_table():
    hybrid, _ = _hybrid(0.5, upload_threshold=10**9)
    pool = hybrid.pool
    assert pool.w13[pool.zero_lo:pool.zero_hi].abs().sum() == 0
    ids = torch.arange(E).view(-1, K)
    slots = pool.slots_for(0, ids)
    hot = pool.table_host[0] >= 0
    for t in range(ids.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            assert int(slots[t, j]) == (int(pool.table_host[0, e]) if hot[e] else pool.zero_lo + j)
    assert pool.num_hot == hot.sum() + (pool.table_host[2] >= 0).sum()


def test_fills_copy_each_expert_to_its_slot_and_host_row_a_few_at_a_time():
    """Pool and host fills gather a layer's experts in chunks (pool.gather_rows), so that a layer made
    on the GPU is never copied whole there: every expert still lands where the tables say."""
    hybrid, weights = _hybrid(0.5, upload_threshold=10**9)  # 8 hot and 8 cold experts per layer
    pool, host = hybrid.pool, hybrid.host
    for l in LAYERS:
        for e in range(E):
            slot, row = int(pool.table_host[l, e]), int(host.compact[l][e])
            assert (slot >= 0) != (row >= 0)
            got = (pool.w13[slot], pool.w2[slot]) if slot >= 0 else (host.layers[l].w13[row], host.layers[l].w2[row])
            assert torch.equal(got[0], weights[l].w13[e]) and torch.equal(got[1], weights[l].w2[e])
    src, ids = torch.arange(40.0).view(20, 2), torch.tensor([19, 3, 4, 0, 7, 8, 9, 10, 11, 2, 5])
    parts = list(gather_rows(src, ids, chunk=4))
    assert [i for i, _ in parts] == [0, 4, 8] and [len(r) for _, r in parts] == [4, 4, 3]
    assert torch.equal(torch.cat([r for _, r in parts]), src[ids])


def _residency_for(source, fraction, seed=0):
    cfg = source.config
    g = torch.Generator().manual_seed(seed)
    n = round(fraction * cfg.num_experts)
    hot = {l: torch.randperm(cfg.num_experts, generator=g)[:n].tolist() for l in cfg.moe_layers}
    return Residency(model_fingerprint(source), cfg.num_experts, hot)


@pytest.mark.parametrize("threshold,max_flex", [(10**9, None), (16, None), (16, 2)])
def test_whole_model_hybrid_matches_reference(tiny_dir, tmp_path, threshold, max_flex):
    """max_flex: the plan's bound on the flex slots (Residency.max_flex), which the engine allocates;
    upload-path passes with more distinct cold experts upload them all, two at a time."""
    from ostinato.engine.placement import PlacementSettings
    from ostinato.engine.runner import RunnerSettings
    from ostinato.load import load_engine

    settings = RunnerSettings(device="cpu", dtype="fp32", max_context=256, prefill_chunk=64)
    ref = load_engine(str(tiny_dir), settings)
    res = _residency_for(ref.source, 0.5)
    res.max_flex = max_flex
    res.save(tmp_path / "r.json")
    assert Residency.load(tmp_path / "r.json").max_flex == max_flex
    hyb = load_engine(str(tiny_dir), settings, PlacementSettings(residency=str(tmp_path / "r.json"),
                                                                 upload_threshold=threshold))
    pool, cfg = hyb.runner.experts.unwrapped.pool, ref.source.config
    assert pool.num_slots - pool.flex_lo == (max_flex if max_flex is not None else cfg.num_experts // 2)
    ids = list(range(5, 5 + 100))
    a = ref.runner.forward(ids, 0, all_logits=True)
    b = hyb.runner.forward(ids, 0, all_logits=True)
    assert ((a - b).abs().max() / a.abs().max()) < 1e-4
    stats = hyb.runner.placement_stats()
    assert stats["cold_routes"] > 0
    assert (stats.get("bytes_uploaded", 0) > 0) == (threshold == 16)
    assert (stats.get("wave_passes", 0) > 0) == (max_flex is not None)
    if max_flex is not None:  # both chunks (64 + 36 tokens) of each MoE layer upload together in waves of 2
        # (tests/test_layer_major.py): one wave pass a layer, each expert copied once, nothing on the CPU
        assert stats["wave_passes"] == len(cfg.moe_layers)
        assert stats.get("restaged_experts", 0) == 0 and stats.get("cpu_experts", 0) == 0


def test_residency_file_checks(tiny_dir, tmp_path):
    from ostinato.loader.source import CheckpointSource

    src = CheckpointSource(tiny_dir)
    res = _residency_for(src, 0.25)
    res.save(tmp_path / "r.json")
    back = Residency.load(tmp_path / "r.json")
    assert back.hot == {l: sorted(v) for l, v in res.hot.items()}
    back.check(src)
    d = json.loads((tmp_path / "r.json").read_text())
    d["fingerprint"] = "sha256:" + "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="another model"):
        Residency.load(tmp_path / "other.json").check(src)
    d["version"] = 99
    (tmp_path / "v.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="version"):
        Residency.load(tmp_path / "v.json")
    with pytest.raises(ConfigError, match="no such residency"):
        Residency.load(tmp_path / "missing.json")


def test_mixed_pass_only_where_the_calibration_measured_a_gain():
    cal = {"cpu_pass": {"alpha_ms": 1.0, "beta_expert_ms": 0.04, "beta_route_ms": 0.01}, "upload_gbps": 50.0,
           "expert_bytes": 9_437_184, "passes": {"sizes": [64, 512], "split_ms": [5.0, 17.0],
                                                "upload_ms": [10.0, 13.0]}}
    assert MixedPass.from_calibration(cal) is None  # never timed
    unmeasured = MixedPass.from_calibration(cal, measured=False)  # the calibration times it at every size
    assert unmeasured.upload_ms == pytest.approx(9_437_184 / 50e9 * 1e3) and unmeasured.min_tokens == 2
    cal["passes"]["mixed_ms"] = [7.8, 12.0]  # slower than split at 64, faster than upload at 512 (sum 19.8 > 18)
    assert MixedPass.from_calibration(cal).min_tokens == 512  # a sum over the sizes would have said never
    cal["passes"]["mixed_ms"] = [3.5, 9.0]
    assert MixedPass.from_calibration(cal).min_tokens == 64
    assert MixedPass.from_calibration(cal).max_tokens is None  # faster at the largest size: no upper bound
    cal["passes"]["mixed_ms"] = [3.5, 14.0]  # faster at 64 only: up to 64
    m = MixedPass.from_calibration(cal)
    assert (m.min_tokens, m.max_tokens) == (64, 64) and m.applies(64) and not m.applies(65)
    cal["passes"]["mixed_ms"] = [5.5, 14.0]  # faster at no size: never
    assert MixedPass.from_calibration(cal) is None
    # session 15's calibration on the H200 machine (results/2026-12-02-h200-s15/): it loses below 384 tokens
    cal["passes"] = {"sizes": [64, 128, 256, 384, 512, 768, 1024, 2048],
                     "split_ms": [4.90, 5.09, 6.05, 7.85, 7.13, 8.71, 9.76, 14.25],
                     "upload_ms": [10.18, 11.12, 12.04, 13.00, 12.58, 12.82, 13.14, 13.67],
                     "mixed_ms": [4.96, 5.83, 6.27, 6.78, 6.78, 7.47, 8.05, 9.82]}
    m = MixedPass.from_calibration(cal)
    assert m.min_tokens == 384 and not m.applies(383) and m.applies(384)
    # the sizes need not come sorted
    p = cal["passes"]
    cal["passes"] = {k: v[::-1] for k, v in p.items()}
    assert MixedPass.from_calibration(cal).min_tokens == 384


def test_a_paired_calibration_needs_the_uploads_to_win_on_every_layer():
    """Session 16's two calibrations of one plan on the H200 machine, minutes apart, timed the split
    path at 64 tokens at 4.42 and 3.70 ms: a drift as large as what uploads save on short passes.
    Timed in pairs (measure_mixed), a size counts only where the uploads won on every layer."""
    cal = {"cpu_pass": {"alpha_ms": 1.0, "beta_expert_ms": 0.04, "beta_route_ms": 0.01}, "upload_gbps": 50.0,
           "expert_bytes": 9_437_184,
           "passes": {"sizes": [64, 256, 1024, 2048], "split_ms": [4.4, 6.4, 9.1, 13.4],
                      "upload_ms": [9.7, 12.3, 13.1, 13.7], "mixed_ms": [4.3, 5.7, 6.6, 7.9],
                      "split_paired_ms": [4.5, 5.9, 9.0, 13.2], "mixed_wins": [3, 4, 4, 4], "paired_layers": 4}}
    assert MixedPass.from_calibration(cal).min_tokens == 256  # faster on the mean at 64, but one layer lost
    cal["passes"]["split_paired_ms"] = [4.5, 5.6, 9.0, 13.2]  # the paired split beats it at 256: from 1024
    assert MixedPass.from_calibration(cal).min_tokens == 1024
    cal["passes"]["mixed_wins"] = [4, 4, 4, 3]  # one layer lost at the largest: 1024 alone
    m = MixedPass.from_calibration(cal)
    assert (m.min_tokens, m.max_tokens) == (1024, 1024)
    cal["passes"]["mixed_wins"] = [3, 4, 3, 3]
    assert MixedPass.from_calibration(cal) is None


def test_a_quantized_calibration_uploads_in_part_over_the_sizes_it_won():
    """Session 18's calibration of the Q4_K_M 235B shape on the H200 machine (results/2026-12-04-h200-s21/
    bench_235b_8k/residency.json), at two decimals: the split with uploads won on every layer timed
    from 64 to 512 tokens, by 1.7x over the upload path at 256, tied at 768 (it won there by 0.003 ms
    in the file) and lost above. A tool turn (261 new tokens, median) takes it; a 2048-token chunk
    takes the upload path (Np 256)."""
    cal = {"cpu_pass": {"alpha_ms": 0.434, "beta_expert_ms": 0.0433, "beta_route_ms": 0.0342}, "upload_gbps": 53.25,
           "expert_bytes": 11_427_840,
           "passes": {"sizes": [64, 128, 256, 384, 512, 768, 1024, 2048],
                      "split_ms": [11.15, 17.48, 30.73, 47.76, 62.22, 100.70, 129.13, 230.50],
                      "upload_ms": [19.72, 23.09, 25.71, 29.19, 27.96, 28.43, 29.47, 29.96],
                      "mixed_ms": [7.93, 11.23, 14.77, 17.77, 26.55, 28.43, 31.88, 35.84],
                      "split_paired_ms": [9.84, 18.76, 30.34, 45.21, 61.87, 90.16, 126.72, 228.53],
                      "mixed_wins": [4] * 8, "paired_layers": 4}}
    m = MixedPass.from_calibration(cal)
    assert (m.min_tokens, m.max_tokens) == (64, 512) and m.window() == "64-512"
    assert [choose_path(T, True, 256, m) for T in (32, 64, 261, 512, 513, 2048)] == \
        ["split", "split", "split", "split", "upload", "upload"]
    assert choose_path(261, True, 256, None) == "upload"  # the rule before: every tool turn uploaded


def test_measure_mixed_times_both_paths_in_alternating_pairs():
    from ostinato.planner.measure.prefill import measure_mixed

    class H:  # stands in for HybridExperts: split_path's cost depends on whether uploads are on
        mixed = "before"

        def forget_staged(self):  # every timed pass copies its uploads
            order.append("forget")

        def split_path(self, layer, x, topk):
            order.append((layer, self.mixed is not None))

    class Clock:  # a machine that slows down by 1% a call, and a first call per layer that is slow
        def wall(self, f):
            f()
            layer, up = order[-1]
            first = sum(1 for o in order if o[0] == layer) == 1
            speed = 0.8 if up and layer == 0 else 1.05 if up else 1.0
            return (50.0 if first else speed) * (1 + 0.01 * len(order))

    order, h = [], H()
    routing = {l: (torch.zeros(8, 4), TopKOutput(torch.zeros(8, 2, dtype=torch.long), torch.ones(8, 2)))
               for l in (0, 1)}
    out = measure_mixed(h, routing, {"sizes": [4, 8], "layers": [0, 1]}, "on", Clock(), reps=4)
    assert order[:2] == ["forget", (0, False)] and order.count("forget") == len(order) // 2
    order = [o for o in order if o != "forget"]
    assert h.mixed == "before"  # restored
    assert out["paired_layers"] == 2 and out["mixed_wins"] == [1, 1]  # uploads win on layer 0 only
    # 2 (warm-up) + 2 x 4 timed calls per layer and size, alternating ABBA so that drift falls on both
    assert len(order) == 2 * 2 * 10
    assert [up for l, up in order[:6]] == [False, True, True, False, False, True]
    assert out["mixed_ms"][0] < out["split_paired_ms"][0]  # 0.8 and 1.05 against 1.0, before the drift
    assert max(out["mixed_ms"] + out["split_paired_ms"]) < 2


def test_passes_below_the_mixed_size_take_the_plain_paths():
    m = MixedPass(upload_ms=0.2, alpha_ms=0.1, beta_expert_ms=0.05, beta_route_ms=0.05, min_tokens=384)
    assert choose_path(100, True, 256, m) == "split"  # below Np: the plain split path
    assert choose_path(300, True, 256, m) == "upload"  # at Np, below min_tokens: the upload path
    assert choose_path(384, True, 256, m) == "split"  # from min_tokens: split with uploads
    assert choose_path(1, True, 1, m) == "upload"  # a decode step never takes the split with uploads
    assert choose_path(500, False, 256, m) == "gpu"
    hybrid, weights = _hybrid(0.5, upload_threshold=10**9)
    hybrid.mixed = replace(MIXED, min_tokens=8)  # MIXED uploads in passes of 7 (test_hybrid_matches_reference)
    g = torch.Generator().manual_seed(3)
    for tokens, mixed_passes in ((7, 0), (8, 1)):
        x = torch.randn(tokens, D, generator=g)
        topk = route(torch.randn(tokens, E, generator=g), K, True, x.dtype)
        got = hybrid(0, x, topk)
        assert torch.allclose(got, moe_forward(x, topk, weights[0]), rtol=1e-4, atol=1e-5)
        assert hybrid.stats().get("mixed_passes", 0) == mixed_passes


def test_uploads_copy_weights_and_biases_into_the_slots_given():
    """ExpertPool.upload, the one copy of cold experts into pool slots (upload path, split with
    uploads, caches, borrowed memory): each expert of the list into its slot, biases too."""
    from ostinato.config import SILU

    g = torch.Generator().manual_seed(5)
    w = ExpertWeights(torch.randn(E, 2 * F, D, generator=g), torch.randn(E, D, F, generator=g),
                      torch.randn(E, 2 * F, generator=g), torch.randn(E, D, generator=g), SILU)
    pool = ExpertPool({0: [0, 1]}, 1, E, K, 3, (2 * F, D), (D, F), "cpu", torch.float32, bias=True)
    pool.fill_layer(0, w)
    host = HostExperts({0: list(range(2, E))}, E, (2 * F, D), (D, F), torch.float32, bias=True)
    host.fill_layer(0, w)
    slots, experts = [pool.flex_lo + 2, pool.flex_lo], [9, 3]
    assert pool.upload(slots, host, 0, experts) == 2 * pool.expert_bytes
    for s, e in zip(slots, experts):
        for got, want in ((pool.w13, w.w13), (pool.w2, w.w2), (pool.b13, w.b13), (pool.b2, w.b2)):
            assert torch.equal(got[s], want[e])


def test_a_long_pass_runs_layer_by_layer_and_stages_each_layer_once(tiny_dir, tmp_path):
    """A pass of three chunks on the upload path (engine/devices.py forward_layer_major): the same logits, to
    the bit, as its chunks run one after the other through the whole model (the flex slots hold a layer's
    cold experts: one wave); but each layer stages its chunks' cold experts once for all three, where one
    chunk after the other each copies its own again (the other layers' uploads overwrote them in between)."""
    from ostinato.engine.placement import PlacementSettings
    from ostinato.engine.runner import RunnerSettings
    from ostinato.load import load_engine

    settings = RunnerSettings(device="cpu", dtype="fp32", max_context=256, prefill_chunk=40)
    source = load_engine(str(tiny_dir), settings).source
    _residency_for(source, 0.5).save(tmp_path / "r.json")
    place = PlacementSettings(residency=str(tmp_path / "r.json"), upload_threshold=16, cpu_backend="torch")
    ids = list(range(7, 7 + 120))
    layered, chunked = (load_engine(str(tiny_dir), settings, place) for _ in range(2))
    a = layered.runner.forward(ids, 0, all_logits=True)
    b = torch.cat([chunked.runner.forward(ids[s:s + 40], s, all_logits=True) for s in range(0, 120, 40)])
    assert torch.equal(a, b)
    one, three = layered.runner.placement_stats(), chunked.runner.placement_stats()
    assert one["cold_routes"] == three["cold_routes"] and one.get("restaged_experts", 0) == 0
    assert one["uploaded_experts"] < three["uploaded_experts"] and one["bytes_uploaded"] < three["bytes_uploaded"]


def test_staging_keeps_what_the_flex_slots_still_hold():
    """ExpertPool.stage: a layer's experts still in flex slots keep them; the others take the other flex slots
    from the top down, whatever they held; upload() keeps the record of whose copy each slot holds."""
    w = _experts(3)
    pool = ExpertPool({0: [0, 1], 1: [0]}, 2, E, K, 4, (2 * F, D), (D, F), "cpu", torch.float32)
    host = HostExperts({0: list(range(2, E)), 1: list(range(1, E))}, E, (2 * F, D), (D, F), torch.float32)
    for layer in (0, 1):
        pool.fill_layer(layer, w)
        host.fill_layer(layer, w)
    top = pool.num_slots - 1
    assert pool.stage(0, [5, 6]) == ([top, top - 1], [0, 1])  # nothing staged yet: from the top, both copied
    pool.upload([top, top - 1], host, 0, [5, 6])
    assert pool.stage(0, [6, 7, 5]) == ([top - 1, top - 2, top], [1])  # 5 and 6 still there: 7 alone is copied
    assert pool.stage(1, [6]) == ([top], [0])  # another layer's 6 is another expert
    pool.upload([top], host, 1, [6])  # which overwrites layer 0's 5
    assert pool.stage(0, [5, 6]) == ([top, top - 1], [0])  # 5 again, into the top slot whoever held it
    assert torch.equal(pool.w13[top], w.w13[6]) and torch.equal(pool.w13[top - 1], w.w13[6])
    with pytest.raises(RuntimeError, match="exceed the 4 flex slots"):
        pool.stage(0, [2, 3, 4, 5, 6])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("path", ["split", "mixed"])
def test_deferred_combine_gives_the_same_bits(path, device, monkeypatch):
    """OSTINATO_DEFER_COMBINE=1 (the default): on CUDA with the native CPU experts, a split pass's layer
    that uploads nothing and is not the backend's last joins its CPU branch on the stream (handshake.wait_value) and the host goes on;
    the outputs are the host-waited ones to the bit, and no CPU call outlives a pass. On the CPU
    device nothing is deferred."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    backend = "torch" if device == "cpu" else "auto"
    monkeypatch.setenv("OSTINATO_DEFER_COMBINE", "1")
    deferred, _ = _hybrid(0.5, upload_threshold=10**9, backend=backend, device=device, dtype=dtype)
    monkeypatch.setenv("OSTINATO_DEFER_COMBINE", "0")
    waited, _ = _hybrid(0.5, upload_threshold=10**9, backend=backend, device=device, dtype=dtype)
    assert deferred.defer_combine and not waited.defer_combine
    if path == "mixed":  # from 64 tokens: the 7-token passes stay plain split passes
        deferred.mixed = waited.mixed = replace(MIXED, min_tokens=64)
    g = torch.Generator().manual_seed(5)
    joins = 0  # layers other than the last whose pass of several tokens gave the CPU work, uploading nothing
    for tokens in (1, 7, 64, 512, 7):
        for layer in LAYERS:  # a pass: every layer in order; LAYERS[-1] is the last
            x = torch.randn(tokens, D, generator=g).to(dtype).to(device)
            topk = route(torch.randn(tokens, E, generator=g), K, True, x.dtype)
            topk = TopKOutput(topk.ids.to(device), topk.weights.to(device))
            before = [waited.stats().get(c, 0) for c in ("cpu_experts", "mixed_passes")]
            assert torch.equal(deferred(layer, x, topk), waited(layer, x, topk))
            after = [waited.stats().get(c, 0) for c in ("cpu_experts", "mixed_passes")]
            uploaded = after[1] > before[1]  # a pass with uploads keeps the host's wait
            joins += tokens > 1 and layer != LAYERS[-1] and after[0] > before[0] and not uploaded
        assert deferred.cpu._pending is None  # settled by the last layer
    native = device == "cuda" and deferred.cpu.backend == "native"
    assert joins > 0 and deferred.stats().get("deferred_combines", 0) == (joins if native else 0)
    assert waited.stats().get("deferred_combines", 0) == 0
    assert (waited.stats().get("mixed_passes", 0) > 0) == (path == "mixed")


def test_defer_combine_switch_refuses_other_values(monkeypatch):
    from ostinato.layers.moe.hybrid import defer_combine

    monkeypatch.delenv("OSTINATO_DEFER_COMBINE", raising=False)
    assert defer_combine() is True  # on unless switched off
    for value, on in (("1", True), ("0", False), ("", True)):
        monkeypatch.setenv("OSTINATO_DEFER_COMBINE", value)
        assert defer_combine() is on
    monkeypatch.setenv("OSTINATO_DEFER_COMBINE", "yes")
    with pytest.raises(ConfigError, match="OSTINATO_DEFER_COMBINE must be 1"):
        defer_combine()
