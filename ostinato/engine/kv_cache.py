"""The KV cache of the one session slot: preallocated once, written in place.

Legend: L layers, N max tokens, Hkv KV heads, Hd head dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.config import ModelConfig


@dataclass
class LayerKV:
    k: torch.Tensor  # [N, Hkv, Hd]
    v: torch.Tensor  # [N, Hkv, Hd]


class KVCache:
    def __init__(self, cfg: ModelConfig, max_tokens: int, device, dtype: torch.dtype):
        shape = (cfg.num_hidden_layers, max_tokens, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # [L, N, Hkv, Hd]
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.layers = [LayerKV(self.k[i], self.v[i]) for i in range(cfg.num_hidden_layers)]
        self.max_tokens = max_tokens

    @staticmethod
    def bytes_needed(cfg: ModelConfig, max_tokens: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * max_tokens * cfg.num_key_value_heads * cfg.head_dim * itemsize
