"""scripts/bench_breakdown.py on a results.json of two policies whose turns differ by known factors."""
from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("bench_breakdown", Path(__file__).parent.parent / "scripts" /
                                              "bench_breakdown.py")
bb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bb)


def _turns(scale: float, per_route_us: float) -> list[dict]:
    out = []
    for i, new in enumerate([50, 60, 300, 3000]):
        decode = {"graph_steps": 10, "graph_cold_routes": 20, "graph_compute_ns": int(20 * per_route_us * 1e3)}
        prefill = {"cpu_experts": int(scale * 100), "uploaded_experts": 20 if scale > 1 else 0}
        out.append({"session": "s", "turn": i, "new_tokens": new, "prefill_s": scale * new / 1000,
                    "kind": "tool" if i else "first", "placement": {"decode": decode, "prefill": prefill},
                    "error": None})
    return out


def test_prefill_ratio_by_size_and_cpu_time_per_route():
    turns = {"ostinato": _turns(1.2, 100.0), "other": _turns(1.0, 80.0)}
    lines = bb.prefill_by_size(turns, "ostinato")
    assert "0-127 (2 turns): ostinato 66, other 55 (1.20)" in lines[1]
    assert lines[2].startswith("  128-511 (1 turns)") and "2048- (1 turns)" in lines[-1]
    cpu = bb.decode_cpu(turns)
    assert "ostinato: 200 us a step, 100.0 us a cold route" in cpu[1] and "80.0 us a cold route" in cpu[2]


def test_host_reads_after_tool_outputs():
    turns = {"ostinato": _turns(1.2, 100.0), "other": _turns(1.0, 80.0)}
    lines = bb.host_reads(turns, "ostinato", expert_mb=10.0)
    assert lines[0].startswith("host expert reads in a tool turn's prefill (median over 3 tool turns")
    # 120 CPU + 20 uploaded against 100: 1.40; prefill 1.2x; 140 experts of 10 MB in 0.36 s (300 tokens) ...
    assert lines[1].startswith("  ostinato: 140 experts (1.4 GB, read at ")
    assert lines[2].endswith("reads ratio 1.40, TTFT ratio 1.20")
    assert "no tool turn" in bb.host_reads({"a": [], "b": []}, "a", None)[0]
    # 140 experts of 10 MB at 7 GB/s: 0.2 s; the prefills take 0.072, 0.36 and 3.6 s: median 1.8x
    probed = bb.host_reads(turns, "ostinato", 10.0, {"ostinato": {"before": 8.0, "after": 6.0, "probe": "native"}})
    assert "; 1.80x the floor of its bytes at the probe's 7 GB/s)" in probed[1] and "floor" not in probed[2]
