"""Rotary position embeddings and the `rope_scaling` variants a config may carry.

Each variant only changes the inverse frequencies (and, for yarn, a scale on cos/sin),
so the model asks `RotaryEmbedding` for (cos, sin) of the positions of a pass and
applies them the same way whatever the variant. Qwen3 rotates half-split pairs
(`apply_rotary`); DeepSeek lays its pairs out interleaved (`apply_rotary_interleaved`).

Legend: T tokens, H heads, Hd rotary dim.
"""
from __future__ import annotations

import math

import torch

from ostinato.config import ConfigError, ModelConfig
from ostinato.kernels.triton import fused_dense

SUPPORTED = ("default", "linear", "dynamic", "yarn", "llama3")


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def softmax_scale(head_dim: int, rope_scaling: dict | None) -> float:
    """DeepSeek's attention scale: head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when a
    scaled rope gives mscale_all_dim (yarn's attention factor, folded into the softmax)."""
    scale = head_dim ** -0.5
    m_all = (rope_scaling or {}).get("mscale_all_dim")
    if m_all:
        scale *= yarn_mscale(rope_scaling["factor"], m_all) ** 2
    return scale


def _yarn(base: float, dim: int, sc: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = sc.get("original_max_position_embeddings") or max_pos
    factor = sc.get("factor") or max_pos / orig
    attn = sc.get("attention_factor")
    if attn is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)

    def correction_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(sc.get("beta_fast") or 32), correction_dim(sc.get("beta_slow") or 1)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attn)


def _llama3(inv: torch.Tensor, sc: dict) -> torch.Tensor:
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_len = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Computes (cos, sin) for positions; holds no parameters, so models stay pure."""

    def __init__(self, cfg: ModelConfig, dim: int):
        self.dim = dim
        self.base = cfg.rope_theta
        self.max_pos = cfg.max_position_embeddings
        sc = dict(cfg.rope_scaling or {})
        self.kind = sc.get("rope_type", sc.get("type", "default"))
        if self.kind not in SUPPORTED:
            raise ConfigError(f"rope_scaling type {self.kind!r} is not supported (supported: {SUPPORTED})")
        self.scaling = sc
        self.attention_scale = 1.0
        with torch.device("cpu"):  # even when the model is built on the meta device
            self.inv_freq = self._init_inv_freq(sc)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def _init_inv_freq(self, sc: dict) -> torch.Tensor:
        inv = _base_inv_freq(self.base, self.dim)
        if self.kind == "linear":
            inv = inv / sc["factor"]
        elif self.kind == "yarn":
            inv, self.attention_scale = _yarn(self.base, self.dim, sc, self.max_pos)
        elif self.kind == "llama3":
            inv = _llama3(inv, sc)
        return inv

    def _inv_freq_for(self, seq_len: int) -> torch.Tensor:
        if self.kind != "dynamic":
            return self.inv_freq
        with torch.device("cpu"):
            return self._dynamic_inv_freq(seq_len)

    def _dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        orig = self.scaling.get("original_max_position_embeddings") or self.max_pos
        if seq_len <= orig:
            return self.inv_freq
        factor = self.scaling["factor"]
        base = self.base * ((factor * seq_len / orig) - (factor - 1)) ** (self.dim / (self.dim - 2))
        return _base_inv_freq(base, self.dim)

    def __call__(self, positions: torch.Tensor, seq_len: int, dtype: torch.dtype):
        """positions [T] -> cos, sin [T, Hd] in `dtype` (computed in fp32)."""
        inv = self._inv_freq_for(seq_len)
        if inv is self.inv_freq:  # cached per device: no copy in the hot path
            if positions.device not in self._on_device:
                self._on_device[positions.device] = inv.to(positions.device)
            inv = self._on_device[positions.device]
        else:
            inv = inv.to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scale).to(dtype), (emb.sin() * self.attention_scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, Hd]; cos/sin [T, Hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def norm_rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_norm=None, k_norm=None, store=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, Hd], k [T, Hkv, Hd] -> each head normed by q_norm / k_norm (RMSNorm modules, or
    neither), then rotated (apply_rotary). On CUDA in one launch for both (kernels/triton/qk_rope.py),
    where the dtypes agree (the kernel rounds as the modules do, in q's dtype). `store` = (v,
    k_cache, v_cache, positions [T] on the device): the rotated keys and the values are also
    written into the caches at those positions (store_kv), in the same launch where it runs."""
    dt = q.dtype
    same = cos.dtype == sin.dtype == k.dtype == dt and (q_norm is None or q_norm.weight.dtype == k_norm.weight.dtype == dt)
    if q.is_cuda and same and q.stride(-1) == 1 and k.stride(-1) == 1 and fused_dense():
        from ostinato.kernels.triton.qk_rope import qk_norm_rope, store_fits

        fused_store = store if store is not None and store_fits(q, store) else None
        norms = () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        q, k = qk_norm_rope(q, k, cos, sin, *norms, store=fused_store)
        if store is not None and fused_store is None:
            store_kv(k, store)
        return q, k
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if store is not None:
        store_kv(k, store)
    return q, k


def store_kv(k: torch.Tensor, store) -> None:
    """Write k, v [T, Hkv, Hd] into the caches [L, Hkv, Hd] at positions [T] (device-side)."""
    v, k_cache, v_cache, positions = store
    k_cache.index_copy_(0, positions, k)
    v_cache.index_copy_(0, positions, v)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, Hd] whose pairs are (x0, x1), (x2, x3), ...; cos/sin [T, Hd] as above. The
    rotated pairs come out half-split (all first members, then all second ones), as transformers
    lays them out: queries and keys get the same permutation, so their dot products are those of
    the interleaved rotation."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
