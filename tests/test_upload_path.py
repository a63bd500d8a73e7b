"""The upload path earns its flex slots (planner/pipeline.py plan_upload_path): the planner keeps it
where the calibration predicts it saves more over the development sessions than the flex slots'
bytes would as hot experts, else the plan holds those experts instead and has no upload path; the
engine and every policy honour the plan under the same budget."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ostinato.config import ModelConfig
from ostinato.engine.residency import Residency
from ostinato.engine.routes import RouteCounts
from ostinato.layers.moe.hybrid import MixedPass
from ostinato.layers.moe.reference import moe_forward
from ostinato.layers.moe.types import ExpertWeights
from ostinato.planner import cost_model as cm
from ostinato.planner.capacity import CapacitySettings, grow_without_flex, hot_groups, plan_capacity
from ostinato.planner.fill import fill, fill_more
from ostinato.planner.pipeline import fill_text, plan_upload_path, upload_path_text
from ostinato.synth.presets import preset_config

FAST = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

CFG = ModelConfig.from_dict(preset_config("tiny"))  # 4 MoE layers of 16 experts, top 4
L, E, K = len(CFG.moe_layers), CFG.num_experts, CFG.num_experts_per_tok
EB = 3 * CFG.hidden_size * CFG.moe_intermediate_size * 4  # one float32 expert
SIZES = {l: ("float32", EB) for l in CFG.moe_layers}
CHUNK = 2048


def _profile(prompts: list[int], decode_tokens: int) -> RouteCounts:
    """Every layer routes expert e with probability proportional to 0.8^e (K per token)."""
    w = torch.tensor([0.8 ** e for e in range(E)], dtype=torch.float64)
    p = K * w / w.sum()
    prof = RouteCounts.zeros(CFG.moe_layers, E)
    prefill = sum(prompts)
    for l in CFG.moe_layers:
        prof.prefill[l] = torch.round(p * prefill).to(torch.int64)
        prof.decode[l] = torch.round(p * decode_tokens).to(torch.int64)
    prof.tokens = {"prefill": prefill, "decode": decode_tokens}
    prof.prompts = list(prompts)
    return prof


def _calibration(np_: int | None, split_ms: list[float], upload_ms: list[float], sizes=(64, 512, 2048),
                 **extra) -> dict:
    """Graph-decode constants like the H200 machine's (alpha 0.04, beta 0.08 ms per cold route), the
    CPU pass fit, and n-token passes measured at `sizes` (extra: mixed_ms, the split with uploads)."""
    gpu = lambda ms: [cm.interp(n, [64, 512, 2048], ms) for n in sizes]  # noqa: E731
    return {"global": {"G_ms": 0.2, "G_graph_ms": 0.025, "gamma0_ms": 0.5, "alpha_ms": 0.52, "beta_ms": 0.075},
            "graph_fit": {"gamma0_ms": 0.0, "alpha_ms": 0.037, "beta_ms": 0.080}, "overlapped": True,
            "cpu_pass": {"alpha_ms": 0.39, "beta_expert_ms": 0.104, "beta_route_ms": 0.0019},
            "upload_gbps": 52.3, "expert_bytes": 9_437_184, "upload_threshold": np_,
            "passes": {"sizes": list(sizes), "layers": [0, 3], "split_ms": split_ms, "upload_ms": upload_ms,
                       "gpu_hot_ms": gpu([0.53, 0.54, 0.79]), "gpu_all_ms": gpu([0.52, 0.58, 0.92]), **extra}}


# the finding (results of 2026-12-02, regime flat): Np = the prefill chunk, 13.38 against 13.11 ms
FINDING = dict(np_=2048, split_ms=[5.3, 8.7, 13.38], upload_ms=[8.8, 12.4, 13.11])
PAYS = dict(np_=512, split_ms=[5.0, 20.0, 60.0], upload_ms=[10.0, 12.0, 14.0])
# session 15's calibration on the H200 machine (ms per MoE layer): the split with uploads beats both
# plain paths from 384 tokens (MixedPass.min_tokens), the upload path beats the split path at 2048
H200 = dict(np_=2048, sizes=[64, 128, 256, 384, 512, 768, 1024, 2048],
            split_ms=[4.90, 5.09, 6.05, 7.85, 7.13, 8.71, 9.76, 14.25],
            upload_ms=[10.18, 11.12, 12.04, 13.00, 12.58, 12.82, 13.14, 13.67],
            mixed_ms=[4.96, 5.83, 6.27, 6.78, 6.78, 7.47, 8.05, 9.82])


def _plan(extra_slots: int = 14) -> tuple[Residency, dict]:
    """A plan sized by the capacity test on a cap that leaves K + flex + extra slots for the pool."""
    counts = _profile([1000], 1000).total("all")
    # flex slots unbounded (a share of the whole pool): these tests weigh the upload path, not the bound
    s = CapacitySettings(margin_bytes=0, margin_fraction=0.0, prefill_chunk=CHUNK, flex_share=1.0)
    probe = plan_capacity(CFG, counts, 2**40, 256, torch.float32, s)
    cap = plan_capacity(CFG, counts, probe.fixed + (K + extra_slots + E) * EB, 256, torch.float32, s)
    return Residency("sha256:test", E, fill(counts, cap.hot_slots), capacity=cap.to_json(), max_flex=cap.max_flex), counts


def test_upload_path_kept_where_long_passes_pay_for_it():
    res, counts = _plan()
    prof = _profile([8192] * 10, 100)  # 40 passes of a whole chunk, few output tokens
    out = plan_upload_path(res, _calibration(**PAYS), prof, counts, SIZES, K, CHUNK)
    up = out.calibration["upload_path"]
    assert up["on"] and out.upload_path and up["gain_ms"] > up["cost_ms"] > 0
    assert up["passes_at_np"] == 40 and up["gain_ms"] == pytest.approx(40 * L * (60.0 - 14.0), rel=1e-3)
    assert out.hot == res.hot and out.capacity == res.capacity and "kept: it pays" in upload_path_text(up)


def test_upload_path_dropped_in_the_findings_case():
    """Np = the chunk: one pass of a long first prompt takes the upload path and saves 0.27 ms a
    layer, while the flex slots as hot experts would take routes off the CPU in every decode step."""
    res, counts = _plan()
    prof = _profile([2100] + [300] * 20, 3000)
    cal = _calibration(**FINDING)
    out = plan_upload_path(res, cal, prof, counts, SIZES, K, CHUNK)
    up = out.calibration["upload_path"]
    assert not up["on"] and not out.upload_path
    assert up["passes_at_np"] == 1 and up["gain_ms"] == pytest.approx(L * (13.38 - 13.11), rel=1e-3)
    assert up["cost_ms"] > 10 * up["gain_ms"] and up["cost_decode_ms"] > 0 and up["cost_prefill_ms"] >= 0
    with_flex, without = up["cold_routes_per_token_layer"]
    assert without < with_flex  # the bigger plan sends fewer routes to the CPU
    text = upload_path_text(up)
    assert text.startswith("none: the upload path did not pay (gain ") and "ms over the development sessions" in text
    # the flex slots' bytes hold the next experts in the fill order: same pool bytes, K zero slots, no flex
    flex = res.capacity["flex_slots"]
    assert flex > 0 and out.hot_count == res.hot_count + flex == up["hot_without_flex"]
    assert out.hot == fill(counts, out.hot_count) and all(set(res.hot[l]) <= set(out.hot[l]) for l in res.hot)
    pool = res.capacity["pool_bytes"] + res.capacity["unused"]
    assert out.capacity["pool_bytes"] == (out.hot_count + K) * EB <= pool
    assert out.capacity["flex_slots"] == 0 and out.capacity["hot_slots"] == out.hot_count
    assert out.capacity["unused"] == pool - out.capacity["pool_bytes"] < EB
    assert out.calibration["upload_threshold"] == 2048  # the measurement stays; the plan has no Np
    # it survives the file and gives back the plan with the upload path
    back = _roundtrip(out)
    assert back.hot == out.hot and not back.upload_path
    up_plan = back.upload_plan()
    assert up_plan.hot == res.hot and up_plan.capacity == res.capacity and up_plan.upload_path
    assert "upload_path" not in up_plan.calibration
    # decided again (a new calibration of the same numbers): the same plan
    again = plan_upload_path(back, cal, prof, counts, SIZES, K, CHUNK)
    assert again.hot == out.hot and not again.upload_path
    assert res.calibration == {} and res.hot == fill(counts, res.hot_count)  # pure: the input is untouched


def _roundtrip(res: Residency) -> Residency:
    """Through the file: the decision's keys come back as JSON gives them (layers as strings)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        res.save(Path(d) / "r.json")
        return Residency.load(Path(d) / "r.json")


def test_upload_path_kept_where_borrowed_or_not_weighed():
    res, counts = _plan()
    prof = _profile([2100] + [300] * 20, 3000)
    out = plan_upload_path(res, _calibration(**FINDING), prof, counts, SIZES, K, CHUNK, borrow=True)
    assert out.upload_path and out.hot == res.hot and "borrowed" in out.calibration["upload_path"]["why"]
    no_sizes = _profile([2100], 3000)
    no_sizes.prompts = None  # an older profile: not weighed, the plan as it was
    out = plan_upload_path(res, _calibration(**FINDING), no_sizes, counts, SIZES, K, CHUNK)
    assert out.upload_path and out.hot == res.hot and "not weighed" in out.calibration["upload_path"]["why"]


@pytest.mark.parametrize("np_", [None, 4096])
def test_upload_path_dropped_without_np_below_the_largest_pass(np_):
    res, counts = _plan()
    prof = _profile([8192] * 10, 10)  # long passes, but Np none or above them, and no split with uploads
    out = plan_upload_path(res, _calibration(**{**PAYS, "np_": np_}), prof, counts, SIZES, K, CHUNK)
    up = out.calibration["upload_path"]
    assert not out.upload_path and up["gain_ms"] == up["gain_upload_ms"] == up["gain_mixed_ms"] == 0
    assert up["passes_at_np"] == up["passes_mixed"] == 0 and up["mixed_from"] is None
    assert up["why"] == "the upload path did not pay" and out.hot_count > res.hot_count


def test_split_with_uploads_alone_pays_for_the_flex_slots():
    """No Np (the upload path never beats the split path), but the split with uploads saves 30 ms a
    layer on each of 40 whole-chunk passes: the path and its flex slots stay."""
    res, counts = _plan()
    prof = _profile([8192] * 10, 100)
    plain = dict(np_=None, split_ms=[5.0, 20.0, 60.0], upload_ms=[10.0, 22.0, 65.0])
    out = plan_upload_path(res, _calibration(**plain, mixed_ms=[4.0, 12.0, 30.0]), prof, counts, SIZES, K, CHUNK)
    up = out.calibration["upload_path"]
    assert up["on"] and out.upload_path and out.hot == res.hot and out.capacity == res.capacity
    assert up["mixed_from"] == 64 and up["passes_mixed"] == 40 and up["passes_at_np"] == 0
    assert up["gain_upload_ms"] == 0 and up["gain_mixed_ms"] == pytest.approx(40 * L * (60.0 - 30.0), rel=1e-3)
    assert up["gain_ms"] == up["gain_mixed_ms"] > up["cost_ms"] > 0
    # the same workload and plain paths without the split with uploads: nothing pays for the slots
    out = plan_upload_path(res, _calibration(**plain), prof, counts, SIZES, K, CHUNK)
    assert not out.upload_path and out.calibration["upload_path"]["gain_ms"] == 0


def test_split_with_uploads_measured_only_where_the_workload_never_goes():
    """Session 15's calibration: the split with uploads pays from 384 tokens, the upload path at
    2048; development prompts all shorter than 384 new tokens gain nothing from either, so the flex
    slots go to hot experts (the replay that found Ostinato 5% slower in decode than per-layer
    frequency, 85 flex slots displacing hot experts while the mixed passes lost on short prefills)."""
    res, counts = _plan()
    prof = _profile([300] * 20 + [100] * 30 + [20] * 50, 3000)
    out = plan_upload_path(res, _calibration(**H200), prof, counts, SIZES, K, CHUNK)
    up = out.calibration["upload_path"]
    assert not up["on"] and not out.upload_path and out.hot_count == up["hot_without_flex"] > res.hot_count
    assert up["mixed_from"] == 384 and up["np"] == 2048 and up["largest_pass"] == 300
    assert up["passes"] == 100 and up["passes_mixed"] == up["passes_at_np"] == 0 and up["gain_ms"] == 0
    assert up["cost_ms"] > 0
    assert "split with uploads 0.0 ms on 0 passes from 384 tokens" in upload_path_text(up)
    # one long prompt in the same sessions: its passes gain from both paths, still less than the decode
    longer = _profile([4096 + 500] + [300] * 20 + [100] * 30 + [20] * 50, 3000)
    up = plan_upload_path(res, _calibration(**H200), longer, counts, SIZES, K, CHUNK).calibration["upload_path"]
    assert up["passes_mixed"] == 3 and up["passes_at_np"] == 2 and 0 < up["gain_ms"] < up["cost_ms"]


def test_the_decision_shows_the_gain_of_each_path():
    """Each pass gains split minus the path it takes, in two parts: the upload path's (split -
    upload, at Np and above) and the split with uploads' (the plain path it replaces - mixed)."""
    res, counts = _plan()
    prof = _profile([4096, 300, 40], 3000)  # passes of 2048, 2048, 300 and 40 tokens
    cal = _calibration(**PAYS, mixed_ms=[4.5, 11.0, 13.0])  # faster than both at every size: from 64
    up = plan_upload_path(res, cal, prof, counts, SIZES, K, CHUNK).calibration["upload_path"]
    at = lambda key, n: cm.interp(n, [64, 512, 2048], cal["passes"][key])  # noqa: E731
    upload = 2 * (60.0 - 14.0)  # the two passes of 2048 tokens (Np 512)
    mixed = 2 * (14.0 - 13.0) + (at("split_ms", 300) - at("mixed_ms", 300))  # 40 tokens: below 64, plain split
    assert up["passes_at_np"] == 2 and up["passes_mixed"] == 3 and up["mixed_from"] == 64 and up["np"] == 512
    assert up["gain_upload_ms"] == pytest.approx(L * upload, abs=1e-3)
    assert up["gain_mixed_ms"] == pytest.approx(L * mixed, abs=1e-3)
    assert up["gain_ms"] == pytest.approx(up["gain_upload_ms"] + up["gain_mixed_ms"], abs=2e-3)
    text = upload_path_text(up)
    assert f"upload path {up['gain_upload_ms']:.1f} ms on 2 passes at or above Np 512" in text
    assert f"split with uploads {up['gain_mixed_ms']:.1f} ms on 3 passes from 64 tokens" in text
    # session 15's curves at 2048 tokens: 14.25 split, 13.67 upload, 9.82 split with uploads
    g = cm.path_gains(_calibration(**H200), {2048: 1, 300: 1}, MixedPass.from_calibration(_calibration(**H200)))
    assert g["upload_ms"] == pytest.approx(14.25 - 13.67) and g["mixed_ms"] == pytest.approx(13.67 - 9.82)
    assert g["passes_at_np"] == g["passes_mixed"] == 1  # 300 tokens: below both


def test_prefill_passes_follow_the_runners_chunks():
    assert cm.prefill_passes([5000, 2048, 10, 0], 2048) == {2048: 3, 904: 1, 10: 1}


@st.composite
def grouped_plans(draw):
    """Counts over 4 layers of 8 experts, two format groups of different bytes (a Q4_K_M file's
    Q4_K and Q6_K down projections), a plan with flex slots and the bytes its pools may take."""
    n_e = 8
    counts = {l: torch.tensor(draw(st.lists(st.integers(0, 50), min_size=n_e, max_size=n_e))) for l in range(4)}
    sizes = {0: ("Q4_K/Q4_K", 100), 1: ("Q4_K/Q4_K", 100), 2: ("Q4_K/Q6_K", 130), 3: ("Q4_K/Q6_K", 130)}
    hot = fill(counts, draw(st.integers(0, 4 * n_e)))
    limit = sum(g["bytes"] for g in hot_groups(hot, 2, n_e, sizes).values()) + draw(st.integers(0, 400))
    return counts, hot, sizes, limit, n_e


@FAST
@given(grouped_plans())
def test_capacity_without_flex_holds_more_in_the_same_bytes(case):
    counts, hot, sizes, limit, n_e = case
    bigger = grow_without_flex(counts, hot, limit, 2, n_e, sizes)
    need = lambda h: sum(g["bytes"] for g in hot_groups(h, 2, n_e, sizes, max_flex=0).values())  # noqa: E731
    assert all(set(hot[l]) <= set(bigger[l]) for l in counts)  # the plan's experts, and more
    assert need(bigger) <= limit  # never over the budget, every format group counted in its bytes
    n = sum(map(len, bigger.values()))
    if n < 4 * n_e:  # the next expert in the fill order does not fit
        assert need(fill_more(counts, hot, n - sum(map(len, hot.values())) + 1)) > limit
    groups = hot_groups(bigger, 2, n_e, sizes, max_flex=0)
    assert all(g["flex"] == 0 and g["zero"] == 2 for g in groups.values())


# ---- the engine and the policies honour a plan without the upload path ----

D, F = CFG.hidden_size, CFG.moe_intermediate_size


def _weights(l):
    g = torch.Generator().manual_seed(l)
    return ExpertWeights(torch.randn(E, 2 * F, D, generator=g) / D ** 0.5, torch.randn(E, D, F, generator=g) / F ** 0.5)


WEIGHTS = {l: _weights(l) for l in CFG.moe_layers}


def _spec():
    from ostinato.engine.experts import ModelExperts

    return ModelExperts(CFG.num_hidden_layers, list(CFG.moe_layers), E, K, D, F, torch.device("cpu"), torch.float32,
                        lambda l: ExpertWeights(WEIGHTS[l].w13.clone(), WEIGHTS[l].w2.clone()), max_tokens=512)


def _dropped() -> tuple[Residency, Residency, dict]:
    """(the plan with the upload path, the plan without it, the counts)."""
    res, counts = _plan()
    # an Np every test pass reaches, and a split with uploads measured faster than both plain paths
    # from 64 tokens (by little), were the path on
    cal = _calibration(**{**FINDING, "np_": 16}, mixed_ms=[5.2, 8.6, 13.0])
    out = plan_upload_path(res, cal, _profile([2100] + [300] * 20, 3000), counts, SIZES, K, CHUNK,
                           limit=res.capacity["pool_bytes"] + res.capacity["unused"])
    assert not out.upload_path
    return res, out, counts


def _routing(T, seed):
    from ostinato.layers.moe.router import route

    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, D, generator=g), route(torch.randn(T, E, generator=g), K, True, torch.float32)


@pytest.mark.parametrize("tokens", [1, 64])
def test_ostinato_policy_without_upload_path_splits_every_pass(tokens):
    from ostinato.policies.factory import budget_bytes, build_policy
    from ostinato.policies.settings import PolicySettings

    flexed, res, counts = _dropped()
    spec = _spec()
    slots = res.capacity["pool_bytes"] // EB + res.capacity["unused"] // EB
    ps = PolicySettings(expert_slots=slots, residency=res, cpu_backend="torch", profile=None)
    assert budget_bytes(spec, ps.with_(expert_slots=None)) == (res.hot_count + K) * EB  # no flex slots counted
    p = build_policy("ostinato", spec, ps)
    assert p.upload_threshold is None and p.resident_experts() == res.hot_count
    assert all(pool.num_slots == pool.flex_lo for pool in p.pools.groups)  # no flex slots
    for l in CFG.moe_layers:
        x, topk = _routing(tokens, l)
        assert torch.allclose(p(l, x, topk), moe_forward(x, topk, WEIGHTS[l]), rtol=1e-4, atol=1e-5)
    s = p.stats()
    assert s.get("uploaded_experts", 0) == 0 and s.get("bytes_uploaded", 0) == 0 and s["cpu_experts"] > 0
    # the steps whose mechanism lives in the flex slots, and ktransformers, run the plan with the upload
    # path, in the same budget
    for name in ("ostinato-upload", "ktransformers"):
        q = build_policy(name, spec, ps.with_(offload_threshold=16))
        assert q.resident_experts() == flexed.hot_count and any(g.num_slots > g.flex_lo for g in q.pools.groups)
        assert q.upload_threshold == 16
        x, topk = _routing(64, 9)
        assert torch.allclose(q(0, x, topk), moe_forward(x, topk, WEIGHTS[0]), rtol=1e-4, atol=1e-5)
        assert q.stats()["uploaded_experts"] > 0
    split = build_policy("ostinato-split", spec, ps)
    assert split.resident_experts() == res.hot_count and split.upload_threshold is None


def test_engine_without_upload_path_has_no_flex_slots_and_no_np(tiny_dir, tmp_path):
    """build_hybrid: no flex slots, Np None (not the default 512), no split with uploads, every pass
    split and nothing uploaded, at every size; the logits are the reference model's. With --borrow
    or an Np given it runs the plan with the upload path."""
    from types import SimpleNamespace

    from ostinato.engine.placement import PlacementSettings, apply_calibration
    from ostinato.engine.residency import model_fingerprint
    from ostinato.engine.runner import RunnerSettings
    from ostinato.load import load_engine, startup_summary

    settings = RunnerSettings(device="cpu", dtype="fp32", max_context=256, prefill_chunk=64)
    ref = load_engine(str(tiny_dir), settings)
    flexed, res, _ = _dropped()
    res.fingerprint = model_fingerprint(ref.source)
    res.save(tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["calibration"]["upload_path"]["on"] is False
    place = PlacementSettings(residency=str(tmp_path / "r.json"), cpu_backend="torch")
    hyb = load_engine(str(tiny_dir), settings, place)
    h = hyb.runner.experts.unwrapped
    assert h.upload_threshold is None and h.mixed is None
    assert all(p.num_slots == p.flex_lo for p in h.pools.groups) and h.pools.num_hot == res.hot_count
    summary = startup_summary(hyb)
    assert summary["upload_threshold"] is None and summary["resident_experts"] == res.hot_count
    # passes of 1, 15 and 16 (Np, were the path on), 64 (the split with uploads' first size) and 100
    # tokens (chunks of 64 and 36): an upload into a pool without flex slots would raise (staging)
    for n in (1, 15, 16, 64, 100):
        ids = list(range(5, 5 + n))
        want, got = ref.runner.forward(ids, 0, all_logits=True), hyb.runner.forward(ids, 0, all_logits=True)
        assert ((got - want).abs().max() / want.abs().max()) < 1e-4
    stats = hyb.runner.placement_stats()
    assert stats["cold_routes"] > 0 and stats.get("bytes_uploaded", 0) == 0
    assert h.counters["uploaded_experts"] == h.counters["mixed_passes"] == 0
    # on a GPU too (the split with uploads runs only there): neither Np nor the split with uploads
    gpu = apply_calibration(SimpleNamespace(on_cuda=True, mixed=None, upload_threshold=None), place, res)
    assert gpu.upload_threshold is None and gpu.mixed is None
    # captured passes stage by their own rule (layers/moe/staging.py), with no flex slots to stage into here;
    # Ostinato's placements only, on a GPU
    assert gpu.stage_passes and not h.stage_passes
    assert not apply_calibration(SimpleNamespace(on_cuda=True), dataclasses.replace(place, mixed=False), res).stage_passes
    flexed_gpu = apply_calibration(SimpleNamespace(on_cuda=True, mixed=None, upload_threshold=None),
                                   dataclasses.replace(place, borrow=True), res)
    assert flexed_gpu.upload_threshold == 16 and flexed_gpu.mixed.min_tokens == 64
    for place in (PlacementSettings(residency=str(tmp_path / "r.json"), cpu_backend="torch", borrow=True),
                  PlacementSettings(residency=str(tmp_path / "r.json"), cpu_backend="torch", upload_threshold=16)):
        up = load_engine(str(tiny_dir), settings, place)
        hu = up.runner.experts.unwrapped
        assert hu.pools.num_hot == flexed.hot_count and any(p.num_slots > p.flex_lo for p in hu.pools.groups)
        assert hu.upload_threshold == 16  # the measured Np of the plan with the upload path, or the one given


def _skewed_profile(prompts: list[int], decode_tokens: int) -> RouteCounts:
    """Decode routes expert e with probability proportional to 0.8^e, prefill the other way round
    (0.8^(E-1-e)): a fill by route totals, where prompt tokens outnumber decode tokens, keeps the
    experts the prefill favours; a fill by time saved keeps those decode favours."""
    w = torch.tensor([0.8 ** e for e in range(E)], dtype=torch.float64)
    p_dec, p_pre = K * w / w.sum(), K * w.flip(0) / w.sum()
    prof = RouteCounts.zeros(CFG.moe_layers, E)
    for l in CFG.moe_layers:
        prof.prefill[l] = torch.round(p_pre * sum(prompts)).to(torch.int64)
        prof.decode[l] = torch.round(p_dec * decode_tokens).to(torch.int64)
    prof.tokens = {"prefill": sum(prompts), "decode": decode_tokens}
    prof.prompts = list(prompts)
    return prof


def test_expert_values_are_the_cpu_time_each_expert_costs():
    """cost_model.expert_values against the formula written out: decode routes x beta, and on every
    pass of n tokens beta_expert x P(read) + beta_route x n x p below Np, P(read) x upload time at
    Np and above."""
    prof = _skewed_profile([300, 300, 2500], 1000)  # passes: 300 x 2, 2048 (the chunk) and 452
    cal = _calibration(**PAYS)  # Np 512: the 2048-token pass uploads
    v = cm.expert_values(cal, prof, cm.prefill_passes(prof.prompts, CHUNK), K)
    beta, cp = cal["graph_fit"]["beta_ms"], cal["cpu_pass"]
    upload = cal["expert_bytes"] / (cal["upload_gbps"] * 1e6)
    for l in CFG.moe_layers:
        for e in (0, 7, E - 1):
            p = float(prof.prefill[l][e]) / prof.tokens["prefill"]
            read = lambda n: 1 - (1 - p) ** n  # noqa: E731
            want = float(prof.decode[l][e]) * beta + read(2048) * upload
            want += sum(cp["beta_expert_ms"] * read(n) + cp["beta_route_ms"] * n * p for n in (300, 300, 452))
            assert float(v[l][e]) == pytest.approx(want, rel=1e-9)
    assert cm.expert_values({k: x for k, x in cal.items() if k != "cpu_pass"}, prof, {300: 1}, K) is None
    free = {**cal, "graph_fit": {**cal["graph_fit"], "beta_ms": 0.0}}  # a fit that priced a decode route at nothing
    assert cm.expert_values(free, prof, {300: 1}, K) is None


def test_plan_fills_again_by_time_saved_and_ktransformers_keeps_the_fill_by_routes():
    """The fill by route totals keeps the prefill's favourites; the calibrated plan keeps as many
    experts, chosen by the time they save, which the model predicts to cut the decode step; the
    plan by routes comes back for the ktransformers baseline and for a new decision."""
    prof = _skewed_profile([300] * 40, 2000)
    counts = prof.total("all")
    res, _ = _plan()
    res = dataclasses.replace(res, hot=fill(counts, res.hot_count))
    cal = _calibration(**H200)
    out = plan_upload_path(res, cal, prof, counts, SIZES, K, CHUNK, borrow=True)  # borrowing keeps the flex slots
    f = out.calibration["fill"]
    values = cm.expert_values(cal, prof, cm.prefill_passes(prof.prompts, CHUNK), K)
    assert out.upload_path and out.hot_count == res.hot_count
    assert out.hot == fill(values, res.hot_count) != res.hot and f["by"] == "time saved" and f["moved"] > 0
    assert f["moved"] == sum(len(set(out.hot[l]) - set(res.hot[l])) for l in res.hot)
    assert f["decode_moe_ms"]["time"] < f["decode_moe_ms"]["routes"]
    assert f["cold_routes_per_token_layer"]["time"] < f["cold_routes_per_token_layer"]["routes"]
    assert fill_text(f).startswith(f"by time saved: {f['moved']} experts moved")
    back = _roundtrip(out)
    assert back.frequency_plan().hot == res.hot and "fill" not in back.frequency_plan().calibration
    again = plan_upload_path(back, cal, prof, counts, SIZES, K, CHUNK, borrow=True)  # decided again: the same plan
    assert again.hot == out.hot and again.calibration["fill"] == f
    unweighed = dataclasses.replace(prof, prompts=None)  # no prompt sizes (an older profile): the fill stays
    kept = plan_upload_path(res, cal, unweighed, counts, SIZES, K, CHUNK, borrow=True)
    assert kept.hot == res.hot and "fill" not in kept.calibration and fill_text(None) == "by routes"


def test_the_planner_weighs_the_passes_a_profile_counted_before_its_prompts():
    """cost_model.profile_passes: a served or learned profile's counted passes (planner/served.py), else
    the passes its prompts make; neither: the plan is not weighed."""
    prof = _skewed_profile([300, 2500], 100)
    assert cm.profile_passes(prof, CHUNK) == {300: 1, 2048: 1, 452: 1}
    learned = dataclasses.replace(prof, prompts=None, passes={300: 3.0, 2048: 3.0, 452: 3.0})
    assert cm.profile_passes(learned, CHUNK) == learned.passes
    assert cm.profile_passes(dataclasses.replace(prof, prompts=None), CHUNK) is None
    res, _ = _plan()
    up = plan_upload_path(res, _calibration(**PAYS), learned, learned.total("all"), SIZES, K, CHUNK)
    assert up.calibration["upload_path"]["passes"] == 9 and up.calibration["fill"]["by"] == "time saved"


def test_fill_by_time_dropping_the_upload_path_comes_back_to_the_fill_by_routes():
    """Both decisions undone in turn: the flex slots' experts, then the experts the fill moved."""
    prof = _skewed_profile([300] * 40, 3000)
    counts = prof.total("all")
    res, _ = _plan()
    res = dataclasses.replace(res, hot=fill(counts, res.hot_count))
    out = plan_upload_path(res, _calibration(**FINDING), prof, counts, SIZES, K, CHUNK)
    assert not out.upload_path and out.calibration["fill"]["moved"] > 0 and out.hot_count > res.hot_count
    back = _roundtrip(out)
    assert back.upload_plan().hot_count == res.hot_count and back.upload_plan().hot != res.hot
    assert back.frequency_plan().hot == res.hot and back.frequency_plan().upload_path


def test_fill_by_time_keeps_each_format_groups_bytes():
    """A Q4_K_M-like model: layers of two block formats; each group keeps as many hot experts."""
    sizes = {l: (("q4_k", 2_654_208) if l < 2 else ("q4_k+q6_k", 3_063_808)) for l in CFG.moe_layers}
    prof = _skewed_profile([300] * 40, 2000)
    w = torch.tensor([1.0 + l for l in CFG.moe_layers], dtype=torch.float64)  # later layers route more
    for l in CFG.moe_layers:
        prof.decode[l] = (prof.decode[l] * w[l]).to(torch.int64)
    res = Residency("sha256:test", E, fill(prof.total("all"), 24))
    out = plan_upload_path(res, _calibration(**H200), prof, prof.total("all"), sizes, K, CHUNK, borrow=True)
    assert out.calibration["fill"]["moved"] > 0
    for group in ((0, 1), (2, 3)):
        assert sum(len(out.hot[l]) for l in group) == sum(len(res.hot[l]) for l in group)
    # unbounded flex slots are a group's most cold experts of a layer: no layer gets more than it had
    before, after = (hot_groups(r.hot, K, E, sizes, max_flex=None) for r in (res, out))
    assert {n: g["bytes"] for n, g in after.items()} == {n: g["bytes"] for n, g in before.items()}
    assert all(E - len(out.hot[l]) <= before[sizes[l][0]]["flex"] for l in CFG.moe_layers)
    free = plan_upload_path(dataclasses.replace(res, max_flex=2), _calibration(**H200), prof, prof.total("all"),
                            sizes, K, CHUNK, borrow=True)  # a bound that binds: no floor
    assert max(E - len(free.hot[l]) for l in CFG.moe_layers) > max(E - len(out.hot[l]) for l in CFG.moe_layers)


def test_a_plan_without_the_upload_path_adds_the_experts_its_split_passes_value():
    """Where the path is dropped, the passes at Np and above run split: the experts the flex slots'
    bytes go to are ranked by their value on the split path, not by the upload time they would save."""
    prof = _skewed_profile([2048] * 30, 1500)  # every pass a whole chunk, at Np
    counts = prof.total("all")
    res, _ = _plan()
    res = dataclasses.replace(res, hot=fill(counts, res.hot_count))
    cal = _calibration(**FINDING)
    out = plan_upload_path(res, cal, prof, counts, SIZES, K, CHUNK)
    assert not out.upload_path and out.calibration["fill"]["moved"] > 0
    base = out.upload_plan().hot
    split = cm.expert_values({**cal, "upload_threshold": None}, prof, cm.profile_passes(prof, CHUNK), K)
    assert out.hot == fill_more(split, base, out.hot_count - sum(map(len, base.values())))
    uploads = cm.expert_values(cal, prof, cm.profile_passes(prof, CHUNK), K)
    assert fill_more(uploads, base, out.hot_count - sum(map(len, base.values()))) != out.hot  # the old ranking
