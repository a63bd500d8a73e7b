"""Start-up: a load that fails ends `ostinato serve` / `generate` with one error line and a
non-zero exit (also when it fails on the engine thread after uvicorn started), and the
start-up summary states what was loaded and where."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ostinato.engine.residency import Residency
from ostinato.engine.runner import RunnerSettings
from ostinato.load import load_engine, startup_summary, summary_text
from ostinato.server.worker import EngineWorker


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ostinato.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=180)


def _serve(*args) -> subprocess.CompletedProcess:
    return _cli("serve", "--port", 0, "--device", "cpu", "--log-level", "warning", *args)


def _residency(path, fingerprint: str, layers: int) -> str:
    Residency(fingerprint, 16, {l: [0, 1] for l in range(layers)}, devices={"cpu": list(range(layers))}).save(path)
    return str(path)


@pytest.mark.parametrize("model, message", [
    ("/nonexistent/model", "no such model directory"),
    ("DIR", "config.json"),  # a directory that is not a checkpoint
])
def test_serve_bad_model_exits(tmp_path, model, message):
    r = _serve("--model", tmp_path if model == "DIR" else model)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("ostinato: error:") == 1


@pytest.mark.parametrize("layers, message", [
    (2, "planned for another shape (2 layers of 16 experts; this model: 4 layers of 16 experts)"),
    (4, "planned for another model"),  # same shapes, other routers
])
def test_serve_foreign_residency_exits(tmp_path, layers, message):
    """The residency file exists, so the server starts and the load fails on the engine thread."""
    path = _residency(tmp_path / "r.json", "sha256:" + "0" * 64, layers)
    r = _serve("--model", "synth:tiny", "--residency", path)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_generate_bad_model_exits(tmp_path):
    r = _cli("generate", "--model", tmp_path / "missing", "--prompt", "x")
    assert r.returncode == 2 and "no such model directory" in r.stderr and "Traceback" not in r.stderr


def test_generate_json_has_summary(tiny_dir):
    r = _cli("generate", "--model", tiny_dir, "--device", "cpu", "--max-context", 256, "--prompt", "x",
             "--max-tokens", 2, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])["summary"]
    assert summary["kv_tokens"] == 256 and summary["devices"] == ["cpu"]
    assert "ready:" in r.stderr and r.stderr.count("threads:") == 1


def test_summary_fields(tiny_dir):
    loaded = load_engine(str(tiny_dir), RunnerSettings(device="cpu", max_context=128), announce=False)
    s = startup_summary(loaded, "http://127.0.0.1:9")
    cfg = loaded.source.config
    assert s["model"] == str(tiny_dir) and s["format"].startswith("checkpoint ")
    assert f"x{len(cfg.moe_layers)} layers" in s["format"]
    assert s["devices"] == ["cpu"] and s["kv_tokens"] == 128 and s["gpu_memory"] is None
    assert s["experts"] == len(cfg.moe_layers) * cfg.num_experts and s["resident_experts"] == 0
    assert s["threads"] == loaded.runner.threads.describe() and s["upload_threshold"] is None
    text = summary_text(s)
    assert "128 KV tokens" in text and "http://127.0.0.1:9" in text and "threads:" in text


def test_worker_reports_a_failed_load():
    def load(progress):
        raise FileNotFoundError("gone")

    worker, seen = EngineWorker(load, warmup=False), []
    worker.on_failed = seen.append
    worker.start()
    worker.stop()
    assert worker.state == "error" and isinstance(worker.exception, FileNotFoundError) and seen == [worker.exception]


def test_a_cap_without_a_residency_must_hold_every_expert():
    """--gpu-memory without --residency puts every expert on the GPU: a cap too small for them is
    refused at once with what to do (on a GPU machine load_engine runs this check, then sets the cap)."""
    from ostinato.config import ConfigError
    from ostinato.engine.runner import RunnerSettings
    from ostinato.load import check_all_resident_fit
    from ostinato.sources import open_source

    source = open_source("synth:tiny?layers=2")
    settings = RunnerSettings(device="cpu", dtype="bf16", max_context=1024)
    check_all_resident_fit(source, settings, 8 * 2**30, "synth:tiny")
    with pytest.raises(ConfigError, match="do not all fit under --gpu-memory.*plan a residency"):
        check_all_resident_fit(source, settings, 2**20, "synth:tiny")
