"""The tuner of the quantized GPU MoE kernels (scripts/bench_gpu_quant.py --tune).

The sweep logic runs here on the CPU with fake timing functions and clocks: candidate
generation and its pruning by shape, choosing the fastest, skipping configs that fail, the
budget stop, the oracle-check fallback, and the tuned file that gpu_quant.load_quant_tuning
reads back. One GPU test runs --tune with a tiny budget into a temporary tuned folder.
"""
from __future__ import annotations

import copy
import json
import math
import sys

import pytest
import torch

from ostinato.layers.moe import gpu_experts as ge
from ostinato.layers.moe import gpu_quant as gq
from scripts import bench_gpu_quant as bq
from tests.triton_interpreter import REPO, needs_cuda

BASE = gq.default_quant_tuning("cpu")


class Clock:
    """A fake monotonic clock: advances by step on every time_fn call (set by the test)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
    """gpu_experts.TUNED_DIR (hence quant_tuned_path) in a temporary folder, caches cleared."""
    monkeypatch.setattr(ge, "TUNED_DIR", tmp_path)
    gq.clear_quant_tuning_cache()
    ge.load_tuning.cache_clear()
    ge._tuning_for.cache_clear()
    yield tmp_path
    gq.clear_quant_tuning_cache()
    ge.load_tuning.cache_clear()
    ge._tuning_for.cache_clear()


# --- candidates ---------------------------------------------------------------------------

@pytest.mark.parametrize("key,count", [("decode_w13", 14), ("decode_w2", 16)])
def test_decode_shapes_keep_the_per_thread_load_within_the_tile_range(key, count):
    spec, current = bq.decode_spec(key), BASE[key]
    cands = bq.decode_shape_candidates(current, spec)
    assert len(cands) == count and current in cands
    assert len({bq.cfg_key(c) for c in cands}) == len(cands)
    tile = current[spec.block] * current["GROUPS"]
    for c in cands:
        assert set(c) == set(current) and bq.decode_feasible(c, spec)
        assert c[spec.block] in bq.BLOCKS and c["GROUPS"] in bq.GROUP_CHOICES
        assert c["num_warps"] in bq.DECODE_WARPS and c["num_stages"] == current["num_stages"]
        assert 1 / 4 <= c[spec.block] * c["GROUPS"] / tile <= 4
        assert spec.n_groups % c["GROUPS"] == 0
        assert bq.decode_elements(c, spec) >= 32 * c["num_warps"]
        assert bq.decode_per_thread(c, spec) <= bq.MAX_PER_THREAD
    # nearest tiles first: the current tile size leads
    assert cands[0][spec.block] * cands[0]["GROUPS"] == tile


def test_decode_candidates_are_pruned_by_small_shapes():
    # D=160, F=96: 5 and 3 groups of 32 values: only GROUPS=1 divides them
    for key in bq.DECODE_KEYS:
        spec = bq.decode_spec(key, d=160, f=96, k=4)
        cands = bq.decode_shape_candidates(BASE[key], spec)
        assert cands and all(c["GROUPS"] == 1 for c in cands)
        assert all(c["num_stages"] <= spec.n_groups for c in cands)
    spec = bq.decode_spec("decode_w13", d=2048, f=4)  # BLOCK_F within F
    assert all(c["BLOCK_F"] <= 4 for c in bq.decode_shape_candidates(BASE["decode_w13"], spec))


def test_decode_warp_and_stage_rounds():
    spec = bq.decode_spec("decode_w2")
    best = {"BLOCK_D": 4, "GROUPS": 8, "num_warps": 4, "num_stages": 1}  # 3 loop steps
    warps = bq.decode_warp_candidates(best, spec)
    # one warp would hold 128 accumulator values a thread: beyond MAX_PER_THREAD
    assert best not in warps and {c["num_warps"] for c in warps} == {2, 8}
    stages = bq.decode_stage_candidates(best, spec)
    assert [c["num_stages"] for c in stages] == [2, 3]
    spec13 = bq.decode_spec("decode_w13", d=256)  # 8 groups: GROUPS=8 is one loop step
    one_step = {"BLOCK_F": 8, "GROUPS": 8, "num_warps": 4, "num_stages": 1}
    assert bq.decode_stage_candidates(one_step, spec13) == []
    tiny = {"BLOCK_F": 1, "GROUPS": 2, "num_warps": 1, "num_stages": 1}  # 32 lanes: one warp
    assert bq.decode_warp_candidates(tiny, bq.decode_spec("decode_w13")) == []


@pytest.mark.parametrize("T,count,bm_max", [(64, 6, 16), (256, 11, 32), (512, 14, 64)])
def test_prefill_candidates_by_bucket(T, count, bm_max):
    current = gq.prefill_config(BASE, T, torch.bfloat16)
    cands = bq.prefill_shape_candidates(current, T)
    assert len(cands) == count and cands[0] == current
    assert max(c["BLOCK_M"] for c in cands) == bm_max
    for c in cands:
        assert c["BLOCK_M"] in bq.PREFILL_BM and c["BLOCK_N"] in bq.PREFILL_BN
        assert c["num_warps"] in bq.PREFILL_WARPS and c["num_stages"] == current["num_stages"]
        assert (bq.D // 32) % c["GROUPS"] == 0 and (bq.F // 32) % c["GROUPS"] == 0
        assert bq.prefill_tile_per_thread(c) == bq.prefill_tile_per_thread(current)
        assert bq.prefill_acc_per_thread(c) + bq.prefill_tile_per_thread(c) <= bq.MAX_PER_THREAD
    stages = bq.prefill_stage_candidates(current, T)
    assert sorted(c["num_stages"] for c in stages) == [1, 3]


def test_prefill_block_m_cap_and_small_shapes():
    assert [bq.prefill_bm_cap(T) for T in (1, 64, 256, 512, 2048)] == [16, 16, 32, 64, 256]
    current = gq.prefill_config(BASE, 4096, torch.bfloat16)
    assert 128 in {c["BLOCK_M"] for c in bq.prefill_shape_candidates(current, 4096)}
    # D=160, F=96 (5 and 3 groups): GROUPS=1 only, BLOCK_N within F
    small = dict(current, GROUPS=1, BLOCK_N=64, num_warps=4)
    cands = bq.prefill_shape_candidates(small, 512, d=160, f=96)
    assert cands and all(c["GROUPS"] == 1 and c["BLOCK_N"] <= 96 for c in cands)


def test_buckets_and_their_tokens():
    assert [bq.bucket_tokens(b) for b in ("80", "320", "1000000")] == [64, 256, 512]
    assert bq.tune_buckets(BASE) == ["80", "320", "1000000"]
    odd = dict(BASE, prefill={"8": {}, "2000": {}})  # 8 tokens are decode's
    assert bq.tune_buckets(odd) == ["80", "2000"]


def test_config_major_interleaves_keys_by_rank():
    a, b, c = {"x": 1}, {"x": 2}, {"x": 3}
    items = bq.config_major({"k1": [a, b], "k2": [b, c]})
    assert items == [("k1", a), ("k1", b), ("k2", b), ("k2", c)]
    assert bq.config_major({"k1": [a, c], "k2": [b]}) == [("k1", a), ("k2", b), ("k1", c)]


# --- the sweep ----------------------------------------------------------------------------

def test_sweep_chooses_the_fastest_and_skips_failures():
    times = {1: 5.0, 2: 3.0, 3: 1.0, 4: float("nan"), 5: 2.0}
    calls = []

    def time_fn(key, cfg):
        calls.append((key, cfg["x"]))
        if cfg["x"] == 3:
            raise RuntimeError("out of resources: shared memory")  # would be the fastest
        return times[cfg["x"]]

    sweep = bq.Sweep(time_fn, log=lambda *_: None)
    sweep.run([("k", {"x": x}) for x in (1, 2, 3, 4, 5, 2)])
    assert sweep.best("k") == {"x": 5} and sweep.ranked("k") == [{"x": 5}, {"x": 2}, {"x": 1}]
    assert sweep.counts() == {"timed": 3, "failed": 2, "untimed": 0}
    assert sweep.time_of("k", {"x": 2}) == 3.0 and sweep.time_of("k", {"x": 3}) is None
    # a failed config is not tried again for another key (the same kernels); others are
    sweep.run([("other", {"x": 3}), ("other", {"x": 1})])
    assert calls.count(("other", 3)) == 0 and ("other", 1) in calls
    assert len(calls) == 6  # x=2 timed once for "k"


def test_sweep_stops_at_the_deadline_and_keeps_the_best_so_far():
    clock = Clock()

    def time_fn(key, cfg):
        clock.t += 1.0  # each config takes a second
        return 10.0 - cfg["x"]

    sweep = bq.Sweep(time_fn, clock=clock, log=lambda *_: None)
    sweep.deadline = 2.5
    sweep.run([("k", {"x": x}) for x in range(6)])
    assert sweep.counts() == {"timed": 3, "failed": 0, "untimed": 3}
    assert sweep.best("k") == {"x": 2}
    sweep.run([("k", {"x": 9})], force=True)  # a baseline: timed past the deadline too
    assert sweep.best("k") == {"x": 9}


def test_budget_shares_the_time_left_and_rolls_it_on():
    clock = Clock()
    budget = bq.Budget(60.0, clock=clock)
    assert budget.deadline(1, 6) == pytest.approx(10.0)
    clock.t = 4.0  # the first phase used 4 of its 10 s
    assert budget.deadline(2, 5) == pytest.approx(4.0 + 56.0 * 2 / 5)
    clock.t = 70.0
    assert budget.deadline(3, 3) == 70.0  # spent: nothing more than forced baselines


# A synthetic cost: distance in log2 from a target config per kernel (the fake device).
TARGETS = {"decode_w13": {"BLOCK_F": 16, "GROUPS": 4, "num_warps": 8, "num_stages": 3},
           "decode_w2": {"BLOCK_D": 8, "GROUPS": 2, "num_warps": 2, "num_stages": 1},
           64: gq.prefill_config(BASE, 64, torch.bfloat16),
           256: {"BLOCK_M": 32, "BLOCK_N": 64, "GROUPS": 4, "num_warps": 8, "num_stages": 1},
           512: {"BLOCK_M": 64, "BLOCK_N": 64, "GROUPS": 4, "num_warps": 8, "num_stages": 3}}


def fake_time(calls, clock=None, step=0.0, fail=lambda tuning, T: False):
    def time_fn(tuning, T):
        calls.append((copy.deepcopy(tuning), T))
        if clock is not None:
            clock.t += step
        if fail(tuning, T):
            raise RuntimeError("does not compile")
        if T <= tuning["decode_max_tokens"]:
            return sum(10 + bq.distance(tuning[k], TARGETS[k]) for k in bq.DECODE_KEYS)
        (cfg,) = tuning["prefill"].values()
        return 100 + bq.distance(cfg, TARGETS[T])
    return time_fn


def test_tune_configs_finds_each_kernels_optimum():
    calls = []
    buckets = bq.tune_buckets(BASE)
    sweep, tuning = bq.tune_configs(fake_time(calls), BASE, bq.Budget(1e9), buckets,
                                    log=lambda *_: None)
    assert tuning["decode_w13"] == TARGETS["decode_w13"]
    assert tuning["decode_w2"] == TARGETS["decode_w2"]
    assert tuning["prefill"] == {b: TARGETS[bq.bucket_tokens(b)] for b in buckets}
    assert {k: v for k, v in tuning.items() if k not in bq.TUNED_KEYS} == \
        {k: v for k, v in BASE.items() if k not in bq.TUNED_KEYS}
    # decode_w2 was swept with decode_w13 at its chosen value, w13 with w2 at the default
    for trial, T in calls:
        if T == 1 and trial["decode_w2"] != BASE["decode_w2"]:
            assert trial["decode_w13"] == TARGETS["decode_w13"]
        if T == 1 and trial["decode_w13"] not in (BASE["decode_w13"], TARGETS["decode_w13"]):
            assert trial["decode_w2"] == BASE["decode_w2"]
        if T > 1:  # prefill trials: one config for every T, prefill's path
            assert len(trial["prefill"]) == 1 and T > trial["decode_max_tokens"]
    # every candidate timed once per key: 19 + 21 decode configs, 6 + 11 + 14 prefill + stages
    counts = sweep.counts()
    assert counts["failed"] == 0 and counts["untimed"] == 0
    assert len(calls) == counts["timed"] <= 19 + 21 + (6 + 2) + (11 + 2) + (14 + 2)


def test_tune_configs_skips_configs_that_fail():
    calls = []

    def fail(tuning, T):  # GROUPS=4 prefill tiles do not compile, nor BLOCK_F=16
        return (T > 1 and next(iter(tuning["prefill"].values()))["GROUPS"] == 4
                or tuning["decode_w13"]["BLOCK_F"] == 16)

    buckets = bq.tune_buckets(BASE)
    sweep, tuning = bq.tune_configs(fake_time(calls, fail=fail), BASE, bq.Budget(1e9), buckets,
                                    log=lambda *_: None)
    assert tuning["decode_w13"]["BLOCK_F"] != 16
    assert all(cfg["GROUPS"] != 4 for cfg in tuning["prefill"].values())
    assert sweep.counts()["failed"] > 0
    assert all(sweep.time_of(b, gq.prefill_config(BASE, bq.bucket_tokens(b), torch.bfloat16))
               is None for b in buckets)  # the defaults (GROUPS=4) failed too


def _tune_on_a_fake_clock(budget_s: float):
    """tune_configs at 1 s a config on a fake clock: (the calls it timed, the sweep, the tuning, the clock)."""
    calls, clock = [], Clock()
    sweep, tuning = bq.tune_configs(fake_time(calls, clock, step=1.0), BASE, bq.Budget(budget_s, clock=clock),
                                    bq.tune_buckets(BASE), clock=clock, log=lambda *_: None)
    return calls, sweep, tuning, clock


def test_tune_configs_budget_stop_keeps_the_defaults_timed():
    buckets = bq.tune_buckets(BASE)
    calls, sweep, tuning, _ = _tune_on_a_fake_clock(0.0)
    assert len(calls) == 2 + len(buckets)  # the baselines alone
    assert sweep.counts()["untimed"] > 0
    assert tuning["decode_w13"] == BASE["decode_w13"]
    assert tuning["decode_w2"] == BASE["decode_w2"]
    for b in buckets:
        assert tuning["prefill"][b] == gq.prefill_config(BASE, bq.bucket_tokens(b), torch.bfloat16)
    rows = bq.before_after(BASE, tuning, sweep, buckets)
    assert [r[0] for r in rows] == ["decode_w13", "decode_w2"] + [f"prefill<={b}" for b in buckets]
    assert all(before == after for _, _, before, after, _ in rows)
    lines = bq.format_before_after(rows)
    assert len(lines) == 1 + len(rows) and "->" in lines[1] and "(1.00x)" in lines[1]


def test_tune_configs_budget_is_shared_among_phases():
    buckets = bq.tune_buckets(BASE)
    _, sweep, _, clock = _tune_on_a_fake_clock(30.0)
    per_key = {k: len(v) for k, v in sweep.times.items()}
    # 30 s at 1 s a config: ~5 for decode_w13, ~10 for decode_w2, the rest for prefill
    assert 4 <= per_key["decode_w13"] <= 7 and 8 <= per_key["decode_w2"] <= 12
    assert all(per_key[b] >= 2 for b in buckets)
    assert clock.t <= 30.0 + 2 + len(buckets)  # at most the forced baselines beyond it


def test_checked_tuning_falls_back_to_the_next_fastest_then_the_default():
    calls = []
    buckets = bq.tune_buckets(BASE)
    sweep, fastest = bq.tune_configs(fake_time(calls), BASE, bq.Budget(1e9), buckets,
                                     log=lambda *_: None)
    checks = []

    def passes(tuning, tokens):
        checks.append((copy.deepcopy(tuning), tokens))
        if tokens == (1, 3):
            return tuning["decode_w13"] != fastest["decode_w13"]  # the fastest w13 is wrong
        (cfg,) = tuning["prefill"].values()
        return tokens != (512,)  # nothing passes for the last bucket

    tuning = bq.checked_tuning(BASE, sweep, passes, buckets, log=lambda *_: None)
    assert tuning["decode_w13"] == sweep.ranked("decode_w13")[1]
    assert tuning["decode_w2"] == fastest["decode_w2"]
    assert tuning["prefill"]["80"] == fastest["prefill"]["80"]
    assert tuning["prefill"]["320"] == fastest["prefill"]["320"]
    assert tuning["prefill"]["1000000"] == gq.prefill_config(BASE, 512, torch.bfloat16)
    w13_checks = [t for t, tok in checks if tok == (1, 3) and t["decode_w2"] == BASE["decode_w2"]]
    assert len(w13_checks) >= 2  # w13 checked with w2 at its default, then w2 with the checked w13
    assert checks[2][0]["decode_w13"] == tuning["decode_w13"]
    assert sum(tok == (512,) for _, tok in checks) == bq.CHECK_TRIES


# --- the tuned file -----------------------------------------------------------------------

def test_written_file_is_what_load_quant_tuning_reads(tuned_dir):
    tuning = copy.deepcopy(BASE)
    tuning["decode_w13"] = {"BLOCK_F": 16, "GROUPS": 2, "num_warps": 4, "num_stages": 3}
    tuning["decode_w2"] = {"BLOCK_D": 8, "GROUPS": 2, "num_warps": 2, "num_stages": 1}
    fields = ("BLOCK_M", "BLOCK_N", "GROUPS", "num_warps", "num_stages")
    tuning["prefill"] = {"80": dict(zip(fields, (16, 32, 4, 4, 1))),
                         "320": dict(zip(fields, (32, 64, 4, 8, 2))),
                         "1000000": dict(zip(fields, (64, 32, 8, 8, 3)))}
    before = gq.load_quant_tuning("fake")  # cached: the defaults
    assert before["decode_w13"] == gq.DEFAULT_QUANT_TUNING["decode_w13"]
    path, doc = bq.write_quant_tuning(tuning, "fake", {"device": "fake", "by": "test"})
    assert path == tuned_dir / "moe_quant_fake.json" and path.exists()
    assert json.loads(path.read_text()) == doc and set(doc) == {"_meta", *bq.TUNED_KEYS}
    loaded = gq.load_quant_tuning("fake")  # write_quant_tuning cleared the cache
    assert "_meta" not in loaded
    for key in bq.TUNED_KEYS:
        assert loaded[key] == tuning[key]
    assert loaded["decode_max_tokens"] == gq.DEFAULT_QUANT_TUNING["decode_max_tokens"]
    assert loaded["align"] == ge.DEFAULT_TUNING["align"]
    for T, bucket in [(9, "80"), (80, "80"), (81, "320"), (320, "320"), (5000, "1000000")]:
        assert gq.prefill_config(loaded, T, torch.bfloat16) == tuning["prefill"][bucket]


def test_each_writer_keeps_the_others_entries(tuned_dir):
    """The experts' tuner and the dense matvec's (scripts/bench_quant_linear.py) share the file: each
    rewrites its own keys and meta block and keeps the rest."""
    tuning = copy.deepcopy(BASE) | {"dense_matvec": {"BLOCK_N": 4, "GROUPS": 4, "num_warps": 2, "num_stages": 2},
                                    "dense_matvec_max_tokens": 2}
    bq.write_quant_tuning(tuning, "fake", {"by": "dense"}, keys=["dense_matvec", "dense_matvec_max_tokens"],
                          meta_key="_meta_dense")
    tuning["decode_w2"] = {"BLOCK_D": 8, "GROUPS": 2, "num_warps": 2, "num_stages": 1}
    _, doc = bq.write_quant_tuning(tuning, "fake", {"by": "experts"})
    assert doc["_meta_dense"]["by"] == "dense" and doc["_meta"]["by"] == "experts"  # each with the commit (source_state)
    loaded = gq.load_quant_tuning("fake")
    assert loaded["dense_matvec"] == tuning["dense_matvec"] and loaded["dense_matvec_max_tokens"] == 2
    assert loaded["decode_w2"] == tuning["decode_w2"] and "_meta_dense" not in loaded


def test_load_quant_tuning_picks_up_a_file_after_the_cache_is_cleared(tuned_dir):
    assert gq.load_quant_tuning("fake")["decode_w2"] == gq.DEFAULT_QUANT_TUNING["decode_w2"]
    (tuned_dir / "moe_quant_fake.json").write_text(json.dumps(
        {"_meta": {"by": "hand"}, "decode_w2": {"BLOCK_D": 2, "num_warps": 2}}))
    assert gq.load_quant_tuning("fake")["decode_w2"]["BLOCK_D"] == 4  # still cached
    gq.clear_quant_tuning_cache()
    got = gq.load_quant_tuning("fake")["decode_w2"]
    assert got == {**gq.DEFAULT_QUANT_TUNING["decode_w2"], "BLOCK_D": 2, "num_warps": 2}
    assert gq.default_quant_tuning("fake")["decode_w2"] == gq.DEFAULT_QUANT_TUNING["decode_w2"]


def test_the_dequantized_path_starts_where_it_wins_at_every_larger_size():
    def rows(*pairs):  # (quant_us, dequant_us) per T of 64, 128, 256, 512 for two formats alike
        return [{"prefill": {T: {"quant_us": q, "dequant_bf16_us": d} for T, (q, d) in zip((64, 128, 256, 512), pairs)}}
                for _ in range(2)]

    assert bq.dequant_threshold(rows((10, 12), (20, 18), (40, 30), (80, 50))) == 128
    assert bq.dequant_threshold(rows((10, 9), (20, 21), (40, 30), (80, 50))) == 256  # a loss at 128: one switch
    assert bq.dequant_threshold(rows((10, 9), (20, 18), (40, 30), (80, 90))) is None  # slower at the largest
    assert bq.dequant_threshold(rows((10, 9), (20, 18), (40, 30), (80, 50))) == 64
    assert bq.dequant_threshold([]) is None
    # the two formats summed: one's small loss under the other's gain
    mixed = rows((10, 12), (20, 18), (40, 30), (80, 50))
    mixed[1]["prefill"][64] = {"quant_us": 10, "dequant_bf16_us": 7}
    assert bq.dequant_threshold(mixed) == 64


def test_a_tuned_dequant_threshold_reaches_the_capacity_test(tuned_dir):
    """A plan does not know its device's tuning: its capacity test counts the dequantized path's scratch
    from the smallest threshold of any tuning, the default's (none: the path is off) or a tuned file's."""
    from ostinato.config import ModelConfig
    from ostinato.engine.sizes import expert_sizes
    from ostinato.loader.build import WeightFormats
    from ostinato.planner.capacity import _dequant_scratch
    from ostinato.synth.presets import preset_config

    cfg = ModelConfig.from_dict(preset_config("tiny"))
    q8 = WeightFormats({l: ("Q8_0", "Q8_0") for l in cfg.moe_layers})  # blocks of 32: the tiny rows hold them
    sizes = expert_sizes(cfg, torch.bfloat16, q8.experts)
    assert gq.DEFAULT_QUANT_TUNING["dequant_min_tokens"] is None
    assert gq.fewest_dequant_tokens() == float("inf")  # no tuning takes the path: no scratch at any size
    assert _dequant_scratch(cfg, 4096, torch.bfloat16, q8, sizes) == 0
    bq.write_quant_tuning({"dequant_min_tokens": 128}, "fake", {"by": "test"}, keys=("dequant_min_tokens",),
                          meta_key="_meta_dequant")
    assert gq.load_quant_tuning("fake")["dequant_min_tokens"] == 128
    assert gq.fewest_dequant_tokens() == 128
    bq.write_quant_tuning({"dequant_min_tokens": None}, "other", {"by": "test"}, keys=("dequant_min_tokens",),
                          meta_key="_meta_dequant")  # a device where the path never pays: no bound from it
    assert gq.fewest_dequant_tokens() == 128
    assert _dequant_scratch(cfg, 256, torch.bfloat16, q8, sizes) > 0  # counted from 128 now
    assert _dequant_scratch(cfg, 64, torch.bfloat16, q8, sizes) == 0


def test_a_report_names_the_tuning_the_quantized_kernels_ran(tuned_dir, monkeypatch):
    """A tuned file records the commit of the kernels it tuned; a bench report of quantized experts says which
    file (or the defaults) the GPU kernels ran with, and when and at which commit it was tuned, so that a
    tuning older than its kernels shows; a bf16 run says nothing of it."""
    from ostinato.bench.report import _cpu_note

    cpu = torch.device("cpu")
    assert gq.quant_tuning_source(cpu) == {"file": None}
    monkeypatch.setenv("OSTINATO_COMMIT", "0123456789abcdef")
    monkeypatch.setenv("OSTINATO_DIRTY", "0")
    bq.write_quant_tuning(BASE, "cpu", {"written": "2026-12-08T00:00:00", "by": "test"})
    source = gq.quant_tuning_source(cpu)
    assert source == {"file": "moe_quant_cpu.json", "written": "2026-12-08T00:00:00", "commit": "0123456789abcdef"}
    run = {"device": "cuda", "budget": {"groups": {"Q4_K/Q6_K": {}, "Q4_K/Q4_K": {}}}, "quant_tuning": source}
    assert ("- quantized GPU kernels: the tuning of moe_quant_cpu.json, written 2026-12-08T00:00:00 at `0123456`"
            in _cpu_note(run))
    assert ("- quantized GPU kernels: the default configs (no tuned file for this GPU)"
            in _cpu_note(run | {"quant_tuning": {"file": None}}))
    old = run | {"quant_tuning": {"file": "moe_quant_h200.json", "written": "2026-12-01T21:44:24", "commit": None}}
    assert any(line.endswith("written 2026-12-01T21:44:24 (its commit not recorded)") for line in _cpu_note(old))
    assert not any("quantized GPU kernels" in line for line in _cpu_note(run | {"budget": {"groups": {"bfloat16": {}}}}))


# --- on CUDA ------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
def test_tune_writes_a_checked_file_and_benchmarks_with_it(tuned_dir, monkeypatch, capsys):
    tag = ge.device_tag(torch.device("cuda"))
    repo_file = REPO / "ostinato" / "kernels" / "tuned" / f"moe_quant_{tag}.json"
    repo_state = repo_file.read_bytes() if repo_file.exists() else None
    monkeypatch.setattr(sys, "argv", ["bench_gpu_quant.py", "--tune", "--tune-budget-s", "1",
                                      "--layers", "2", "--qtypes", "Q4_K", "--no-bf16"])
    bq.main()
    out = capsys.readouterr().out
    path = tuned_dir / f"moe_quant_{tag}.json"
    doc = json.loads(path.read_text())
    meta = doc["_meta"]
    assert meta["by"] == "scripts/bench_gpu_quant.py --tune"
    assert meta["formats"] == [["Q4_K", "Q4_K"], ["Q4_K", "Q6_K"]]
    assert meta["sweep"]["timed"] >= 2 + 3 and meta["shapes"]["layers"] == 2
    assert set(doc["prefill"]) == {"80", "320", "1000000"}
    result = json.loads(out.strip().splitlines()[-1])
    assert result["tune"]["file"] == str(path)
    for key in ("decode_w13", "decode_w2", "prefill"):
        assert result["tuning"][key] == doc[key]  # the benchmark ran with the written file
    assert all(math.isfinite(v) for r in result["results"] for v in r["rel_err"].values())
    assert all(v < bq.REL_ERR_BOUND for r in result["results"] for v in r["rel_err"].values())
    assert sum("->" in line for line in out.splitlines()) >= 5  # the before/after lines
    assert (repo_file.read_bytes() if repo_file.exists() else None) == repo_state
