"""Where weights come from: a Hugging Face checkpoint directory, or a synthetic model (synth/source.py).

Both give the same interface: a `ModelConfig`, tensor names and shapes, and `load_`
that writes a named tensor into memory the caller allocated (so experts land straight
in their stacked, possibly page-locked, per-layer buffers, with no second copy).

A model argument is a directory, or `synth:PRESET[?seed=S&layers=N&skew=X]`: a
synthetic model generated into memory with deterministic per-tensor seeds; the same
values `ostinato synth` writes to disk.
"""
from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import parse_qsl

import torch
from safetensors import safe_open

from ostinato.config import ConfigError, ModelConfig
from ostinato.layers.moe.types import expert_views
from ostinato.synth.build import synth_source


class CheckpointSource:
    """A Hugging Face checkpoint directory (config.json, *.safetensors [+ index])."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        if not self.dir.is_dir():
            raise ConfigError(f"{self.dir}: no such model directory (give a checkpoint folder or synth:PRESET)")
        self.config = ModelConfig.from_file(self.dir / "config.json")
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.files = {n: self.dir / f for n, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise ConfigError(f"{self.dir}: no *.safetensors files (and no model.safetensors.index.json)")
            self.files = {}
            for f in shards:
                with safe_open(f, framework="pt") as h:
                    self.files |= {n: f for n in h.keys()}
        missing = {f for f in self.files.values() if not f.is_file()}
        if missing:
            raise ConfigError(f"{self.dir}: the index names missing shard(s) {sorted(p.name for p in missing)}")
        self._handles: dict[Path, object] = {}

    @property
    def tokenizer_dir(self) -> Path:
        return self.dir

    def names(self) -> list[str]:
        return list(self.files)

    def _handle(self, f: Path):
        if f not in self._handles:
            self._handles[f] = safe_open(f, framework="pt")  # memory-mapped
        return self._handles[f]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._file(name)).get_slice(name).get_shape())

    def _file(self, name: str) -> Path:
        if name not in self.files:
            raise ConfigError(f"{self.dir}: the checkpoint has no tensor {name!r}")
        return self.files[name]

    def load_(self, name: str, out: torch.Tensor) -> torch.Tensor:
        shape = self.shape(name)
        if shape != tuple(out.shape):
            raise ConfigError(
                f"{self.dir}: tensor {name!r} has shape {list(shape)}, but config.json implies {list(out.shape)}"
            )
        return out.copy_(self._handle(self.files[name]).get_tensor(name))

    def load_experts_(self, layer: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        for name, view in expert_views(layer, w13, w2):
            self.load_(name, view)


def parse_synth(text: str) -> tuple[str, dict]:
    """'synth:tiny?seed=1&layers=2' -> ('tiny', {'seed': 1, 'layers': 2})."""
    body = text[len("synth:"):]
    preset, _, query = body.partition("?")
    kinds = {"seed": int, "layers": int, "skew": float}
    opts = {}
    for k, v in parse_qsl(query, strict_parsing=bool(query)):
        if k not in kinds:
            raise ConfigError(f"unknown synth option {k!r} in {text!r} (known: {', '.join(kinds)})")
        opts[k] = kinds[k](v)
    return preset, opts


def open_source(model: str | Path):
    """A model argument -> a weight source."""
    text = str(model)
    if text.startswith("synth:"):
        preset, opts = parse_synth(text)
        return synth_source(preset, **opts)
    return CheckpointSource(text)
