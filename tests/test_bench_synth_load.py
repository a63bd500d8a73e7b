"""scripts/bench_synth_load.py times the loader's own steps: on the tiny MXFP4 gpt-oss, every step is
reported and the rows it built step by step equal the loader's layer (load_quantized_experts), as do those of the
layer a build stages where the source generates it (load_layer_experts)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_synth_load import main  # noqa: E402


def test_steps_are_the_loaders(tmp_path):
    out = main(["--preset", "tiny-gpt-oss-mxfp4", "--experts", "3", "--json", str(tmp_path / "o.json")])
    assert out["steps_equal_loader"] is True and out["staged_equal_loader"] is True
    assert set(out["gate_up_ms_per_expert"]) == {"float (generator)", "transpose", "quantize MXFP4",
                                                  "to Hugging Face order", "back, de-interleaved",
                                                  "copy into pageable host", "copy into page-locked host"}
    assert out["layers"] == 4 and out["layer_s"] > 0 and out["staged_layer_s"] > 0 and (tmp_path / "o.json").exists()
    assert out["staged_on"] == ("cuda" if torch.cuda.is_available() else "cpu")
