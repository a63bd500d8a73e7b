"""gpt-oss (`GptOssForCausalLM`) as a pure nn.Module, as transformers computes it.

Same seams as Qwen3-MoE (models/common.py): one session, no batch dimension, the routed
experts a backend the runner plugs in. What differs:

* attention with biases on q/k/v/o, no q/k norms, and a learned logit per head, the sink,
  that joins every softmax's denominator (a key no value comes with):
      p_j = exp(s_j) / (exp(sink_h) + sum_j' exp(s_j'))
  so a head may attend to nothing. Sliding-window layers (`layer_types`) let a query see
  the `sliding_window` most recent keys, itself included; the others attend to all.
  Attention here is plain torch (scores in fp32, queries in chunks that bound the score
  tensor). A captured pass of T tokens whose position lives on the device (DecodeWindow)
  attends, on a full layer, to the window's cache rows (on CUDA for T > 1 through the split-K
  kernel with the sinks, kernels/triton/decode_attention.py, which holds no T x H x W scores),
  or, on a sliding layer, gathers the `sliding_window` + T - 1 rows ending at its last token by
  an index computed on the device: capturable, and independent of the window's size;
* the router is a linear with a bias; top-k on its logits, softmax over the k chosen
  (layers/moe/router.py `route_topk_softmax`);
* the experts have biases and the clamped SwiGLU (ModelConfig.expert_act); the checkpoint
  interleaves gate and up, the loader de-interleaves them (loader/gpt_oss.py), so every
  expert backend sees the project's [gate; up] layout;
* RMSNorm multiplies by its weight in fp32, then rounds (transformers keeps the norms fp32).

Legend: T new tokens, L cached + new tokens, W keys a query sees, D hidden, H query heads,
Hkv KV heads, G = H / Hkv, Hd head dim, E experts, K experts per token.
"""
from __future__ import annotations

import torch
from torch import nn

from ostinato.config import ModelConfig
from ostinato.layers.moe.router import route_topk_softmax
from ostinato.layers.moe.types import TopKOutput
from ostinato.models.common import (AttentionShape, DecodeWindow, DecoderLayer, FusedProjections, KVShapes,
                                    MoECausalLM, RMSNorm, RoutedBlock)
from ostinato.models.rope import norm_rotate_qk

SCORE_BUDGET = 1 << 27  # bytes of fp32 scores one chunk of queries may hold (prefill)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
                   mask: torch.Tensor) -> torch.Tensor:
    """q [H, T, Hd], k and v [Hkv, W, Hd], sinks [H], mask [T, W] or [1, W] bool (True: attend)
    -> [H, T, Hd] in q's dtype. Scores and softmax in fp32; every query head of a KV head reads
    that head's keys once (no repeat)."""
    H, T, Hd = q.shape
    Hkv = k.shape[0]
    G = H // Hkv
    s = torch.matmul(q.reshape(Hkv, G * T, Hd), k.transpose(1, 2)).float().mul_(scale)  # [Hkv, G*T, W]
    s = s.view(Hkv, G, T, -1).masked_fill_(~mask, float("-inf"))
    sink = sinks.float().view(Hkv, G, 1, 1)
    m = torch.maximum(s.amax(-1, keepdim=True), sink)  # finite: the sink is
    p = s.sub_(m).exp_()  # in place: one fp32 score tensor at a time
    p = p.div_(p.sum(-1, keepdim=True) + torch.exp(sink - m))
    o = torch.matmul(p.to(v.dtype).view(Hkv, G * T, -1), v)  # [Hkv, G*T, Hd]
    return o.view(H, T, Hd)


class SinkAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.h, self.hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        D, b = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(D, self.h * self.hd, bias=b)
        self.k_proj = nn.Linear(D, self.hkv * self.hd, bias=b)
        self.v_proj = nn.Linear(D, self.hkv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.h * self.hd, D, bias=b)
        self.sinks = nn.Parameter(torch.zeros(self.h))
        self.window = cfg.window_of(layer)  # None: full attention
        self.scale = self.hd ** -0.5
        self.qkv: FusedProjections | None = None  # fuse_qkv

    def fuse_qkv(self) -> None:
        self.qkv = FusedProjections.of(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x, cos, sin, kv, start: int, window: DecodeWindow | None = None) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        v = v.view(T, self.hkv, self.hd)
        store = None if window is None else (v, kv.k, kv.v, window.positions)  # a captured pass's KV rows
        q, k = norm_rotate_qk(q.view(T, self.h, self.hd), k.view(T, self.hkv, self.hd), cos, sin, store=store)
        if window is not None:
            o = self._decode_window(q, kv, window)
        else:
            kv.k[start:start + T] = k
            kv.v[start:start + T] = v
            o = self._prefill(q.transpose(0, 1), kv, start, T)
        return self.o_proj(o.transpose(0, 1).reshape(T, self.h * self.hd))

    def _prefill(self, q: torch.Tensor, kv, start: int, T: int) -> torch.Tensor:
        """q [H, T, Hd] of positions [start, start + T), the cache holding them -> [H, T, Hd]."""
        end = start + T
        span = min(end, self.window + T) if self.window else end  # keys one chunk reads, at most
        step = max(1, SCORE_BUDGET // (4 * self.h * span))
        out = []
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            lo = max(0, start + t0 - self.window + 1) if self.window else 0  # first key of the chunk
            i = torch.arange(start + t0, start + t1, device=q.device)[:, None]  # query positions
            j = torch.arange(lo, start + t1, device=q.device)[None, :]  # key positions
            mask = j <= i
            if self.window:
                mask &= j > i - self.window
            k_ = kv.k[lo:start + t1].transpose(0, 1)  # [Hkv, W, Hd]
            v_ = kv.v[lo:start + t1].transpose(0, 1)
            out.append(sink_attention(q[:, t0:t1], k_, v_, self.sinks, self.scale, mask))
        return torch.cat(out, dim=1)

    def _decode_window(self, q, kv, window: DecodeWindow) -> torch.Tensor:
        """q [T, H, Hd]: the T tokens of a captured pass (one at decode) at position + t, the position
        on the device, their KV written there (forward's store) -> [H, T, Hd]. Full layers: token t
        over the window's rows 0..position + t; sliding layers: over the `sliding_window` rows that end
        at position + t, out of the window + T - 1 rows gathered by a device-side index (capturable,
        and independent of the window's size)."""
        T = q.shape[0]
        if self.window is None:
            if q.is_cuda and T > 1:  # the split-K kernel reads the cache in place: no T x H x W scores
                # (T = 1, decode, keeps the torch expression its captured step always had)
                from ostinato.kernels.triton.decode_attention import decode_attention  # triton: CUDA only

                o = decode_attention(q, kv.k, kv.v, window.position, window.size, self.scale, sinks=self.sinks)
                return o.transpose(0, 1)
            k_, v_, mask = kv.k[:window.size], kv.v[:window.size], window.mask  # mask [T, W]
        else:  # token t reads gathered rows t..t + window - 1 (the band every sliding layer of a pass shares)
            rows, mask = window.band(self.window)
            k_, v_ = kv.k.index_select(0, rows), kv.v.index_select(0, rows)
        return sink_attention(q.transpose(0, 1), k_.transpose(0, 1), v_.transpose(0, 1), self.sinks, self.scale,
                              mask)


class GptOssMoE(RoutedBlock):
    """The router (a linear with bias) here; the routed experts come from the backend."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.top_k = layer, cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)

    def route(self, h: torch.Tensor) -> TopKOutput:
        return route_topk_softmax(self.router(h), self.top_k, h.dtype)


class GptOssForCausalLM(MoECausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fp32_weight=True)  # noqa: E731
        self.build(cfg, lambda i: DecoderLayer(SinkAttention(cfg, i), GptOssMoE(cfg, i), norm), norm, cfg.head_dim)

    @staticmethod
    def kv_shapes(cfg: ModelConfig) -> KVShapes:
        """Per-head keys (after rotary) and values, every layer the whole context (a sliding
        layer reads only its window of them)."""
        return {"k": (cfg.num_key_value_heads, cfg.head_dim), "v": (cfg.num_key_value_heads, cfg.head_dim)}

    @staticmethod
    def attention_shape(cfg: ModelConfig) -> AttentionShape:
        hd = cfg.head_dim
        return AttentionShape(cfg.num_attention_heads, cfg.num_key_value_heads, hd, hd, hd,
                              max_scores=SCORE_BUDGET // 4)  # fp32 scores of one chunk of queries
