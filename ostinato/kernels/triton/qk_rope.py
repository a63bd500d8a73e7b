"""Queries and keys of one layer, per-head RMSNorm (optional) and rotary, in one launch ([Q]).

As the modules compute them, rounding where they round: for each head row of q [T, H, Hd] and
k [T, Hkv, Hd] (read through their strides), models/common.py RMSNorm when `q_weight` is given
(fp32 mean square, rsqrt(mean + eps), the product cast to q's dtype, times the weight, rounded),
then models/rope.py apply_rotary (half-split pairs: x * cos + rotate_half(x) * sin, each product
and the sum rounded to q's dtype). Every step but the mean square is one rounding of an exact
fp32 value (compiled without fused multiply-adds: on the H200 a contracted product and sum, rounded
once, was a last place off the torch expression in some rows), so the rotary alone (no norm) equals the torch expression bit for bit on CUDA, and
with the norm a result can differ in its last place where the mean square's summation order
moves its last fp32 bit. In Qwen3's decode step the torch expressions were 26 launches a layer
(two norms of 8, two rotaries of 5: negate, cat, two products, sum), 1248 of the step's 3300 on
the H200 (results/2026-12-01-h200-s10/q_profile_all/profile.md); with the norms in one launch each
(rms_norm.py) 12, here one. In a decode step it also writes the key and value rows into the KV
cache at the device-side position (`store`): the two index copies were 96 launches and 0.24 ms
of the fused 4.05 ms step (results/2026-12-02-h200-s11/q_profile_all/profile.md).

Grid (T, H + Hkv), and Hkv more programs with `store` (the value rows): one program per head row,
both halves of the row in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr,
                         pos_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
                         stride_st, stride_ck, stride_cv, H, HKV, eps,
                         HALF: tl.constexpr, NORM: tl.constexpr, STORE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, HALF)
    dt = qo_ptr.dtype.element_ty
    if h >= H + HKV:  # STORE: a value row, copied into the cache at its token's position
        j = h - H - HKV
        src = v_ptr + t * stride_vt + j * stride_vh
        dst = vc_ptr + tl.load(pos_ptr + t) * stride_cv + j * (2 * HALF)
        tl.store(dst + offs, tl.load(src + offs))
        tl.store(dst + HALF + offs, tl.load(src + HALF + offs))
    else:
        if h < H:
            src = q_ptr + t * stride_qt + h * stride_qh
            dst = qo_ptr + (t * H + h) * (2 * HALF)
            w_ptr = qw_ptr
        else:
            src = k_ptr + t * stride_kt + (h - H) * stride_kh
            dst = ko_ptr + (t * HKV + h - H) * (2 * HALF)
            w_ptr = kw_ptr
        x1 = tl.load(src + offs).to(tl.float32)
        x2 = tl.load(src + HALF + offs).to(tl.float32)
        if NORM:
            r = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
            x1 = (tl.load(w_ptr + offs).to(tl.float32) * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            x2 = (tl.load(w_ptr + HALF + offs).to(tl.float32) * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c1 = tl.load(cos_ptr + t * stride_ct + offs).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_ct + HALF + offs).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_st + offs).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_st + HALF + offs).to(tl.float32)
        o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        tl.store(dst + offs, o1)
        tl.store(dst + HALF + offs, o2)
        if STORE:
            if h >= H:  # the key row into the cache too
                kdst = kc_ptr + tl.load(pos_ptr + t) * stride_ck + (h - H) * (2 * HALF)
                tl.store(kdst + offs, o1)
                tl.store(kdst + HALF + offs, o2)


def store_fits(q: torch.Tensor, store) -> bool:
    """Whether qk_norm_rope can write `store` = (v, k_cache, v_cache, positions) for q [T, H, Hd]."""
    v, kc, vc, pos = store
    hd = q.shape[-1]
    return (v.stride(-1) == 1 and all(c.stride(1) == hd and c.stride(2) == 1 for c in (kc, vc))
            and kc.dtype == vc.dtype == v.dtype == q.dtype and pos.shape == q.shape[:1] and pos.dtype == torch.int64)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 0.0, store=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, Hd], k [T, Hkv, Hd] (rows of Hd contiguous), cos, sin [T, Hd]; the per-head norm
    weights [Hd] (both or neither) -> rotated (normed) q, k, contiguous, in q's dtype.

    store = (v [T, Hkv, Hd], k_cache, v_cache [L, Hkv, Hd] with contiguous rows, positions [T]
    int64 on the device): the same launch also writes each token's rotated key and its value
    into the caches at its position (a decode step's KV write, two launches fewer a layer)."""
    T, H, Hd = q.shape
    Hkv = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("qk_norm_rope reads rows of contiguous head dims")
    if Hd % 2 or (Hd // 2) & (Hd // 2 - 1):
        raise ValueError(f"qk_norm_rope: head dim {Hd} is not twice a power of two")
    qo = torch.empty((T, H, Hd), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, Hkv, Hd), dtype=q.dtype, device=q.device)
    norm = q_weight is not None
    if store is not None:
        if not store_fits(q, store):
            raise ValueError("qk_norm_rope stores value and cache rows of contiguous head dims in q's dtype, "
                             "at one int64 position per token")
        v, kc, vc, pos = store
    else:
        v, kc, vc, pos = k, ko, ko, torch.empty(1, dtype=torch.int64, device=q.device)  # unread (STORE off)
    if T:
        _qk_norm_rope_kernel[(T, H + Hkv * (2 if store is not None else 1))](
            q, k, v, q_weight if norm else q, k_weight if norm else k, cos, sin, qo, ko, kc, vc, pos,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            sin.stride(0), kc.stride(0), vc.stride(0), H, Hkv, eps,
            HALF=Hd // 2, NORM=norm, STORE=store is not None, num_warps=1, enable_fp_fusion=False)
    return qo, ko
