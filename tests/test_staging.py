"""The staging rule of captured passes (layers/moe/staging.py) against a plain statement of it, its
copy by torch and by the Triton kernel under the interpreter (kernels/triton/stage.py), and the
worker's side of the rule (tests/test_graph_worker.py). On CUDA: tests/test_graph.py
test_pass_graphs_stage_cold_experts.

Legend: B rows of a pass, n real ones, K top-k, E experts.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ostinato.config import ConfigError
from ostinato.layers.moe.staging import MeanRoutes, copy, env_stage_routes, plan, stages
from tests.triton_interpreter import run_interpreted


def rule(ids: torch.Tensor, n: int, table: torch.Tensor, min_routes: int, cap: int) -> list[int]:
    """The staged experts, plainly: the cold experts with at least min_routes routes among the first n
    rows, the first cap of them in expert order."""
    routes = {}
    for e in ids[:n].flatten().tolist():
        routes[e] = routes.get(e, 0) + 1
    cold = [e for e in range(table.numel()) if table[e] < 0 and routes.get(e, 0) >= min_routes]
    return cold[:cap]


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 12), n=st.integers(1, 12), E=st.integers(8, 24), K=st.integers(1, 4),
       cold=st.floats(0.0, 1.0), m=st.integers(1, 4), cap=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_plan_follows_the_rule(B, n, E, K, cold, m, cap, seed):
    n = min(n, B)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)])  # int64, as the router's
    table = torch.arange(E, dtype=torch.int32)
    table[torch.rand(E, generator=g) < cold] = -1
    flex_lo = 50
    mean = -(-n * K // E)  # the mean expert's routes among the n rows, rounded up
    for real in (torch.arange(B) < n, torch.arange(B) < torch.tensor([n], dtype=torch.int32)):  # StepRows.valid
        for r, least in ((m, m), (MeanRoutes(m), max(m, mean))):  # "mean": at least that and at least m
            staged, pick, rank = plan(ids, real, table, r, cap, flex_lo)
            want = rule(ids, n, table, least, cap)
            assert pick.nonzero().flatten().tolist() == want, r
        staged, pick, rank = plan(ids, real, table, m, cap, flex_lo)
        want = rule(ids, n, table, m, cap)
        assert staged.dtype == torch.int32
        assert [int(staged[e]) for e in want] == list(range(flex_lo, flex_lo + len(want)))
        others = [e for e in range(E) if e not in want]
        assert (staged[others] == -1).all()  # hot experts and unstaged cold ones: not in the staged row


@settings(max_examples=80, deadline=None)
@given(B=st.integers(1, 24), n=st.integers(1, 24), E=st.integers(8, 24), K=st.integers(1, 4),
       cold=st.floats(0.0, 1.0), cap=st.integers(0, 8), costs=st.tuples(*[st.integers(0, 40)] * 4),
       seed=st.integers(0, 2**16))
def test_balanced_plan_is_the_split_with_uploads_choice(B, n, E, K, cold, cap, costs, seed):
    """The "balance" rule stages what HybridExperts' split with uploads would upload of the same routes
    (hybrid.py upload_plan with MixedPass.choose): the same experts, most-routed first, a tie the lower id.
    Whole costs, so that the host's float sums are exact too."""
    import numpy as np

    from ostinato.layers.moe.hybrid import MixedPass, upload_plan
    from ostinato.layers.moe.staging import StageCosts

    n = min(n, B)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)])
    table = torch.arange(E, dtype=torch.int32)
    table[torch.rand(E, generator=g) < cold] = -1
    staged, pick, rank = plan(ids, torch.arange(B) < n, table, StageCosts(*costs), cap, 50)
    mixed = MixedPass(*(float(c) for c in costs))
    cold_routes = (table[ids[:n]] < 0).numpy()
    want = upload_plan(ids[:n].numpy(), cold_routes, E, mixed.choose, cap) if cold_routes.any() else np.array([])
    assert sorted(pick.nonzero().flatten().tolist()) == sorted(want.tolist())
    assert [int(staged[e]) for e in want] == list(range(50, 50 + len(want)))  # slots in the upload order
    assert (staged[~pick] == -1).all() and staged.dtype == torch.int32


def test_rows_past_the_count_stage_nothing():
    """Padding rows of a captured pass route too: their routes count for nothing."""
    ids = torch.tensor([[0, 1], [2, 3], [5, 6], [5, 6], [5, 6]])
    table = torch.tensor([-1, -1, -1, 4, 5, -1, -1, 7], dtype=torch.int32)
    _, pick, _ = plan(ids, torch.arange(5) < 2, table, 1, 8, 10)
    assert pick.nonzero().flatten().tolist() == [0, 1, 2]
    _, pick, _ = plan(ids, torch.arange(5) < 5, table, 2, 8, 10)
    assert pick.nonzero().flatten().tolist() == [5, 6]


def test_copy_puts_staged_experts_in_their_flex_slots():
    g = torch.Generator().manual_seed(3)
    src = torch.randn(5, 3, 4, generator=g).bfloat16()  # a layer's host stack: 5 cold experts
    dst = torch.zeros(9, 3, 4, dtype=torch.bfloat16)  # a pool: 6 slots, then 3 flex slots
    rows = torch.tensor([-1, 0, 1, -1, 2, 3, 4, -1], dtype=torch.int32)  # expert -> its host row
    table = torch.where(rows >= 0, -1, 0).to(torch.int32)
    ids = torch.tensor([[1, 4], [4, 6], [6, 2]])
    row, pick, rank = plan(ids, torch.arange(3) < 3, table, 2, 3, 6)
    copy(src, dst, rows, pick, rank, 6)
    assert pick.nonzero().flatten().tolist() == [4, 6]
    assert torch.equal(dst[6], src[2]) and torch.equal(dst[7], src[4])
    assert not dst[:6].any() and not dst[8].any()
    assert row[4] == 6 and row[6] == 7


def test_env_stage_routes(monkeypatch):
    """Unset: m = 16 where the CPU experts put larger groups of routes on the int8 tiles by default, else
    12; a count or "balance" as given; anything else refused with the variable's name."""
    from ostinato.layers.moe import cpu_experts

    monkeypatch.delenv("OSTINATO_STAGE_ROUTES", raising=False)
    for tiles, m in ((True, 16), (False, 12)):
        monkeypatch.setattr(cpu_experts, "int8_tiles_by_default", lambda: tiles)
        assert env_stage_routes() == m and stages()
    monkeypatch.undo()
    monkeypatch.setenv("OSTINATO_AMX_INT8", "0")  # the tiles switched off: the row kernels' m
    monkeypatch.delenv("OSTINATO_STAGE_ROUTES", raising=False)
    assert not cpu_experts.int8_tiles_by_default() and env_stage_routes() == 12
    for value in (0, 4):
        monkeypatch.setenv("OSTINATO_STAGE_ROUTES", str(value))
        assert env_stage_routes() == value and stages() == bool(value)
    for rule in ("balance", "mean"):
        monkeypatch.setenv("OSTINATO_STAGE_ROUTES", rule)
        assert env_stage_routes() == rule and stages()
    for bad in ("-1", "two", "Balance", "Mean"):
        monkeypatch.setenv("OSTINATO_STAGE_ROUTES", bad)
        with pytest.raises(ConfigError, match="OSTINATO_STAGE_ROUTES"):
            env_stage_routes()


def test_rules_resolve_as_a_pass_takes_them(monkeypatch):
    """"balance" takes the placement's calibrated costs (without them the default m), "mean" the default m
    as its least count, a count stays; each is said in words for the report."""
    from ostinato.layers.moe import cpu_experts
    from ostinato.layers.moe.hybrid import MixedPass
    from ostinato.layers.moe.staging import StageCosts, describe, resolve

    monkeypatch.setattr(cpu_experts, "int8_tiles_by_default", lambda: True)
    costs = MixedPass(0.01, 0.0, 0.005, 0.005)
    assert resolve("balance", costs) == StageCosts(10_000, 0, 5_000, 5_000) and resolve("balance", None) == 16
    assert resolve("mean", costs) == MeanRoutes(16) and resolve(7, costs) == 7
    assert "at least 7 routes" in describe(7) and "mean" in describe("mean") and "balance" in describe("balance")


def test_stage_programs_are_the_default_grid_unless_set(monkeypatch):
    """OSTINATO_STAGE_PROGRAMS: unset or 0, the default grid (None); a count of programs; anything else refused
    with the variable's name."""
    from ostinato.layers.moe.staging import env_stage_programs

    monkeypatch.delenv("OSTINATO_STAGE_PROGRAMS", raising=False)
    assert env_stage_programs() is None
    for v, want in (("0", None), ("16", 16)):
        monkeypatch.setenv("OSTINATO_STAGE_PROGRAMS", v)
        assert env_stage_programs() == want
    for bad in ("-4", "grid", "1.5"):
        monkeypatch.setenv("OSTINATO_STAGE_PROGRAMS", bad)
        with pytest.raises(ConfigError, match="OSTINATO_STAGE_PROGRAMS"):
            env_stage_programs()


def test_stage_from_is_the_rules_count_unless_set(monkeypatch):
    """Unset: a pass of fewer rows than the rule's count cannot stage (1 under "balance"); OSTINATO_STAGE_FROM
    a count of rows, at least 1, anything else refused with the variable's name."""
    from ostinato.layers.moe.staging import StageCosts, stage_from

    monkeypatch.delenv("OSTINATO_STAGE_FROM", raising=False)
    assert stage_from(16) == 16 and stage_from(MeanRoutes(12)) == 12 and stage_from(StageCosts(1, 2, 3, 4)) == 1
    monkeypatch.setenv("OSTINATO_STAGE_FROM", "256")
    assert stage_from(16) == 256 and stage_from(StageCosts(1, 2, 3, 4)) == 256
    for bad in ("0", "-4", "many", "2.5"):
        monkeypatch.setenv("OSTINATO_STAGE_FROM", bad)
        with pytest.raises(ConfigError, match="OSTINATO_STAGE_FROM"):
            stage_from(16)


def test_the_prefetch_settings_refuse_what_is_not_a_count(monkeypatch):
    """OSTINATO_PREFETCH (0: off), OSTINATO_PREFETCH_FROM (at least 2 rows), OSTINATO_PREFETCH_FULL_FROM (0: P
    always) and OSTINATO_PREFETCH_PROGRAMS (at least 1): their defaults where unset, and anything else refused
    by name."""
    from ostinato.layers.moe.staging import (DEFAULT_PREFETCH, DEFAULT_PREFETCH_FROM, DEFAULT_PREFETCH_FULL_FROM,
                                             DEFAULT_PREFETCH_PROGRAMS, env_prefetch, env_prefetch_from,
                                             env_prefetch_full_from, env_prefetch_programs)

    names = ("OSTINATO_PREFETCH", "OSTINATO_PREFETCH_FROM", "OSTINATO_PREFETCH_FULL_FROM", "OSTINATO_PREFETCH_PROGRAMS")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    assert (env_prefetch(), env_prefetch_from(), env_prefetch_full_from(), env_prefetch_programs()) == (
        DEFAULT_PREFETCH, DEFAULT_PREFETCH_FROM, DEFAULT_PREFETCH_FULL_FROM, DEFAULT_PREFETCH_PROGRAMS) == (
        24, 64, 88, 64)
    monkeypatch.setenv("OSTINATO_PREFETCH", "0")
    monkeypatch.setenv("OSTINATO_PREFETCH_FULL_FROM", "0")
    assert env_prefetch() == env_prefetch_full_from() == 0
    for name, fn, bad in (("OSTINATO_PREFETCH", env_prefetch, ("-1", "x", "1.5")),
                          ("OSTINATO_PREFETCH_FROM", env_prefetch_from, ("1", "0", "many")),
                          ("OSTINATO_PREFETCH_FULL_FROM", env_prefetch_full_from, ("-8", "half")),
                          ("OSTINATO_PREFETCH_PROGRAMS", env_prefetch_programs, ("0", "-4", "all"))):
        for v in bad:
            monkeypatch.setenv(name, v)
            with pytest.raises(ConfigError, match=name):
                fn()
        monkeypatch.delenv(name)


def test_a_short_pass_prefetches_half():
    """prefetch_limit: P in a pass of at least full_from real rows, P // 2 below (full_from 0: P); top_cold
    picks that many of the best positive scores, never one of none, and ranks the P best in score order."""
    from ostinato.layers.moe.staging import prefetch_limit, top_cold

    n = lambda v: torch.tensor([v], dtype=torch.int32)  # noqa: E731
    assert [int(prefetch_limit(24, 88, n(v))) for v in (1, 87, 88, 511)] == [12, 12, 24, 24]
    assert [int(prefetch_limit(5, 88, n(v))) for v in (87, 88)] == [2, 5]
    assert int(prefetch_limit(24, 0, n(3))) == 24
    score = torch.tensor([0.0, 5.0, 1.0, 0.0, 3.0, 4.0, 2.0, 0.0])
    for limit, want in ((4, [1, 5, 4, 6]), (2, [1, 5]), (6, [1, 5, 4, 6, 2])):  # only 5 have a score
        pick, rank = top_cold(score, 6, torch.tensor([limit]))
        assert pick.nonzero().flatten().tolist() == sorted(want)
        assert [int(rank[e]) for e in want] == list(range(len(want)))


def test_report_says_which_passes_stage():
    """A bench report names the staging rule of its captured passes, and the pass size they stage from
    where OSTINATO_STAGE_FROM set one."""
    from ostinato.bench.report import _cpu_note

    run = {"device": "cuda", "pass_graphs": 511, "stage_routes": 16, "stage_from": None}
    assert any("at least 16 routes" in line for line in _cpu_note(run))
    assert not any("OSTINATO_STAGE_FROM" in line for line in _cpu_note(run))
    assert any("at least 256 rows stage" in line for line in _cpu_note(run | {"stage_from": "256"}))
    assert not any("OSTINATO_STAGE_PROGRAMS" in line for line in _cpu_note(run | {"stage_programs": None}))
    assert ("- a layer's own staging copies run on 64 programs, not the default grid (OSTINATO_STAGE_PROGRAMS)"
            in _cpu_note(run | {"stage_programs": 64}))
    assert any("padded to 8, 16, 32, 64, 128, 256, 511 rows (" in line for line in _cpu_note(run))
    # the prefetch, as set, and what the pools took where that is less
    assert not any("OSTINATO_PREFETCH" in line for line in _cpu_note(run | {"prefetch": 0, "prefetch_from": 64}))
    pre = run | {"prefetch": 36, "prefetch_from": 64, "policies": {"ostinato": {"prefetch_taken": [36]}}}
    assert [line for line in _cpu_note(pre) if "OSTINATO_PREFETCH" in line] == [
        "- passes of at least 64 rows also copy each next layer's 36 cold experts of most routes in the passes "
        "before, while the layer before it runs, on 64 programs (OSTINATO_PREFETCH, OSTINATO_PREFETCH_FROM, "
        "OSTINATO_PREFETCH_PROGRAMS)"]
    assert [line for line in _cpu_note(pre | {"prefetch_full_from": 88}) if "OSTINATO_PREFETCH" in line] == [
        "- passes of at least 64 rows also copy each next layer's 36 cold experts of most routes in the passes "
        "before (18 in a pass of fewer than 88 real rows), while the layer before it runs, on 64 programs "
        "(OSTINATO_PREFETCH, OSTINATO_PREFETCH_FROM, OSTINATO_PREFETCH_FULL_FROM, OSTINATO_PREFETCH_PROGRAMS)"]
    pre["policies"]["ostinato"]["prefetch_taken"] = [25, 36]
    assert any(line.endswith("(the pools took 25, 36: a third of their flex slots at most)")
               for line in _cpu_note(pre))
    # the AMX int8 tiles take Q4_K and Q6_K projections alone: not said of an MXFP4 model's run
    run = run | {"amx_int8_min_tokens": 4}
    assert any("AMX int8 tiles" in line for line in _cpu_note(run))
    assert any("AMX int8 tiles" in line for line in _cpu_note(run | {"budget": {"groups": {"Q4_K/Q6_K": {}}}}))
    assert not any("AMX int8 tiles" in line for line in _cpu_note(run | {"budget": {"groups": {"MXFP4/MXFP4": {}}}}))
    mx = run | {"amx_int8_min_tokens_mxfp4": 8, "budget": {"groups": {"MXFP4/MXFP4": {}}}}
    assert [line for line in _cpu_note(mx) if "AMX int8" in line] == [
        "- CPU experts: the MXFP4 projections of quantized experts with at least 8 routes of a pass on the AMX int8 "
        "tiles (OSTINATO_AMX_INT8)"]
    assert any("128, 192, 256, 383, 511 rows (with the midpoints from 128 rows" in line
               for line in _cpu_note(run | {"pass_midpoints": 128}))


KERNEL = """
import torch
from ostinato.kernels.triton import stage
from ostinato.layers.moe.staging import as_bytes, plan

g = torch.Generator().manual_seed(0)
stage.CHUNK, stage.STEPS = 64, 2  # an expert of 600 bytes: 5 programs, and a partial last step
src = torch.randint(0, 256, (6, 600), dtype=torch.uint8, generator=g)
for rows_of, programs in (("identity", None), ("shuffled", None), ("shuffled", 3)):
    rows = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5], dtype=torch.int32)
    if rows_of == "shuffled":
        rows = torch.tensor([5, -1, 3, 0, -1, 1, 4, 2], dtype=torch.int32)
    table = torch.where(rows >= 0, -1, 7).to(torch.int32)
    ids = torch.tensor([[0, 2], [2, 3], [3, 5], [7, 0]])
    dst = torch.zeros(12, 600, dtype=torch.uint8)
    _, pick, rank = plan(ids, torch.arange(4) < 4, table, 2, 8, 9)
    stage.copy_experts(src, as_bytes(dst), rows, pick, rank, 9, programs, 64)  # 3 programs: 10 chunks, a partial last
    staged = pick.nonzero().flatten().tolist()
    assert staged == [0, 2, 3], staged
    for i, e in enumerate(staged):
        assert torch.equal(dst[9 + i], src[int(rows[e])]), (rows_of, e)
    assert not dst[:9].any(), (rows_of, programs)
print("INTERPRETER_OK")
"""


PLAN_KERNEL = """
import torch
from ostinato.kernels.triton.stage import plan_experts
from ostinato.layers.moe.staging import MeanRoutes, StageCosts, kernel_rule, plan

g = torch.Generator().manual_seed(1)
cases = 0
for E, B, K in ((16, 5, 2), (24, 12, 4), (60, 9, 4), (128, 16, 8)):
    for trial in range(6):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)])
        table = torch.arange(E, dtype=torch.int32)
        table[torch.rand(E, generator=g) < 0.7] = -1
        n = int(torch.randint(1, B + 1, (1,), generator=g))
        costs = StageCosts(*torch.randint(0, 30, (4,), generator=g).tolist())
        for rule in (1, 2, MeanRoutes(1), MeanRoutes(2), costs, StageCosts(0, 0, 0, 0)):  # the last: all tie, so none
            for cap in (0, 3, E):
                bytes_ = torch.zeros((), dtype=torch.int64)
                row, pick, rank = plan_experts(ids, torch.tensor([n], dtype=torch.int32), table, cap, 40, 7, bytes_,
                                               **kernel_rule(rule))
                want_row, want_pick, want_rank = plan(ids, torch.arange(B) < n, table, rule, cap, 40)
                assert torch.equal(pick, want_pick), (E, B, n, rule, cap, pick.nonzero(), want_pick.nonzero())
                assert torch.equal(row, want_row) and torch.equal(rank[pick], want_rank[pick]), (E, rule, cap)
                assert int(bytes_) == 7 * int(want_pick.sum())
                cases += int(0 < int(pick.sum()) < int((table[ids[:n]] < 0).any(1).sum()))
assert cases > 10, cases  # some cases stage part of the cold experts
print("INTERPRETER_OK")
"""


def test_plan_kernel_under_the_interpreter():
    """kernels/triton/stage.py plan_experts, the rule in one launch, against `plan` (both rules, caps of
    none, some and all)."""
    pytest.importorskip("triton")
    run_interpreted(PLAN_KERNEL, timeout=600)


def test_copy_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(KERNEL, timeout=300)


def test_a_staged_layer_equals_the_split_path(tiny_dir, tmp_path, monkeypatch):
    """PassStaging on a CPU engine (the "GPU" branch through torch): a layer's pass of n real rows padded
    to B, the pool's experts over the layer's own row, the staged ones copied into the flex slots and
    computed from there, the CPU computing the other cold routes as the worker would, equals the
    host-driven split path of the n rows; the padding rows compute no expert. Its copies take
    OSTINATO_STAGE_PROGRAMS' programs."""
    from ostinato.engine.placement import PlacementSettings
    from ostinato.engine.runner import RunnerSettings
    from ostinato.layers.moe import staging as st
    from ostinato.layers.moe.backend import StepRows
    from ostinato.layers.moe.staging import PassStaging
    from ostinato.layers.moe.types import TopKOutput
    from ostinato.load import load_engine
    from tests.test_hybrid import _residency_for

    settings = RunnerSettings(device="cpu", dtype="fp32", max_context=256)
    probe = load_engine(str(tiny_dir), settings)
    _residency_for(probe.source, 0.5).save(tmp_path / "r.json")
    hyb = load_engine(str(tiny_dir), settings, PlacementSettings(residency=str(tmp_path / "r.json"))).runner.experts
    monkeypatch.setenv("OSTINATO_STAGE_PROGRAMS", "32")
    programs, copy = [], st.copy
    monkeypatch.setattr(st, "copy", lambda *a, **k: programs.append(a[7]) or copy(*a, **k))
    staging = PassStaging(hyb, 2)
    cfg = probe.source.config
    g = torch.Generator().manual_seed(5)
    n, B = 12, 16
    count = torch.tensor([n], dtype=torch.int32)
    for layer in staging.layers[:3]:
        ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok] for _ in range(B)])
        w = torch.rand(B, ids.shape[1], generator=g)
        x = torch.randn(B, cfg.hidden_size, generator=g)
        pool, table = hyb.pools.of(layer), hyb.host.compact[layer]
        staged = staging.choose(layer, ids, StepRows(count, torch.arange(B) < n))
        pick = staged.pick
        assert pick.any() and (pool.table[layer][pick] < 0).all() and torch.equal(staged.row >= 0, pick)
        staging.stage(layer, staged)
        gpu = pool.forward(x, pool.slots_in(pool.table[layer], ids, count), w, out_dtype=torch.float32)
        hyb.copies_landed()
        gpu = gpu + pool.forward(x, pool.slots_in(staged.row, ids, count), w, out_dtype=torch.float32)
        assert not gpu[n:].any()
        cid = table[ids[:n]]
        cold = (cid >= 0) & ~pick[ids[:n]]
        tok = cold.nonzero()[:, 0].to(torch.int32)
        cpu = hyb.cpu.forward(layer, x[:n], tok, cid[cold], w[:n][cold])
        want = hyb.split_path(layer, x[:n], TopKOutput(ids[:n], w[:n])).float()
        assert torch.allclose(gpu[:n] + cpu, want, rtol=1e-4, atol=1e-5), (gpu[:n] + cpu - want).abs().max()
    assert int(staging.staged_bytes) > 0
    assert programs and set(programs) == {32}
    hyb.close()


CAPTURED_PASS = """
import os
import torch
from ostinato.engine.placement import PlacementSettings
from ostinato.engine.runner import RunnerSettings
from ostinato.layers.moe.backend import StepRows
from ostinato.layers.moe.graph_hybrid import GraphHybridExperts
from ostinato.layers.moe.hybrid import MixedPass
from ostinato.layers.moe.staging import StageCosts
from ostinato.layers.moe.types import TopKOutput
from ostinato.load import load_engine

hyb = load_engine(CKPT, RunnerSettings(device="cpu", dtype="fp32", max_context=256),
                  PlacementSettings(residency=RES, cpu_backend="native")).runner.experts
# as apply_calibration sets them on a GPU: an upload 0.01 ms, the CPU 0.005 ms an expert and a route
hyb.stage_passes, hyb.stage_costs = True, MixedPass(0.01, 0.0, 0.005, 0.005)
# passes of 12 and 16 rows copy both prefetched experts a layer, that of 3 one
os.environ["OSTINATO_PREFETCH_FULL_FROM"] = "12"
for rule, prefetch in ((2, 0), ("balance", 0), (2, 2)):
    os.environ["OSTINATO_PREFETCH"], os.environ["OSTINATO_PREFETCH_FROM"] = str(prefetch), "8"
    g = GraphHybridExperts(hyb, max_rows=16, stage_routes=rule)
    assert g.staging is not None and g.shared.staged is not None and g.staging.prefetches == bool(prefetch)
    assert g.staging.rule == (2 if rule == 2 else StageCosts(10_000, 0, 5_000, 5_000))
    # the interpreter takes the shared tensors themselves (a HostPointer is the GPU's view of them)
    g.views = {i: tuple(p.t for p in v) for i, v in g.views.items()}
    g.staged_views = {i: p.t for i, p in g.staged_views.items()}
    cfg_E, K = hyb.pools.groups[0].table.shape[1], hyb.pools.top_k
    gen = torch.Generator().manual_seed(7)
    B, layers = 16, [l for l, c in hyb.has_cold.items() if c]
    for n in (12, 3, 16):  # a step per pass: every layer with cold experts, in order, as the worker serves them
        rows = StepRows(torch.tensor([n], dtype=torch.int32), torch.arange(B) < n)
        g.before_step(rows)
        for layer in layers:
            ids = torch.stack([torch.randperm(cfg_E, generator=gen)[:K] for _ in range(B)])
            w = torch.rand(B, K, generator=gen)
            x = torch.randn(B, hyb.pools.hidden, generator=gen)
            y = g(layer, x, TopKOutput(ids, w))
            want = hyb.split_path(layer, x[:n], TopKOutput(ids[:n], w[:n]))
            assert torch.allclose(y[:n], want, rtol=1e-4, atol=1e-5), (rule, n, layer, (y[:n] - want).abs().max())
        g.after_step()
    stats = g.worker.stats()
    assert stats["staged_experts"] > 0 and stats["desync"] == stats["errors"] == 0, stats
    # the first pass prefetches nothing (no history yet), the later ones do
    assert (int(g.staging.prefetched_bytes) > 0) == bool(prefetch), int(g.staging.prefetched_bytes)
    g.stop()
print("INTERPRETER_OK")
"""


def test_a_captured_pass_under_the_interpreter_equals_the_split_path(tiny_dir, tmp_path):
    """GraphHybridExperts' captured-pass path on the CPU, its handshake kernels under the interpreter and
    the native worker beside them: the rule chooses (m = 2, and balance by given costs), the marks go to
    the worker with the routing, the staged experts are copied and computed apart, padding rows past n are
    left alone; the n rows equal the host-driven split path, and both rules staged some experts. With
    OSTINATO_PREFETCH=2, each layer also copies two experts for the next by the passes before, which the
    next layer leaves out of its own plan and its worker out of the CPU branch: the rows still equal."""
    pytest.importorskip("triton")
    from ostinato.kernels.cpu.build import load_cpu_extension
    from tests.test_hybrid import _residency_for
    from ostinato.loader.source import CheckpointSource

    if load_cpu_extension() is None:
        pytest.skip("no native CPU extension")
    _residency_for(CheckpointSource(tiny_dir), 0.5).save(tmp_path / "r.json")
    script = CAPTURED_PASS.replace("CKPT", repr(str(tiny_dir))).replace("RES", repr(str(tmp_path / "r.json")))
    run_interpreted(script, timeout=900)
