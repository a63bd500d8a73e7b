"""scripts/fill_compare.py on session 16's profiles and session 17's calibration (H200 machine): the
fill by time saved sends fewer held-out decode routes to the CPU than the fill by route counts, as many
experts resident, and the model predicts the whole held-out workload sooner."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROFILES = [ROOT / "results/2026-12-02-h200-s16/bench" / f"profile-{s}.json" for s in ("dev", "held-out")]
CALIBRATION = ROOT / "results/2026-12-02-h200-s17/call1/res-cap.json"


@pytest.mark.skipif(not CALIBRATION.is_file(), reason="the committed results are not in this checkout")
def test_the_fill_by_time_beats_the_fill_by_routes_on_held_out_sessions(capsys):
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from fill_compare import main

    assert main(["--profiles", *map(str, PROFILES), "--calibration", str(CALIBRATION)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    fills = out["fills"]
    routes, time_saved = fills["routes"], fills["time saved"]
    assert out["slots"] == 2797 and routes["hot"] == time_saved["hot"] == 2797
    held_r, held_t = routes["held-out"], time_saved["held-out"]
    assert held_t["cold_routes_per_token_layer"] < 0.96 * held_r["cold_routes_per_token_layer"]
    assert held_t["moe_ms"] < held_r["moe_ms"] and held_t["total_s"] < held_r["total_s"]
    assert time_saved["development"]["total_s"] <= min(f["development"]["total_s"] for f in fills.values())
