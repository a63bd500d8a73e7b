"""scripts/profile_decode.py on the CPU (aten ops stand in for kernels): a decode profile and a
prefill pass's profile of the tiny model, each with its classes and per-kernel rows."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


def _script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "profile_decode.py"
    spec = importlib.util.spec_from_file_location("profile_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_profile_writes_its_tables(tiny_dir, tmp_path):
    out = tmp_path / "p"
    assert _script().main(["--model", str(tiny_dir), "--context", "40", "--steps", "3", "--profile-steps", "1",
                           "--out", str(out)]) == 0
    d, md = json.loads((out / "profile.json").read_text()), (out / "profile.md").read_text()
    assert d["kind"] == "ostinato.profile_decode" and d["step"]["steps"] == 3 and d["step"]["median_ms"] > 0
    assert d["context"] == 40 and d["classes_graph"] and d["classes_eager"]
    assert md.startswith("# Decode step profile") and "us / step" in md


def test_prefill_profiles_one_file_per_size(tiny_dir, tmp_path):
    out = tmp_path / "p"
    assert _script().main(["--model", str(tiny_dir), "--context", "40", "--prefill", "24", "8", "--steps", "3",
                           "--profile-steps", "1", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["prefill_24.json", "prefill_24.md", "prefill_8.json",
                                                      "prefill_8.md"]
    for n in (8, 24):
        d, md = json.loads((out / f"prefill_{n}.json").read_text()), (out / f"prefill_{n}.md").read_text()
        assert d["kind"] == "ostinato.profile_prefill" and d["prefill_tokens"] == n and d["context"] == 40
        assert d["step"]["steps"] == 3 and d["step"]["median_ms"] > 0 and d["classes"] and d["kernels"]
        assert d["step"]["upload_ms"] == 0.0  # on the CPU nothing is uploaded
        tl = d["timeline"]  # one MoE call a layer a pass, and the wall split at the backend's edge
        assert tl["passes"] == 1 and tl["moe_calls"] == 4 and tl["host_in_moe_ms"] > 0
        assert tl["host_in_moe_ms"] + tl["host_outside_moe_ms"] == pytest.approx(tl["wall_ms"])
        assert "Where the wall time went" in md
        assert md.startswith(f"# Prefill pass of {n} tokens profile") and "us / pass" in md


def test_host_to_device_copies_are_uploads():
    k = _script().kernel_class
    assert k("Memcpy HtoD (Pinned -> Device)") == "upload" and k("Memcpy DtoD (Device -> Device)") == "copy"
    assert k("_w13_kernel") == "experts"
    assert k("_wait_rows") == k("_add_rows") == k("_post_rows") == "handshake"
    assert k("_stage_kernel") == "staging"  # reads host memory, as an upload does, from a kernel


def test_prefill_md_shows_the_replay_and_its_worker(tmp_path):
    """A replayed pass's profile states the replay's kernels, the handshake's wait among them, and the
    CPU worker's own time, and tabulates the replay by class."""
    m = _script()
    rows = [{"kernel": "_wait_rows", "class": "handshake", "launches_per_step": 48.0, "us_per_step": 30000.0},
            {"kernel": "_w13_kernel", "class": "experts", "launches_per_step": 48.0, "us_per_step": 9000.0}]
    replay = {"kernel_ms": 39.0, "classes": m.by_class(rows), "kernels": rows,
              "worker": {"layers_served": 48.0, "cold_routes": 900.0, "cold_experts": 400.0, "compute_ms": 31.5,
                         "wait_ms": 2.0}}
    out = {"model": "m", "commit": "c", "device": "d", "context": 40, "placement": "p", "graph": True,
           "prefill_tokens": 64, "pass_graph": 64, "replay": replay, "classes": {}, "kernels_graph": [],
           "step": {"steps": 3, "median_ms": 50.0, "p90_ms": 51.0, "kernel_ms": 20.0, "upload_ms": 0.0}}
    m.write_md(tmp_path / "p.md", out)
    md = (tmp_path / "p.md").read_text()
    assert "replayed as a captured graph of 64 rows" in md
    assert "kernels 39.0 ms a pass, of which the handshake's 30.0 ms" in md
    assert "31.5 ms computing over 48 layers (900 cold routes, 400 experts), 2.0 ms waiting" in md
    assert "## By class, the captured pass's replays" in md and "| handshake | 48.0 | 30000.0 |" in md


def test_pass_timeline_splits_host_and_streams():
    """A made-up trace of one pass (us): two MoE calls, the second waiting for its CPU branch and
    synchronising; kernels on stream 7 overlapping each other, a copy on stream 9."""
    def x(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    m = _script()
    events = [x("user_annotation", m.PASS, 0, 1000),
              x("user_annotation", m.MOE, 100, 200), x("user_annotation", m.MOE, 500, 400),
              x("user_annotation", m.CPU_WAIT, 600, 150), x("cuda_runtime", "cudaEventSynchronize", 520, 50),
              x("cuda_runtime", "cudaStreamSynchronize", 950, 40), x("cuda_runtime", "cudaLaunchKernel", 10, 5),
              x("cuda_driver", "cuLaunchKernelEx", 110, 7), x("cuda_runtime", "cudaMemcpyAsync", 130, 3),
              x("kernel", "a", 20, 100, stream=7), x("kernel", "b", 60, 100, stream=7),
              x("kernel", "c", 990, 50, stream=7), x("gpu_memcpy", "Memcpy HtoD", 140, 100, stream=9),
              x("user_annotation", m.PASS, 5000, 10)]  # a second pass, with nothing in it
    tl = m.pass_timeline(events[:-1])
    assert tl["passes"] == 1 and tl["moe_calls"] == 2 and tl["wall_ms"] == pytest.approx(1.0)
    assert tl["host_in_moe_ms"] == pytest.approx(0.6) and tl["host_outside_moe_ms"] == pytest.approx(0.4)
    assert tl["cpu_wait_ms"] == pytest.approx(0.15)
    assert (tl["sync_in_moe_ms"], tl["sync_outside_moe_ms"]) == (pytest.approx(0.05), pytest.approx(0.04))
    assert (tl["launches"], tl["copies_issued"]) == (2, 1)
    assert tl["launch_host_ms"] == pytest.approx(0.012) and tl["copy_host_ms"] == pytest.approx(0.003)
    # stream 7: [20, 160) and [990, 1000) inside the pass; stream 9: [140, 240); any: [20, 240) and [990, 1000)
    assert tl["gpu_busy_ms"] == {"7": pytest.approx(0.15), "9": pytest.approx(0.1)}
    assert tl["gpu_busy_any_ms"] == pytest.approx(0.23) and tl["gpu_idle_ms"] == pytest.approx(0.77)
    assert tl["host_active_ms"] == pytest.approx(1.0 - 0.15 - 0.05 - 0.04)
    assert tl["per_moe_layer"]["wall_ms"] == pytest.approx(0.5)
    # no torch ops in this trace: the host's time outside its waits is runtime calls and Python
    assert tl["host_ops_ms"] == 0 and tl["host_runtime_alone_ms"] == pytest.approx((50 + 40 + 5 + 7 + 3) / 1e3)
    assert tl["host_python_ms"] == pytest.approx(1.0 - 0.15 - 0.105)
    assert tl["host_ops"] == {"in_moe": [], "outside_moe": []}
    two = m.pass_timeline(events)  # means over the passes
    assert two["passes"] == 2 and two["wall_ms"] == pytest.approx(0.505) and two["moe_calls"] == 1
    assert m.pass_timeline([]) == {}


def test_pass_timeline_counts_the_host_threads_outermost_ops():
    """Torch ops of the pass's thread: an op's nested op and runtime call are its own time; another
    thread's ops are not the host's; ops are split at the MoE backend's edge."""
    def x(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": {}}

    m = _script()
    events = [x("user_annotation", m.PASS, 0, 1000), x("user_annotation", m.MOE, 500, 300),
              x("cpu_op", "aten::linear", 100, 100), x("cpu_op", "aten::matmul", 110, 80),
              x("cuda_runtime", "cudaLaunchKernel", 120, 10), x("cpu_op", "aten::linear", 300, 50),
              x("cuda_driver", "cuLaunchKernel", 400, 20), x("cpu_op", "aten::copy_", 600, 30),
              x("cpu_op", "aten::add", 620, 5),  # nested in the copy (it starts before the copy ends)
              x("cpu_op", "aten::mul", 100, 900, tid=2)]  # another thread's
    tl = m.pass_timeline(events)
    assert tl["host_ops_ms"] == pytest.approx(0.18) and tl["host_runtime_alone_ms"] == pytest.approx(0.02)
    assert tl["host_python_ms"] == pytest.approx(1.0 - 0.18 - 0.02)
    assert tl["host_ops"]["outside_moe"] == [{"op": "aten::linear", "ms": pytest.approx(0.15), "calls": 2}]
    assert tl["host_ops"]["in_moe"] == [{"op": "aten::copy_", "ms": pytest.approx(0.03), "calls": 1}]
    assert tl["per_moe_layer"]["host_python_ms"] == pytest.approx(0.8)
