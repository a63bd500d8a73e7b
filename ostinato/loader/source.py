"""A Hugging Face checkpoint directory as a weight source. The other sources are a GGUF file
(loader/gguf.py) and a synthetic model (synth/source.py); ostinato/sources.py opens a model
argument as whichever it names.

Both give the same interface: a `ModelConfig`, tensor names and shapes, and `load_`
that writes a named tensor into memory the caller allocated (so experts land straight
in their stacked, possibly page-locked, per-layer buffers, with no second copy).

A model argument is a checkpoint directory, a .gguf file or a directory holding one (and
no config.json), or `synth:PRESET[?seed=S&layers=N&skew=X]`: a synthetic model generated
into memory with deterministic per-tensor seeds; the same values `ostinato synth` writes
to disk.

Quantized safetensors checkpoints (FP8, GPTQ, AWQ, bitsandbytes, compressed-tensors, ...)
are refused at load: their tensors are integers or low-precision floats with scales kept
beside them, and copying them into bf16 would give a model that runs and is wrong.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ostinato.config import ConfigError, ModelConfig, family_of
from ostinato.layers.moe.types import expert_views
from ostinato.loader import gpt_oss

# safetensors dtypes that hold weights as they are; anything else (F8_*, I8, U8, I32 packs) needs
# scales or unpacking this loader does not do
FLOAT_DTYPES = ("BF16", "F16", "F32")
# quantization_config.quant_method -> the name a user knows the format by
QUANT_METHODS = {"fp8": "FP8", "gptq": "GPTQ", "awq": "AWQ", "bitsandbytes": "bitsandbytes",
                 "compressed-tensors": "compressed-tensors", "mxfp4": "MXFP4"}


class CheckpointSource:
    """A Hugging Face checkpoint directory (config.json, *.safetensors [+ index])."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        if not self.dir.is_dir():
            raise ConfigError(f"{self.dir}: no such model directory (give a checkpoint folder, a .gguf file "
                              "or synth:PRESET)")
        self.config = ModelConfig.from_file(self.dir / "config.json")
        refuse_quantized(self.config.raw, self.dir)
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
        dtype = self._handle(self._file(name)).get_slice(name).get_dtype()
        if dtype not in FLOAT_DTYPES:
            raise ConfigError(f"{self.dir}: tensor {name!r} is stored as {dtype}, a quantized or packed type this "
                              f"loader does not read (it reads {', '.join(FLOAT_DTYPES)} safetensors, or GGUF files)")
        shape = self.shape(name)
        if shape != tuple(out.shape):
            raise ConfigError(
                f"{self.dir}: tensor {name!r} has shape {list(shape)}, but config.json implies {list(out.shape)}"
            )
        return out.copy_(self._handle(self.files[name]).get_tensor(name))

    def load_experts_(self, layer: int, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None,
                      b2: torch.Tensor | None = None) -> None:
        """One layer's experts as floats into the stacks (and their biases, for experts that have
        them): per-expert tensors (Qwen3, DeepSeek), or gpt-oss's fused ones (loader/gpt_oss.py)."""
        if gpt_oss.is_fused(self.files, layer):
            self._check_fused(layer)
            gpt_oss.load_float_(self._read, self.files, layer, w13, w2)
            if b13 is not None:
                gpt_oss.load_biases_(self._read, layer, b13, b2)
            return
        if b13 is not None:
            raise ConfigError(f"{self.dir}: layer {layer}'s experts have no biases in this checkpoint")
        for name, view in expert_views(layer, w13, w2):
            self.load_(name, view)

    def expert_qtypes(self, layer: int) -> tuple[str, str] | None:
        """The block formats of a layer's experts where the checkpoint stores them quantized
        (gpt-oss's MXFP4), else None (floats)."""
        return gpt_oss.qtypes(self.files, layer)

    def load_quantized_experts_(self, layer: int, w13: torch.Tensor, w2: torch.Tensor,
                                b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> None:
        """One layer's MXFP4 experts in GGUF's block layout (repacked, lossless) and their biases."""
        self._check_fused(layer)
        gpt_oss.load_quantized_(self._read, self.files, layer, w13, w2)
        if b13 is not None:
            gpt_oss.load_biases_(self._read, layer, b13, b2)

    def _check_fused(self, layer: int) -> None:
        c = self.config
        gpt_oss.check_shapes(self.shape, self.files, layer, c.num_experts, c.hidden_size, c.moe_intermediate_size)

    def _read(self, name: str, e: int | None) -> torch.Tensor:
        """Expert e's slice of a stacked tensor (None: all of it), read from its shard."""
        sl = self._handle(self._file(name)).get_slice(name)
        return sl[e] if e is not None else sl[:]


def refuse_quantized(config: dict, where: Path) -> None:
    """ConfigError for a config.json that declares a quantized checkpoint, naming its format;
    gpt-oss's MXFP4 experts (its own release format) are read (loader/gpt_oss.py)."""
    qc = config.get("quantization_config")
    if qc is None:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if str(method).lower() == "mxfp4" and family_of(config).name == "gpt_oss":
        return  # only the experts are blocks; a dense tensor in another type is refused by load_
    name = QUANT_METHODS.get(str(method).lower(), f"quant_method {method!r}" if method else "an unnamed format")
    raise ConfigError(f"{where}: the checkpoint is quantized ({name}; quantization_config in config.json), which "
                      "Ostinato does not load from safetensors: use the unquantized (bf16) checkpoint, or a GGUF "
                      "file (Q8_0, Q4_K_M, MXFP4_MOE, ...)")
