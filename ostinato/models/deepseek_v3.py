"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) as a pure nn.Module, as transformers computes it.

Same seams as Qwen3-MoE (models/common.py): one session, no batch dimension, routed experts
from the backend the runner plugs in. What differs:

* multi-head latent attention (MLA). Each token's keys and values are compressed to one
  latent c [R] (after kv_a_layernorm) plus one rotary key kr [Dr] shared by all heads; the
  cache stores only those, `ckv` = [c | kr], R + Dr values a token and layer (576 for V3,
  against H (Dn + Dr + Dv) = 40960 of per-head K and V). A host-driven pass of several tokens
  expands the cached latents to per-head keys and values (kv_b_proj) and attends as multi-head
  attention; a one-token step, and every captured pass (a DecodeWindow of T tokens), attends in
  the latent space instead ("absorbed" MLA): the query's no-rope part goes through kv_b_proj's
  key half, q_lat = W_uk^T q_nope [R], it scores q_lat . c + q_rope . kr against the cache itself
  and the latent average goes out through the value half, so a pass reads R + Dr values per
  cached token and expands nothing: one KV head of R + Dr key columns whose first R are the
  values, under H query heads (on CUDA the split-K kernel, kernels/triton/decode_attention.py).
  The two are the same function up to the order of rounding;
* queries through a low-rank q_a_proj / q_a_layernorm / q_b_proj (or one q_proj when
  q_lora_rank is None); rotary on the last Dr dims of queries and keys, pairs interleaved
  (`rope_interleave`); yarn's mscale folded into the softmax scale;
* MoE layers from first_k_dense_replace on, routed by sigmoid scores with a selection-only
  bias and group limits (layers/moe/router.py `route_grouped`), plus shared experts: an
  always-on MLP, a dense weight of the model computed beside the routed branches.
  The router's weight and bias stay fp32 whatever the compute dtype, as in the reference.

Legend: T new tokens, L cached + new tokens, W decode window, D hidden, H heads, Dn / Dr
no-rope / rope head dims, Dv value head dim, R kv_lora_rank, E routed experts, K top-k.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ostinato.config import ModelConfig
from ostinato.layers.moe.router import route_grouped
from ostinato.layers.moe.types import TopKOutput
from ostinato.models.common import (AttentionShape, causal_attention, DecodeWindow, DecoderLayer, DenseMLP, KVShapes, MoECausalLM,
                                    RMSNorm, RoutedBlock)
from ostinato.models.rope import apply_rotary, apply_rotary_interleaved, softmax_scale

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm keep the reference's default, not rms_norm_eps


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, H, b = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
        self.h, self.rank = H, cfg.kv_lora_rank
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = self.dn + self.dr
        self.low_rank_q = cfg.q_lora_rank is not None
        if not self.low_rank_q:
            self.q_proj = nn.Linear(D, H * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=b)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.rank + self.dr, bias=b)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(H * self.dv, D, bias=b)
        self.scale = softmax_scale(qk, cfg.rope_scaling)
        self.rotate = apply_rotary_interleaved if cfg.rope_interleave else apply_rotary

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.low_rank_q:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(self, x, cos, sin, kv, start: int, window: DecodeWindow | None = None) -> torch.Tensor:
        T = x.shape[0]
        q_nope, q_rope = self._query(x).view(T, self.h, self.dn + self.dr).split([self.dn, self.dr], dim=-1)
        q_rope = self.rotate(q_rope, cos, sin)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.dr], dim=-1)
        row = torch.cat((self.kv_a_layernorm(c), self.rotate(k_rope[:, None, :], cos, sin)[:, 0]), dim=-1)  # [T, R+Dr]
        if window is not None:  # position on the device: capturable, one graph per window
            kv.ckv.index_copy_(0, window.positions, row)
            return self._attend_window(q_nope, q_rope, kv.ckv, window)
        end = start + T
        kv.ckv[start:end] = row
        if T == 1:
            return self._attend_latent(q_nope, q_rope, kv.ckv[:end], None)
        return self._attend_expanded(q_nope, q_rope, kv.ckv[:end])

    def _attend_expanded(self, q_nope, q_rope, ckv: torch.Tensor) -> torch.Tensor:
        """T new tokens over the L cached ones (the last T of them): the latents expanded to per-head
        K [L, H, Dn+Dr] and V [L, H, Dv], then causal multi-head attention (common.causal_attention)."""
        T, L = q_nope.shape[0], ckv.shape[0]
        latent, k_rope = ckv.split([self.rank, self.dr], dim=-1)
        k_nope, v = self.kv_b_proj(latent).view(L, self.h, self.dn + self.dv).split([self.dn, self.dv], dim=-1)
        k = torch.cat((k_nope, k_rope[:, None, :].expand(L, self.h, self.dr)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        o = causal_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), self.scale)  # [H, T, Dv]
        return self.o_proj(o.transpose(0, 1).reshape(T, self.h * self.dv))

    def _absorb(self, q_nope, q_rope) -> torch.Tensor:
        """[T, H, R+Dr]: each head's query in the latent space, q_lat = W_uk^T q_nope [R], then its
        rope part: scored against a cache row [c | kr] it is the expanded key's score."""
        w_uk = self.kv_b_proj.weight.view(self.h, self.dn + self.dv, self.rank)[:, :self.dn]
        return torch.cat((torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope), dim=-1)

    def _emit(self, o: torch.Tensor) -> torch.Tensor:
        """o [T, H, R], each head's average latent -> its value through W_uv [Dv], then o_proj."""
        w_uv = self.kv_b_proj.weight.view(self.h, self.dn + self.dv, self.rank)[:, self.dn:]
        T = o.shape[0]
        return self.o_proj(torch.einsum("thr,hvr->thv", o, w_uv).reshape(T, self.h * self.dv))

    def _attend_latent(self, q_nope, q_rope, ckv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """T tokens over cache rows ckv [W, R+Dr] (mask [T, W], or None: all), in the latent space: the
        T*H queries are rows of one shared key head (row t*H + h: token t's head h), so nothing is
        repeated; values are the rows' first R columns."""
        T = q_nope.shape[0]
        q = self._absorb(q_nope, q_rope).view(1, 1, T * self.h, self.rank + self.dr)
        if mask is not None:
            mask = mask.repeat_interleave(self.h, dim=0)  # [T*H, W]
        o = F.scaled_dot_product_attention(q, ckv[None, None], ckv[None, None, :, :self.rank], attn_mask=mask,
                                           scale=self.scale)  # [1, 1, T*H, R]
        return self._emit(o.view(T, self.h, self.rank))

    def _attend_window(self, q_nope, q_rope, ckv: torch.Tensor, window: DecodeWindow) -> torch.Tensor:
        """The T tokens of a captured pass (one at decode) at window.position + t, their rows written
        (forward): token t over cache rows 0..position + t of the window, in the latent space. CUDA:
        the split-K kernel, the latent cache as one KV head of R + Dr columns whose first R are the
        values (read in place, never copied); it holds no T x H x W scores, which SDPA's expression
        would (fp32: 1 GiB for 256 tokens of V3's 128 heads over 8k), and spreads the window over the
        GPU, where SDPA parallelises over the one shared head. CPU: SDPA with the window's mask."""
        if q_nope.is_cuda:
            from ostinato.kernels.triton.decode_attention import decode_attention  # triton: CUDA only

            lat = ckv[:, None]  # [L, 1, R+Dr]
            o = decode_attention(self._absorb(q_nope, q_rope), lat, lat[..., :self.rank], window.position,
                                 window.size, self.scale)  # [T, H, R]
            return self._emit(o)
        return self._attend_latent(q_nope, q_rope, ckv[:window.size], window.mask)


class GroupedRouter(nn.Module):
    """Router weight [E, D] and selection bias [E], both fp32 (`fp32_params`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))
        self.k, self.groups, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> TopKOutput:
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        return route_grouped(logits, self.e_score_correction_bias.float(), self.k, self.groups, self.topk_group,
                             self.norm, self.scaling)


class MoE(RoutedBlock):
    """Routed experts (the backend) plus the shared experts (a dense MLP of this module)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.gate = GroupedRouter(cfg)
        n = cfg.n_shared_experts
        self.shared_experts = DenseMLP(cfg.hidden_size, n * cfg.moe_intermediate_size) if n else None

    def route(self, h: torch.Tensor) -> TopKOutput:
        return self.gate(h)

    def finish(self, h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The shared experts' output added to the routed experts' sum."""
        return routed if self.shared_experts is None else routed + self.shared_experts(h)


class DeepseekV3ForCausalLM(MoECausalLM):
    """The decoder of DeepSeek-V3, whose attention a subclass may replace (GLM-4-MoE:
    models/glm4_moe.py) along with the cache it declares."""

    fp32_params = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        self.build(cfg, lambda i: DecoderLayer(self.attention(cfg), MoE(cfg, i) if cfg.is_moe_layer(i) else
                                               DenseMLP(cfg.hidden_size, cfg.intermediate_size), norm),
                   norm, self.attention_shape(cfg).rope_dim)

    @staticmethod
    def attention(cfg: ModelConfig) -> nn.Module:
        """One layer's attention module."""
        return MLAttention(cfg)

    @staticmethod
    def kv_shapes(cfg: ModelConfig) -> KVShapes:
        """The compressed cache: latent (after kv_a_layernorm) then the rotated rope key."""
        return {"ckv": (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)}

    @staticmethod
    def attention_shape(cfg: ModelConfig) -> AttentionShape:
        H, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        return AttentionShape(H, H, dn + dr, dv, dr, H * (dn + dv) + H * (dn + dr), fused_on_gpu=True,
                              latent_dim=cfg.kv_lora_rank)
