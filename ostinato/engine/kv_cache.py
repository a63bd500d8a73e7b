"""The KV cache of the one session slot: preallocated once, written in place.

What a layer caches per token is the model's to say (`kv_shapes` of its family in
models/registry.py): Qwen3 caches per-head keys and values, k and v [Hkv, Hd]; DeepSeek's
latent attention one compressed row, ckv [R + Dr]. The cache holds each named tensor for
every layer, stacked, and hands each layer a `LayerKV` of views.

Legend: L layers, N max tokens, S a tensor's per-token shape.
"""
from __future__ import annotations

import math

import torch

from ostinato.config import ModelConfig
from ostinato.models.registry import kv_shapes


class LayerKV:
    """One layer's cache tensors [N, *S], by name (attributes too: `kv.k`, `kv.ckv`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = dict(tensors)
        self.__dict__.update(self.tensors)

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device


def allocate(cfg: ModelConfig, layers: int, max_tokens: int, device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each cache tensor of `layers` layers, stacked: name -> [layers, N, *S], zeroed."""
    return {name: torch.zeros((layers, max_tokens, *shape), device=device, dtype=dtype)
            for name, shape in kv_shapes(cfg).items()}


def layer_views(blocks: dict[str, torch.Tensor]) -> list[LayerKV]:
    """Stacked blocks [n, N, *S] -> the n layers' LayerKV views."""
    n = next(iter(blocks.values())).shape[0]
    return [LayerKV({name: b[i] for name, b in blocks.items()}) for i in range(n)]


class KVCache:
    def __init__(self, cfg: ModelConfig, max_tokens: int, device, dtype: torch.dtype):
        self.blocks = allocate(cfg, cfg.num_hidden_layers, max_tokens, device, dtype)  # name -> [L, N, *S]
        self.layers = layer_views(self.blocks)
        self.max_tokens = max_tokens

    @staticmethod
    def bytes_needed(cfg: ModelConfig, max_tokens: int, dtype: torch.dtype, layers: int | None = None) -> int:
        """Bytes of the cache of `layers` layers (default: all) for max_tokens tokens."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_token = sum(math.prod(shape) for shape in kv_shapes(cfg).values())
        n = cfg.num_hidden_layers if layers is None else layers
        return n * max_tokens * per_token * itemsize
