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
from torch.nn.attention.bias import causal_lower_right

from ostinato.config import ModelConfig
from ostinato.layers.moe.router import route
from ostinato.layers.moe.types import TopKOutput
from ostinato.models.rope import RotaryEmbedding, apply_rotary


class ExpertsBackend(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """x [T, D], topk ids/weights [T, K] -> routing-weighted sum of experts [T, D]."""


class LayerKV(Protocol):
    k: torch.Tensor  # [max_len, Hkv, Hd]
    v: torch.Tensor  # [max_len, Hkv, Hd]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, result cast back before the weight: as the reference does
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.hd, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.hd, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.h * self.hd, cfg.hidden_size, bias=b)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv: LayerKV, start: int, window=None) -> torch.Tensor:
        T = x.shape[0]
        q = apply_rotary(self.q_norm(self.q_proj(x).view(T, self.h, self.hd)), cos, sin)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(T, self.hkv, self.hd)), cos, sin)
        v = self.v_proj(x).view(T, self.hkv, self.hd)
        if window is not None:
            return self._decode_window(q, k, v, kv, window)
        end = start + T
        kv.k[start:end] = k
        kv.v[start:end] = v
        if T == 1 and q.is_cuda:  # eager decode (the baselines' steps): the decode kernel too
            return self._attend_one(q, kv, torch.full((1,), start, device=q.device), end)
        q_ = q.transpose(0, 1)  # [H, T, Hd]
        k_ = kv.k[:end].transpose(0, 1)  # [Hkv, L, Hd]
        v_ = kv.v[:end].transpose(0, 1)
        if T == 1:
            o = F.scaled_dot_product_attention(q_, k_, v_, enable_gqa=True)
        elif start == 0:
            o = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True)
        else:
            # a chunk after cached tokens: query i sees keys [0, start + i]. The lower-right
            # causal bias lets torch pick a fused kernel; an explicit [T, L] mask would force
            # the math kernel and a T x L x H fp32 score matrix (~13 GiB at 2048 x 16k).
            # KV heads are repeated (exact) because the fused kernels take GQA only in some builds.
            rep = self.h // self.hkv
            k_, v_ = k_.repeat_interleave(rep, dim=0), v_.repeat_interleave(rep, dim=0)
            bias = causal_lower_right(T, end)
            o = F.scaled_dot_product_attention(q_[None], k_[None], v_[None], attn_mask=bias)[0]
        return self.o_proj(o.transpose(0, 1).reshape(T, self.h * self.hd))

    def _attend_one(self, q, kv: LayerKV, position: torch.Tensor, size: int) -> torch.Tensor:
        """CUDA: one token over cache rows 0..position (< size), position on the device. SDPA's
        fused kernels parallelise over heads only (Hkv programs for one query), so most of the
        GPU idles: with SDPA (enable_gqa) the graph's step on the H200 grew by 2.2 ms per 1k
        tokens of context over 48 layers (results/2026-11-29-h200x2/). The split-K kernel
        spreads the window over up to Hkv * 64 programs (scripts/bench_decode_attention.py)."""
        from ostinato.kernels.triton.decode_attention import decode_attention

        o = decode_attention(q, kv.k, kv.v, position, size)  # [1, H, Hd]
        return self.o_proj(o.reshape(1, self.h * self.hd))

    def _decode_window(self, q, k, v, kv: LayerKV, window: "DecodeWindow") -> torch.Tensor:
        """One token whose position lives on the device: write its KV there and attend over a
        fixed window of the cache, masking what lies beyond it. No host value depends on the
        position, so a captured graph replays it for every token within the window."""
        kv.k.index_copy_(0, window.position, k)
        kv.v.index_copy_(0, window.position, v)
        if q.is_cuda:
            return self._attend_one(q, kv, window.position, window.size)
        # CPU: SDPA with the window's mask. The query heads of a KV head are its queries (query
        # head h reads KV head h // G), so the window is read once per KV head, never repeated.
        k_ = kv.k[:window.size].transpose(0, 1)[None]  # [1, Hkv, W, Hd]
        v_ = kv.v[:window.size].transpose(0, 1)[None]
        q_ = q.reshape(1, self.hkv, self.h // self.hkv, self.hd)  # [1, Hkv, G, Hd]
        o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=window.mask)  # mask [1, W]
        return self.o_proj(o.reshape(1, self.h * self.hd))


class DecodeWindow:
    """A decode step's position as a device tensor and the cache window it attends over."""

    def __init__(self, position: torch.Tensor, size: int):
        self.position = position  # [1] int64, on the model's device
        self.size = size
        self._cols = torch.arange(size, device=position.device)[None, :]
        self.mask = None

    def refresh(self) -> None:
        """Recompute the mask from the device position: once per pass, inside any capture."""
        self.mask = self._cols <= self.position  # [1, W] bool


class DenseMLP(nn.Module):
    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Router here; the routed experts come from the backend the runner plugs in."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts: ExpertsBackend | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk = route(self.gate(x), self.top_k, self.norm_topk, x.dtype)
        return self.experts(self.layer, x, topk)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SparseMoeBlock(cfg, i) if cfg.is_moe_layer(i) else DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv: LayerKV, start: int, window=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, start, window)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Qwen3MoeModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg)

    def set_experts(self, backend: ExpertsBackend) -> None:
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.experts = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: list[LayerKV], start: int,
                window: DecodeWindow | None = None):
        """input_ids, positions [T] -> final hidden states [T, D] (after the last norm).

        With a DecodeWindow (one token), the position is read from the device only, so the
        pass can be captured once and replayed (see engine/graph.py). The pass is embed, then
        run_layers over every layer, then the norm: the runner may run the layers in ranges
        (one per device, engine/devices.py)."""
        x, cos, sin = self.embed(input_ids, positions, start, window)
        x = self.run_layers(range(len(self.model.layers)), x, cos, sin, kv, start, window)
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, start: int,
              window: DecodeWindow | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The start of a pass: x [T, D] and the rotary cos, sin [T, Hd] (the window's mask
        is refreshed here)."""
        x = self.model.embed_tokens(input_ids)
        if window is not None:
            window.refresh()
        seq_len = window.size if window is not None else start + input_ids.shape[0]
        cos, sin = self.rotary(positions, seq_len, x.dtype)
        return x, cos, sin

    def run_layers(self, layers: range, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: list[LayerKV],
                   start: int, window: DecodeWindow | None = None) -> torch.Tensor:
        """Decoder layers `layers` (a range, in order) on x [T, D]."""
        for i in layers:
            x = self.model.layers[i](x, cos, sin, kv[i], start, window)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] -> logits [T, V] in fp32."""
        return self.lm_head(hidden).float()
