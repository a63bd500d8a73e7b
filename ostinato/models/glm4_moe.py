"""GLM-4-MoE (`Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air) as a pure nn.Module.

transformers builds it from DeepSeek-V3's decoder: the same MoE layers (sigmoid routing with a
selection bias, groups, shared experts, dense first layers; models/deepseek_v3.py) and the
same router kept in fp32. Only the attention differs: grouped-query attention over per-head
K/V (qwen3_moe.Attention with GLM's options: q/k norms if use_qk_norm, rotary on the first
partial_rotary_factor of each head's dims, half-split pairs, q/k/v biases if attention_bias,
o_proj without one), so it caches k and v as Qwen3 does.

Legend: H query heads, Hkv KV heads, Hd head dim.
"""
from __future__ import annotations

from torch import nn

from ostinato.config import ModelConfig
from ostinato.models.common import AttentionShape, KVShapes
from ostinato.models.deepseek_v3 import DeepseekV3ForCausalLM
from ostinato.models.qwen3_moe import Attention, Qwen3MoeForCausalLM


def rotary_dim(cfg: ModelConfig) -> int:
    return int(cfg.head_dim * cfg.partial_rotary_factor)


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    @staticmethod
    def attention(cfg: ModelConfig) -> nn.Module:
        return Attention(cfg, qk_norm=cfg.qk_norm, o_bias=False, rotary_dim=rotary_dim(cfg))

    @staticmethod
    def kv_shapes(cfg: ModelConfig) -> KVShapes:
        return Qwen3MoeForCausalLM.kv_shapes(cfg)

    @staticmethod
    def attention_shape(cfg: ModelConfig) -> AttentionShape:
        return Qwen3MoeForCausalLM.attention_shape(cfg)._replace(rope_dim=rotary_dim(cfg))
