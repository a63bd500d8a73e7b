"""Qwen3-MoE (`Qwen3MoeForCausalLM`) as a pure nn.Module.

One session, no batch dimension: a forward pass takes the T new tokens of a request
at positions [start, start + T) and attends to the KV cache it is handed. The module
owns no devices, threads or files; the routed experts are not parameters of the model
but a backend that the runner plugs into every MoE block (`set_experts`), so the same
model code runs all-on-GPU, hybrid CPU-GPU, or under any baseline placement.

Module and parameter names follow the Hugging Face checkpoint, so the dense weights load
by name; the expert tensors are loaded separately, stacked per layer (see loader/).

Legend: T new tokens, L cached + new tokens, D hidden, H query heads, Hkv KV heads,
Hd head dim, E experts, K experts per token, V vocabulary.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ostinato.config import ModelConfig
from ostinato.layers.moe import router
from ostinato.layers.moe.types import TopKOutput
from ostinato.models.common import (AttentionShape, causal_attention, DecodeWindow, DecoderLayer, DenseMLP, ExpertsBackend,
                                    FusedProjections, KVShapes, MoECausalLM, RMSNorm, RoutedBlock)
from ostinato.models.rope import apply_rotary, norm_rotate_qk, store_kv


class LayerKV(Protocol):
    k: torch.Tensor  # [max_len, Hkv, Hd]
    v: torch.Tensor  # [max_len, Hkv, Hd]


class Attention(nn.Module):
    """Grouped-query attention over per-head K/V. Qwen3's by default (q/k norms, rotary over the
    whole head, o_proj biased as q/k/v); GLM-4-MoE's with the options: q/k norms optional, rotary
    on the first `rotary_dim` dims of a head only, no o_proj bias."""

    def __init__(self, cfg: ModelConfig, qk_norm: bool = True, o_bias: bool | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        self.h, self.hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rd = rotary_dim or self.hd
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.hd, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.hd, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.h * self.hd, cfg.hidden_size, bias=b if o_bias is None else o_bias)
        self.qkv: FusedProjections | None = None  # fuse_qkv
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rd == self.hd:
            return apply_rotary(x, cos, sin)
        return torch.cat((apply_rotary(x[..., :self.rd], cos, sin), x[..., self.rd:]), dim=-1)

    def fuse_qkv(self) -> None:
        self.qkv = FusedProjections.of(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x, cos, sin, kv: LayerKV, start: int, window=None) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, k, v = q.view(T, self.h, self.hd), k.view(T, self.hkv, self.hd), v.view(T, self.hkv, self.hd)
        store = None if window is None else (v, kv.k, kv.v, window.positions)  # a captured pass's KV rows
        if self.rd == self.hd:
            q, k = norm_rotate_qk(q, k, cos, sin, *((self.q_norm, self.k_norm) if self.qk_norm else ()), store=store)
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            if store is not None:
                store_kv(k, store)
        if window is not None:
            return self._decode_window(q, kv, window)
        end = start + T
        kv.k[start:end] = k
        kv.v[start:end] = v
        if T == 1 and q.is_cuda:  # eager decode (the baselines' steps): the decode kernel too
            return self._attend_split_k(q, kv, torch.full((1,), start, device=q.device), end)
        q_ = q.transpose(0, 1)  # [H, T, Hd]
        k_ = kv.k[:end].transpose(0, 1)  # [Hkv, L, Hd]
        v_ = kv.v[:end].transpose(0, 1)
        if T == 1:
            o = F.scaled_dot_product_attention(q_, k_, v_, enable_gqa=True)
        else:
            o = causal_attention(q_, k_, v_)
        return self.o_proj(o.transpose(0, 1).reshape(T, self.h * self.hd))

    def _attend_split_k(self, q, kv: LayerKV, position: torch.Tensor, size: int) -> torch.Tensor:
        """CUDA: token t of q [T, H, Hd] over cache rows 0..position + t (< size), position on the
        device (T = 1: a decode step; more: a captured short prefill pass). SDPA's
        fused kernels parallelise over heads only (Hkv programs for one query), so most of the
        GPU idles: with SDPA (enable_gqa) the graph's step on the H200 grew by 2.2 ms per 1k
        tokens of context over 48 layers (results/2026-11-29-h200x2/). The split-K kernel
        spreads the window over up to Hkv * 64 programs (scripts/bench_decode_attention.py)."""
        from ostinato.kernels.triton.decode_attention import decode_attention

        T = q.shape[0]
        o = decode_attention(q, kv.k, kv.v, position, size)  # [T, H, Hd]
        return self.o_proj(o.reshape(T, self.h * self.hd))

    def _decode_window(self, q, kv: LayerKV, window: "DecodeWindow") -> torch.Tensor:
        """The T tokens of a captured pass (one for decode) whose first position lives on the device,
        their KV written there (forward's store): attend over a fixed window of the cache, token t
        over rows 0..position + t, masking what lies beyond. No host value depends on the position,
        so a captured graph replays it for every position within the window."""
        if q.is_cuda:
            return self._attend_split_k(q, kv, window.position, window.size)
        # CPU: SDPA with the window's mask. The query heads of a KV head are its queries (query
        # head h reads KV head h // G), so the window is read once per KV head, never repeated.
        T, G = q.shape[0], self.h // self.hkv
        k_ = kv.k[:window.size].transpose(0, 1)[None]  # [1, Hkv, W, Hd]
        v_ = kv.v[:window.size].transpose(0, 1)[None]
        q_ = q.reshape(T, self.hkv, G, self.hd).transpose(0, 1).reshape(1, self.hkv, T * G, self.hd)
        mask = window.mask.repeat_interleave(G, dim=0)  # [T * G, W]: row t * G + g is token t's
        o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask)  # [1, Hkv, T * G, Hd]
        return self.o_proj(o.reshape(self.hkv, T, G * self.hd).transpose(0, 1).reshape(T, self.h * self.hd))


class SparseMoeBlock(RoutedBlock):
    """Router here; the routed experts come from the backend the runner plugs in."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts: ExpertsBackend | None = None

    def route(self, h: torch.Tensor) -> TopKOutput:
        return router.route(self.gate(h), self.top_k, self.norm_topk, h.dtype)


class Qwen3MoeForCausalLM(MoECausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        self.build(cfg, lambda i: DecoderLayer(Attention(cfg), SparseMoeBlock(cfg, i) if cfg.is_moe_layer(i) else
                                               DenseMLP(cfg.hidden_size, cfg.intermediate_size), norm),
                   norm, cfg.head_dim)

    @staticmethod
    def kv_shapes(cfg: ModelConfig) -> KVShapes:
        """Per-head keys and values, after q/k norm and rotary."""
        return {"k": (cfg.num_key_value_heads, cfg.head_dim), "v": (cfg.num_key_value_heads, cfg.head_dim)}

    @staticmethod
    def attention_shape(cfg: ModelConfig) -> AttentionShape:
        hd = cfg.head_dim
        return AttentionShape(cfg.num_attention_heads, cfg.num_key_value_heads, hd, hd, hd, fused_on_gpu=True)
