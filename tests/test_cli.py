"""The command line on a fresh checkout: synth a tiny checkpoint, then generate from it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _run(*args, env_cache):
    env = dict(os.environ, OSTINATO_CACHE=env_cache)
    return subprocess.run([sys.executable, "-m", "ostinato.cli", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_synth_then_generate(tmp_path):
    cache = str(tmp_path / "cache")
    r = _run("synth", "--preset", "tiny", "--out", str(tmp_path / "tiny"), env_cache=cache)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "tiny" / "model.safetensors.index.json").is_file()
    r = _run("generate", "--model", str(tmp_path / "tiny"), "--prompt", "List the open orders.",
             "--max-tokens", "12", "--json", env_cache=cache)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["output_ids"]) == 12 or out["finish_reason"] == "stop"
    again = json.loads(_run("generate", "--model", str(tmp_path / "tiny"), "--prompt", "List the open orders.",
                            "--max-tokens", "12", "--json", env_cache=cache).stdout.strip().splitlines()[-1])
    assert again["output_ids"] == out["output_ids"]  # greedy is deterministic


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/nonexistent/model", "--prompt", "x"], "no such model directory"),
    (["generate", "--model", "synth:huge", "--prompt", "x"], "unknown preset"),
    (["generate", "--model", "synth:tiny?bogus=1", "--prompt", "x"], "unknown synth option"),
])
def test_clear_errors(tmp_path, args, message):
    r = _run(*args, env_cache=str(tmp_path / "cache"))
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
