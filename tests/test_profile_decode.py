"""scripts/profile_decode.py on the CPU (aten ops stand in for kernels): a decode profile and a
prefill pass's profile of the tiny model, each with its classes and per-kernel rows."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path


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
        assert md.startswith(f"# Prefill pass of {n} tokens profile") and "us / pass" in md


def test_host_to_device_copies_are_uploads():
    k = _script().kernel_class
    assert k("Memcpy HtoD (Pinned -> Device)") == "upload" and k("Memcpy DtoD (Device -> Device)") == "copy"
    assert k("_wait_add") == "handshake" and k("_w13_kernel") == "experts"
