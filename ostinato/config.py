"""Settings, validated once at start-up.

`ModelConfig` is the subset of a Hugging Face `config.json` that the Qwen3-MoE
architecture reads; it accepts both the transformers-4 keys (`rope_theta`,
`rope_scaling`) and the transformers-5 key (`rope_parameters`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM",)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ConfigError(ValueError):
    """A checkpoint or setting that Ostinato cannot use, with what to do about it."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def is_moe_layer(self, i: int) -> bool:
        """Qwen3-MoE's rule: sparse unless listed in mlp_only_layers, every `step`-th layer."""
        return (
            i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert (gate, up, down) in the checkpoint dtype."""
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 3 * self.hidden_size * self.moe_intermediate_size * itemsize

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        archs = d.get("architectures") or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ConfigError(
                f"unsupported architecture {archs or d.get('model_type')!r}: "
                f"Ostinato supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope_params = d.get("rope_parameters") or {}
        rope_scaling = d.get("rope_scaling")
        if rope_params and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
        if dtype not in _DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r} in config.json (use one of {list(_DTYPES)})")
        heads = d["num_attention_heads"]
        try:
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                moe_intermediate_size=d["moe_intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads", heads),
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                num_experts=d["num_experts"],
                num_experts_per_tok=d["num_experts_per_tok"],
                norm_topk_prob=d.get("norm_topk_prob", True),
                decoder_sparse_step=d.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=rope_params.get("rope_theta", d.get("rope_theta", 10000.0)),
                rope_scaling=rope_scaling,
                max_position_embeddings=d.get("max_position_embeddings", 40960),
                tie_word_embeddings=d.get("tie_word_embeddings", False),
                attention_bias=d.get("attention_bias", False),
                dtype=dtype,
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=eos,
                raw=d,
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks the key {e.args[0]!r} that Qwen3-MoE needs") from None

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such file (a model directory needs config.json)")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None


def parse_bytes(text: str) -> int:
    """'32GiB', '12GB', '512MiB', '1000000' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1, "": 1}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = None
    if unit not in units or value is None or value < 0:
        raise ConfigError(f"cannot read {text!r} as a size (examples: 32GiB, 12GB, 512MiB)")
    return int(value * units[unit])
