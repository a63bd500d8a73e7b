"""`ostinato report --regimes`: the table and ratios come from the bench folders' own numbers,
the [J] target is judged per regime (1.1x where the layers differ, 1.0x where they route alike),
folders measured with anything else different are refused, and the figure is written.

The two bench folders are real `ostinato bench` runs of the tiny model on the CPU (flat and
layered-persistent routing, one held-out turn, the four compared policies); the cases for the
verdicts and the refusals edit copies of their results.json."""
from __future__ import annotations

import io
import json
import shutil
from dataclasses import replace

import pytest

from ostinato.bench.demo import demo_settings, run_demo
from ostinato.bench.regimes import COMPARED, write_regimes_report
from ostinato.cli import main
from ostinato.config import ConfigError
from ostinato.engine.runner import RunnerSettings

REGIMES = ("flat", "layered-persistent")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """regime -> bench folder of a real run (about 15 s each on two cores)."""
    root = tmp_path_factory.mktemp("regimes")
    out = {}
    for r in REGIMES:
        bs = demo_settings(root / r, quick=True, device="cpu", cpu_backend="torch", progress=False)
        bs = replace(bs, model=f"synth:tiny?regime={r}", policies=COMPARED, upper_bound=False, calibrate=False,
                     upload_threshold=64, hot_fraction=None, expert_budget=3 * 2**20, log=False, sweep_prefixes=0,
                     max_output=8,
                     runner=RunnerSettings(device="cpu", max_context=4096, prefill_chunk=256))
        run_demo(bs, stdout=io.StringIO())
        out[r] = root / r
    return out


def _results(folder):
    return json.loads((folder / "results.json").read_text())


def _copy(src, dst, edit):
    """A copy of a bench folder whose results.json edit(doc) changed."""
    shutil.copytree(src, dst)
    doc = _results(dst)
    edit(doc)
    (dst / "results.json").write_text(json.dumps(doc))
    return dst


def _specs(folders):
    return [f"{r}={folders[r]}" for r in REGIMES]


def test_table_and_ratios_are_the_inputs(folders, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["report", "--regimes", *_specs(folders), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    doc = json.loads((out / "regimes.json").read_text())
    assert json.loads(printed[-1])["runs"] == doc["runs"]
    md = (out / "regimes.md").read_text()
    assert [e["name"] for e in doc["runs"]] == list(REGIMES)
    for e, r in zip(doc["runs"], REGIMES):
        res = _results(folders[r])
        assert e["model"] == f"synth:tiny?regime={r}" and e["heterogeneous_layers"] == (r != "flat")
        summ = {n: res["policies"][n]["summary"] for n in COMPARED}
        ours, theirs = summ["ostinato"], summ["fixed-per-layer"]
        for n in COMPARED:
            s, row = summ[n], e["policies"][n]
            assert row["tpot_ms"] == s["tpot_ms"]["median"] and row["total_s"] == s["request_s"]["total"]
            assert row["ttft_tool_ms"] == s["ttft_ms"]["median"]["tool"]
            ttft = "-" if row["ttft_tool_ms"] is None else f"{row['ttft_tool_ms']:.1f}"
            assert f"| {r} | {n} | {ttft} | {s['tpot_ms']['median']:.2f} | {s['request_s']['total']:.2f} |" in md
        t = e["target"]
        tpot = round(theirs["tpot_ms"]["median"] / ours["tpot_ms"]["median"], 3)
        total = round(theirs["request_s"]["total"] / ours["request_s"]["total"], 3)
        sooner = sum(ours["session_s"][k] < theirs["session_s"][k] for k in ours["session_s"])
        assert (t["tpot_ratio"], t["total_ratio"]) == (tpot, total)
        assert t["sessions_sooner"] == [sooner, len(ours["session_s"])]
        need = 1.0 if r == "flat" else 1.1
        assert t["tpot_at_least"] == need and t["met"] == (tpot >= need and total > 1.0)
        assert f"| {r} | {'alike' if r == 'flat' else 'heterogeneous, persistent'} | {tpot:.2f}x | {total:.2f}x | " \
               f"{sooner}/{len(ours['session_s'])} | TPOT >= {need:.1f}x, total > 1x |" in md
        verdict = f"{tpot:.3f}x for TPOT" in md and f"{total:.3f}x for total request time" in md
        assert verdict and ("is met" if t["met"] else "is NOT met") in next(ln for ln in printed if ln.startswith(r))
        # the routing figures the run recorded (persistence from the held-out profile)
        per = res["skew"]["persistence"]
        assert e["routing"] == res["skew"] and f"{100 * per['overlap']:.1f}% ({100 * per['independent']:.1f}%)" in md
    persistent = doc["runs"][1]["routing"]["persistence"]
    assert persistent["excess"] > doc["runs"][0]["routing"]["persistence"]["excess"] + 0.05
    png = (out / "regimes.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "![regimes.png](regimes.png)" in md and doc["files"]["figure"] == str(out / "regimes.png")
    assert "the sample is smaller than a committed result's: held out 1 (committed: >= 8)" in md


def _set_times(doc, tpot: dict, total: dict, ours_sooner: bool):
    for n in COMPARED:
        s = doc["policies"][n]["summary"]
        s["tpot_ms"]["median"], s["request_s"]["total"] = tpot[n], total[n]
        s["session_s"] = {k: (1.0 if (n == "ostinato") == ours_sooner else 2.0) for k in s["session_s"]}


@pytest.mark.parametrize("tpot_ratio, flat_met, layered_met", [(1.15, True, True), (1.05, True, False),
                                                                (0.95, False, False)])
def test_target_threshold_depends_on_the_regime(folders, tmp_path, tpot_ratio, flat_met, layered_met):
    """The same ratios pass under flat (never slower) and fail under heterogeneous layers below 1.1x."""
    tpot = {"ostinato": 10.0, "fixed-per-layer": 10.0 * tpot_ratio, "expert-cache": 30.0, "decaying-cache": 25.0}
    total = {"ostinato": 20.0, "fixed-per-layer": 25.0, "expert-cache": 60.0, "decaying-cache": 50.0}
    specs = [(r, _copy(folders[r], tmp_path / r, lambda d: _set_times(d, tpot, total, True))) for r in REGIMES]
    doc = write_regimes_report(specs, tmp_path / "out")
    flat, layered = (e["target"] for e in doc["runs"])
    assert flat["tpot_ratio"] == layered["tpot_ratio"] == round(tpot_ratio, 3) and flat["total_ratio"] == 1.25
    assert (flat["met"], layered["met"]) == (flat_met, layered_met)
    e = doc["runs"][1]
    assert e["policies"]["expert-cache"]["tpot_speedup"] == 3.0 and e["faster_cache_tpot_speedup"] == 2.5
    # a TPOT win alone is not the target: the sessions must finish sooner too
    slower = {**total, "ostinato": 26.0}
    specs = [(r, _copy(folders[r], tmp_path / f"slow-{r}", lambda d: _set_times(d, tpot, slower, False)))
             for r in REGIMES]
    doc = write_regimes_report(specs, tmp_path / "out2")
    assert all(e["target"]["met"] is False and e["target"]["total_ratio"] < 1 for e in doc["runs"])
    assert all(e["target"]["sessions_sooner"][0] == 0 for e in doc["runs"])
    assert "is NOT met" in (tmp_path / "out2" / "regimes.md").read_text()


def _drop(doc, key, sub):
    doc[key].pop(sub)


EDITS = {
    "budget": lambda d: d["budget"].update(bytes=d["budget"]["bytes"] + 2**20),
    "sessions": lambda d: d["split"].update(max_turns=7),
    "policies": lambda d: _drop(d, "policies", "decaying-cache"),
    "commit": lambda d: d.update(commit="0" * 40),
    "machine": lambda d: d["hardware"].update(physical_cores=d["hardware"]["physical_cores"] + 14),
    "model apart from the regime": lambda d: d.update(model="synth:tiny?regime=layered-persistent&seed=3"),
    "dtype, context and cap": lambda d: d.update(max_context=8192),
    "held-out turns": lambda d: [d["policies"][n]["summary"].update(turns=5) for n in COMPARED],
}


@pytest.mark.parametrize("what", list(EDITS))
def test_incomparable_folders_are_refused(folders, tmp_path, capsys, what):
    odd = _copy(folders["layered-persistent"], tmp_path / "odd", EDITS[what])
    with pytest.raises(ConfigError, match=f"{what} differs"):
        write_regimes_report([("flat", folders["flat"]), ("layered-persistent", odd)], tmp_path / "out")
    assert main(["report", "--regimes", f"flat={folders['flat']}", f"lp={odd}", "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert f"{what} differs" in err and "lp " in err and not (tmp_path / "o2" / "regimes.md").exists()


def test_other_refusals(folders, tmp_path, capsys):
    flat = folders["flat"]
    same = _copy(flat, tmp_path / "again", lambda d: d.update(model="synth:tiny?regime=flat"))
    with pytest.raises(ConfigError, match="route in the same regime"):
        write_regimes_report([("flat", flat), ("again", same)], tmp_path / "out")
    real = _copy(flat, tmp_path / "ckpt", lambda d: d.update(model="/models/qwen3"))
    with pytest.raises(ConfigError, match="not a synthetic model"):
        write_regimes_report([("ckpt", real)], tmp_path / "out")
    no_ours = _copy(folders["layered-persistent"], tmp_path / "no-ours", lambda d: _drop(d, "policies", "ostinato"))
    with pytest.raises(ConfigError, match="did not measure ostinato"):
        write_regimes_report([("lp", no_ours)], tmp_path / "out")
    assert main(["report", "--regimes", f"flat={flat}", f"x={tmp_path / 'nowhere'}", "--out", str(tmp_path)]) == 2
    assert main(["report", "--regimes", str(flat), "--out", str(tmp_path)]) == 2
    assert main(["report", str(flat), "--regimes", f"flat={flat}"]) == 2  # a folder too: one or the other
    err = capsys.readouterr().err
    assert "no results.json" in err and "give NAME=DIR" in err and "drop the folder" in err
    # one regime measured so far still gets its report
    doc = write_regimes_report([("flat", flat)], tmp_path / "one")
    assert len(doc["runs"]) == 1 and (tmp_path / "one" / "regimes.png").is_file()


def test_commits_declared_the_same_code_stand_side_by_side(folders, tmp_path, capsys):
    """--same-code lets runs measured at two commits share a report, and the report says so; any
    other difference is still refused, and so is a lone commit."""
    ours = _results(folders["flat"])["commit"] or "?"  # "?" where the tree has no git
    other = _copy(folders["layered-persistent"], tmp_path / "other", lambda d: d.update(commit="abc1234"))
    specs = [("flat", folders["flat"]), ("layered-persistent", other)]
    with pytest.raises(ConfigError, match="commit differs"):
        write_regimes_report(specs, tmp_path / "refused")
    doc = write_regimes_report(specs, tmp_path / "out", same_code=(ours[:7], "abc1234"))
    assert doc["same_code"] == [ours[:7], "abc1234"] and "abc1234" in doc["commit"]
    assert "declared to run the same code" in (tmp_path / "out" / "regimes.md").read_text()
    odd = _copy(other, tmp_path / "odd", EDITS["budget"])
    with pytest.raises(ConfigError, match="budget differs"):
        write_regimes_report([("flat", folders["flat"]), ("lp", odd)], tmp_path / "o2", same_code=(ours, "abc1234"))
    with pytest.raises(ConfigError, match="at least two commits"):
        write_regimes_report(specs, tmp_path / "o3", same_code=(ours,))
    assert main(["report", "--regimes", f"flat={folders['flat']}", f"lp={other}", "--out", str(tmp_path / "o4"),
                 "--same-code", ours, "abc1234"]) == 0
    assert "declared to run the same code" in (tmp_path / "o4" / "regimes.md").read_text()
