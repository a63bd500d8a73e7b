"""The host's read bandwidth around each policy's replay (a shared VM's drifts by 15-20%, as much
as policies differ by): the probe names which one measured it, bench records it just before and
after each held-out replay (not around tuning) and carries it through --merge, and the report
warns where two compared replays ran at bandwidths more than 5% apart.

The bench runs are real `ostinato bench` runs of the tiny model on the CPU (three policies, then
one more merged in); the report's cases edit copies of their results.json."""
from __future__ import annotations

import io
import json
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from ostinato.bench import bench as bench_mod
from ostinato.bench.demo import demo_settings, run_demo
from ostinato.bench.report import finish_result, host_counter_delta, load_results
from ostinato.layers.moe.cpu_experts import CpuExperts
from ostinato.planner.measure.transfers import host_read_gbps, read_buffer
from tests.test_cpu_experts import make_layer, native_skip_reason

GIB = 1 / 16  # the probes' buffer here: far larger than this machine's caches, cheap on two cores


@pytest.mark.parametrize("backend", ["native", "torch", None])
def test_the_probe_measures_and_names_itself(backend):
    if backend == "native" and native_skip_reason():
        pytest.skip(native_skip_reason())
    cpu = None if backend is None else CpuExperts([make_layer(torch.bfloat16)], num_threads=1, backend=backend)
    try:
        got = host_read_gbps(cpu, [0], gib=GIB)
    finally:
        if cpu is not None:
            cpu.close()
    assert got["probe"] == ("native" if backend == "native" else "torch-sum")
    assert 0 < got["gbps"] < 10_000  # a real read, not a cached or skipped one


def test_the_native_probe_takes_the_best_read_after_the_first():
    times = iter([5.0, 0.4, 0.25, 0.5])  # the first read (first touch, workers waking) is slowest
    cpu = SimpleNamespace(backend="native", read_seconds=lambda buf: next(times))
    buf = read_buffer(GIB)
    got = host_read_gbps(cpu, [0], reps=3, buf=buf)
    assert got == {"gbps": round(2**30 * GIB / 0.25 / 1e9, 2), "probe": "native"}


def _record(mp, events: list, sessions: bool = False) -> None:
    """Patches bench's replay and tuning to note ("replay", policy[, session ids]) and ("tune", policy)."""
    replay, tune = bench_mod._replay_with_progress, bench_mod.tune_threshold

    def replaying(loaded, held, bs, name):
        events.append(("replay", name, tuple(s.id for s in held)) if sessions else ("replay", name))
        return replay(loaded, held, bs, name)

    def tuning(loaded, backend, name, *a, **kw):
        events.append(("tune", name))
        return tune(loaded, backend, name, *a, **kw)

    mp.setattr(bench_mod, "_replay_with_progress", replaying)
    mp.setattr(bench_mod, "tune_threshold", tuning)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A bench folder of ostinato, layers (tuned) and gpu (no CPU pool), then expert-cache merged
    into it; -> (folder, the order of tuning, probes and replays per policy)."""
    out = tmp_path_factory.mktemp("bench")
    bs = demo_settings(out, quick=True, device="cpu", cpu_backend="torch", progress=False)
    bs = replace(bs, policies=("ostinato", "layers", "gpu"), calibrate=False, upload_threshold=64, log=False,
                 sweep_prefixes=0, host_read_gib=GIB, max_sessions=2)  # two: one's first turn fits, to tune on
    events: list[tuple] = []
    probe = bench_mod.host_read_gbps

    def probing(cpu, cpus, **kw):
        events.append(("probe", ""))
        return probe(cpu, cpus, **kw)

    with pytest.MonkeyPatch.context() as mp:
        _record(mp, events)
        mp.setattr(bench_mod, "host_read_gbps", probing)
        run_demo(bs, stdout=io.StringIO())
        first = json.loads((out / "results.json").read_text())
        run_demo(replace(bs, policies=("expert-cache",), merge=True), stdout=io.StringIO())
    return out, first, events


def test_each_replay_is_probed_just_before_and_after(run):
    out, first, events = run
    assert events == [("probe", ""), ("replay", "ostinato"), ("probe", ""),
                      ("tune", "layers"), ("probe", ""), ("replay", "layers"), ("probe", ""),
                      ("replay", "gpu"),  # no CPU pool: no probe
                      ("tune", "expert-cache"), ("probe", ""), ("replay", "expert-cache"), ("probe", "")]
    for name in ("ostinato", "layers"):
        read = first["policies"][name]["host_read_gbps"]
        assert read.keys() == {"before", "after", "probe"} and read["probe"] == "torch-sum"
        assert read["before"] > 0 and read["after"] > 0
    for name in ("ostinato", "layers", "gpu"):  # what else the host did during each replay (Linux's /proc)
        counters = first["policies"][name]["host_counters"]
        assert {"busy", "iowait", "steal", "pgmajfault"} <= counters.keys(), counters
        assert 0 <= counters["steal"] <= 1 and 0 < counters["busy"] <= 1, counters
    assert "host_read_gbps" not in first["policies"]["gpu"]
    # --merge keeps the earlier policies' probes beside the new one's, and compares them
    merged = json.loads((out / "results.json").read_text())
    assert {n: e.get("host_read_gbps") for n, e in merged["policies"].items()} == {
        **{n: e.get("host_read_gbps") for n, e in first["policies"].items()},
        "expert-cache": merged["policies"]["expert-cache"]["host_read_gbps"]}
    assert merged["policies"]["expert-cache"]["host_read_gbps"]["after"] > 0
    comp = merged["comparisons"]
    assert comp["layers"]["host_read_ratio"] > 0 and comp["expert-cache"]["host_read_ratio"] > 0
    assert comp["gpu"]["host_read_ratio"] is None
    report = (out / "report.md").read_text()
    assert "| expert-cache | torch-sum |" in report and "| gpu | torch-sum |" not in report


def test_host_counter_delta_gives_cpu_states_as_shares_and_counts_as_differences():
    before = {"total": 1000, "busy": 600, "iowait": 10, "steal": 0, "pgmajfault": 5, "compact_stall": 1}
    after = {"total": 1400, "busy": 900, "iowait": 10, "steal": 40, "pgmajfault": 7, "compact_stall": 1}
    assert host_counter_delta(before, after) == {"busy": 0.75, "iowait": 0.0, "steal": 0.1, "pgmajfault": 2,
                                                 "compact_stall": 0}
    assert host_counter_delta({}, after) == {} and host_counter_delta(before, {}) == {}


def _report(src, dst, reads: dict) -> tuple[dict, str]:
    """Renders a copy of the bench folder src whose policies' probes are `reads` (None: removed,
    as in a run from before the probe); -> (comparisons, report.md)."""
    shutil.copytree(src, dst)
    result, turns = load_results(dst)
    for name, read in reads.items():
        result["policies"][name].pop("host_read_gbps", None)
        if read is not None:
            result["policies"][name]["host_read_gbps"] = read
    result = finish_result(result, turns, dst, with_plots=False)
    return result["comparisons"], (dst / "report.md").read_text()


def _read(gbps, probe="torch-sum"):
    return {"before": gbps, "after": gbps, "probe": probe}


WARNING = "between the two replays: the decode ratio is confounded by machine drift"


def test_every_policy_reads_the_profiling_placements_host_copies(run):
    """The profiling placement (every expert on the host) is kept as the store every policy's host copies
    are views of (engine/experts.py keep_host_experts), and the results say so."""
    out, first, events = run
    assert first["host_store"] is True
    assert json.loads((out / "results.json").read_text())["host_store"] is True  # the merged run's too


def test_the_report_warns_of_drift_between_compared_replays(run, tmp_path):
    out = run[0]
    comp, md = _report(out, tmp_path / "drift", {"ostinato": {"before": 10.8, "after": 11.2, "probe": "torch-sum"},
                                                 "layers": _read(10.0), "expert-cache": _read(10.8)})
    assert comp["layers"]["host_read_ratio"] == 1.1 and comp["expert-cache"]["host_read_ratio"] == 1.019
    assert f"- **layers**: host read bandwidth differed by 10.0% {WARNING}" in md
    assert md.count(WARNING) == 1  # 2% is within the machine's noise
    assert "| ostinato | torch-sum | 10.8 | 11.2 | +3.7% |" in md
    # a native read and a torch sum do not compare: no ratio, no warning
    comp, md = _report(out, tmp_path / "probes", {"ostinato": _read(11.0), "layers": _read(10.0, "native"),
                                                  "expert-cache": _read(11.0)})
    assert comp["layers"]["host_read_ratio"] is None and WARNING not in md


def test_a_run_from_before_the_probe_still_renders(run, tmp_path):
    comp, md = _report(run[0], tmp_path / "old", dict.fromkeys(("ostinato", "layers", "expert-cache")))
    assert all(c["host_read_ratio"] is None for c in comp.values())
    assert "Host-memory read bandwidth" not in md and WARNING not in md and "| layers |" in md


def test_rounds_interleave_the_policies_over_slices_of_the_held_out_sessions(tmp_path):
    """--rounds 2: each policy is built and replayed on each half of the held-out sessions, the order
    reversed in the second round (ABBA), tuned only in the first; one entry per policy over all."""
    bs = demo_settings(tmp_path, quick=True, device="cpu", cpu_backend="torch", progress=False)
    bs = replace(bs, policies=("ostinato", "layers"), calibrate=False, upload_threshold=64, log=False,
                 sweep_prefixes=0, host_read_gib=GIB, max_sessions=2, max_turns=2, rounds=2)
    events: list[tuple] = []
    with pytest.MonkeyPatch.context() as mp:
        _record(mp, events, sessions=True)
        run_demo(bs, stdout=io.StringIO())
    result = json.loads((tmp_path / "results.json").read_text())
    assert [e[:2] for e in events] == [("replay", "ostinato"), ("tune", "layers"), ("replay", "layers"),
                                       ("replay", "layers"), ("replay", "ostinato")]
    slices = [e[2] for e in events if e[0] == "replay"]
    assert slices[0] == slices[1] and slices[2] == slices[3] and not set(slices[0]) & set(slices[2])
    held = result["split"]["held_out"]
    assert len(slices[0]) + len(slices[2]) == held
    for name in ("ostinato", "layers"):
        e = result["policies"][name]
        assert e["rounds"] == 2 and len(e["host_read_gbps"]["rounds"]) == 2
        assert e["summary"]["sessions"] == held
        assert {t["session"] for t in result["turns"][name]} == set(slices[0]) | set(slices[2])
    layers = result["policies"]["layers"]
    assert layers["offload_threshold"] == layers["tuning"]["chosen"]
    assert layers["cpu_backend"] == "torch"  # asked for: the report says its CPU times are plain torch's
    assert "layers: its CPU experts ran on plain torch" in (tmp_path / "report.md").read_text()
    for name in ("ostinato", "layers"):  # each round's own figures, and the totals add up
        rounds = result["policies"][name]["by_round"]
        assert [r["sessions"] for r in rounds] == [len(slices[0]), len(slices[2])]
        assert sum(r["total_s"] for r in rounds) == pytest.approx(result["policies"][name]["summary"]["request_s"]
                                                                ["total"], abs=1e-3)
    report = (tmp_path / "report.md").read_text()
    assert "replayed in 2 rounds" in report and "| layers | 2 | " in report
    assert result["comparisons"]["layers"]["same_run"]


def test_rounds_outside_the_held_out_sessions_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    from ostinato.config import ConfigError

    monkeypatch.setattr(bench_mod, "load_engine", lambda *a, **kw: pytest.fail("loaded the model"))
    bs = demo_settings(tmp_path, quick=True, device="cpu", cpu_backend="torch", progress=False)
    for rounds in (0, 99):
        with pytest.raises(ConfigError, match=f"--rounds {rounds}: give 1 to"):
            bench_mod.run_bench(replace(bs, rounds=rounds, log=False))
