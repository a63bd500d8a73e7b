"""`ostinato demo --quick`: the whole benchmark (profile, plan, calibrate, every policy,
tuning, held-out replay, length sweep, report, plots) on the tiny model, end to end."""
from __future__ import annotations

import json

from ostinato.policies.settings import POLICIES


def test_demo_runs_end_to_end(tmp_path, capsys):
    from ostinato.cli import main

    out = tmp_path / "demo"
    rc = main(["demo", "--quick", "--out", str(out), "--device", "cpu", "--cpu-backend", "torch", "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out.strip().splitlines()
    result = json.loads(printed[-1])
    assert result["kind"] == "ostinato.bench" and result["model"] == "synth:tiny"
    assert 0 < result["load_s"] < result["elapsed_s"]  # the model's load, timed apart
    assert set(result["policies"]) == set(POLICIES)
    for name, entry in result["policies"].items():
        assert "summary" in entry, (name, entry.get("skipped"))
        assert entry["summary"]["turns"] >= 1 and entry["summary"]["failed_turns"] == 0, name
        assert entry["sweep"]["points"], name
    assert result["policies"]["gpu"]["over_budget"] is True
    assert 0 < result["skew"]["held_out_all_share"] <= 1
    assert result["budget"]["pool_slots"] > result["budget"]["hot"] > 0
    assert set(result["comparisons"]) == set(POLICIES) - {"ostinato"}
    for key in ("commit", "dirty", "date", "hardware"):
        assert key in result
    table = "\n".join(printed[:-1])
    for name in POLICIES:
        assert name in table
    assert "TTFT tool ms" in table and "report:" in table
    for f in ("report.md", "results.json", "residency.json", "ttft_cdf.png", "prefill_decode.png",
              "ttft_vs_new_tokens.png", "decode_vs_resident.png"):
        assert (out / f).is_file(), f
    full = json.loads((out / "results.json").read_text())
    assert full["turns"]["ostinato"] and "| ostinato |" in (out / "report.md").read_text()
    assert full["policies"]["ostinato"]["wall_s"].keys() == {"replay", "sweep", "build"}
    for entry in full["policies"].values():  # the build in its parts, which add up to it (rounding aside)
        parts = entry["build_parts_s"]
        assert parts.keys() == {"placement", "graphs", "warm_up"}
        assert abs(sum(parts.values()) - entry["wall_s"]["build"]) <= 0.2
    # the planner weighed the upload path on the calibration: Ostinato runs the plan it chose, the
    # ktransformers baseline the plan with the upload path, both in the budget's bytes
    up, pol, budget = result["np"]["upload_path"], result["policies"], result["budget"]
    assert {"on", "why", "gain_ms", "cost_ms", "hot_with_flex", "hot_without_flex"} <= set(up)
    assert pol["ostinato"]["resident_experts"] == budget["hot"]
    assert pol["ktransformers"]["resident_experts"] == up["hot_with_flex"]
    if up["on"]:
        assert pol["ostinato"]["upload_threshold"] == result["np"]["value"] and budget["hot"] == up["hot_with_flex"]
    else:
        assert pol["ostinato"]["upload_threshold"] is None and result["np"]["value"] is None
        assert budget["hot"] == up["hot_without_flex"] and result["np"]["how"].startswith("none: ")
        assert f"Np {result['np']['how']}" in (out / "report.md").read_text()
    assert json.loads((out / "residency.json").read_text())["hot_experts"] == budget["hot"]

    # `ostinato report` writes the report and plots again from results.json alone
    for f in ("report.md", "ttft_cdf.png"):
        (out / f).unlink()
    assert main(["report", str(out)]) == 0
    assert (out / "ttft_cdf.png").is_file() and "| ostinato |" in (out / "report.md").read_text()
    again = json.loads((out / "results.json").read_text())
    assert again["policies"] == full["policies"] and again["turns"] == full["turns"]
    assert main(["report", str(tmp_path / "nowhere")]) == 2  # a clear error, not a traceback
