"""Model families -> their nn.Module: the one place that names a model class.

config.py's FAMILIES says which architectures a family covers and how its config.json
reads (`ModelConfig.family`); MODELS here maps that family to its `MoECausalLM`. Every
consumer (the loader, the KV cache, the planner's capacity test) asks here, so a new
family is two entries: a `Family` in config.py and a line in MODELS.
"""
from __future__ import annotations

import torch

from ostinato.config import ConfigError, ModelConfig
from ostinato.models.common import AttentionShape, KVShapes, MoECausalLM
from ostinato.models.deepseek_v3 import DeepseekV3ForCausalLM
from ostinato.models.glm4_moe import Glm4MoeForCausalLM
from ostinato.models.gpt_oss import GptOssForCausalLM
from ostinato.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[MoECausalLM]] = {
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[MoECausalLM]:
    if cfg.family not in MODELS:
        raise ConfigError(f"model family {cfg.family!r} has no model module (known: {', '.join(MODELS)})")
    return MODELS[cfg.family]


def new_model(cfg: ModelConfig, device: torch.device | str | None = None) -> MoECausalLM:
    """The family's model, its parameters uninitialised on `device` (meta: no memory, shapes only)."""
    with torch.device(device or "meta"):
        return model_class(cfg)(cfg)


def kv_shapes(cfg: ModelConfig) -> KVShapes:
    return model_class(cfg).kv_shapes(cfg)


def attention_shape(cfg: ModelConfig) -> AttentionShape:
    return model_class(cfg).attention_shape(cfg)


def keeps_fp32(model: MoECausalLM, name: str) -> bool:
    """Whether parameter `name` stays fp32 in a model of any compute dtype (a router, say)."""
    return name.endswith(model.fp32_params)


def cast_(model: MoECausalLM, dtype: torch.dtype) -> MoECausalLM:
    """The model in the compute dtype, but its fp32_params in fp32."""
    model.to(dtype)
    for name, p in model.named_parameters():
        if keeps_fp32(model, name):
            p.data = p.data.float()
    return model


def param_bytes(model: MoECausalLM, dtype: torch.dtype, params=None) -> int:
    """Bytes of `params` ((name, parameter) pairs, names ending as in the model; default: the
    whole model's) once cast_ to dtype."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    pairs = model.named_parameters() if params is None else params
    return sum(p.numel() * (4 if keeps_fp32(model, n) else itemsize) for n, p in pairs)
