"""A synthetic model as a weight source: the loader's interface (loader/source.py) over tensors
generated on demand with deterministic per-tensor seeds (synth/weights.py), on the GPU where
there is one and copied to where the caller allocated them.
"""
from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl

import torch

from ostinato.config import ConfigError, ModelConfig
from ostinato.loader import gpt_oss as gpt_oss_layout
from ostinato.synth import gpt_oss as synth_gpt_oss


class SynthSource:
    """A synthetic model generated on demand (see ostinato.synth)."""

    def __init__(self, spec, tokenizer_dir: Path, config: dict):
        self.spec = spec
        self.tokenizer_dir = tokenizer_dir
        self.config = ModelConfig.from_dict(config)
        self.generate_on = "cuda" if torch.cuda.is_available() else "cpu"
        # gpt-oss's fused experts are read as the loader reads a checkpoint's (loader/gpt_oss.py)
        self._read = synth_gpt_oss.reader(spec, self.generate_on) if self.config.family == "gpt_oss" else None

    def names(self) -> list[str]:
        return list(self.spec.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.spec.shapes[name]

    def load_(self, name: str, out: torch.Tensor) -> torch.Tensor:
        if out.device.type == self.generate_on:
            return self.spec.fill_(name, out)
        return out.copy_(self.spec.tensor(name, device=self.generate_on, dtype=out.dtype))

    def load_experts_(self, layer: int, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None,
                      b2: torch.Tensor | None = None) -> None:
        if self._read is not None:  # gpt-oss: the loader's reading of its layout, over generated tensors
            gpt_oss_layout.load_float_(self._read, self.spec.shapes, layer, w13, w2)
            if b13 is not None:
                gpt_oss_layout.load_biases_(self._read, layer, b13, b2)
            return
        if w13.device.type == self.generate_on:
            return self.spec.fill_experts_(layer, w13, w2)
        # generate on the GPU a few experts at a time, copy to host memory
        step = 8
        for e in range(0, w13.shape[0], step):
            a = torch.empty_like(w13[e:e + step], device=self.generate_on)
            b = torch.empty_like(w2[e:e + step], device=self.generate_on)
            self.spec.fill_experts_(layer, a, b, first=e)
            w13[e:e + step].copy_(a)
            w2[e:e + step].copy_(b)

    def expert_qtypes(self, layer: int) -> tuple[str, str] | None:
        """gpt-oss's MXFP4 experts (a preset with quantization_config mxfp4), else None: floats."""
        return gpt_oss_layout.qtypes(self.spec.shapes, layer) if self._read is not None else None

    def load_quantized_experts_(self, layer: int, w13: torch.Tensor, w2: torch.Tensor,
                                b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> None:
        gpt_oss_layout.load_quantized_(self._read, self.spec.shapes, layer, w13, w2)
        if b13 is not None:
            gpt_oss_layout.load_biases_(self._read, layer, b13, b2)


def parse_synth(text: str) -> tuple[str, dict]:
    """'synth:tiny?seed=1&layers=2' -> ('tiny', {'seed': 1, 'layers': 2}); the routing regime and
    its knobs as `ostinato synth` takes them ('synth:tiny?regime=layered-persistent&persistence=0.5')."""
    body = text[len("synth:"):]
    preset, _, query = body.partition("?")
    kinds = {"seed": int, "layers": int, "skew": float, "regime": str, "persistence": float, "content": float}
    opts = {}
    for k, v in parse_qsl(query, strict_parsing=bool(query)):
        if k not in kinds:
            raise ConfigError(f"unknown synth option {k!r} in {text!r} (known: {', '.join(kinds)})")
        opts[k] = kinds[k](v)
    return preset, opts
