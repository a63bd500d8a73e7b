"""Decode attention: T tokens' query heads over a window of the KV cache, split-K.

Legend: H query heads, Hkv KV heads, G = H / Hkv query heads per KV head, Dk key (and query)
width, Dv value width (Dv <= Dk), W window (cache rows attended), NS splits of the window, CHUNK
keys per split, T query tokens (1 at decode; a few for a short prefill pass captured in a CUDA
graph), R = T*G rows a KV head. Caches k [>= W, Hkv, Dk] and v [>= W, Hkv, Dv] (read through their
strides, never copied: v may be a view of k's first Dv columns, as MLA's latent cache is both);
q [T, H, Dk], query head h*G + g reads KV head h; position [1] int64 on the device: token t sits at
position + t and its keys 0..min(position + t, W - 1) are valid (causal; the T tokens' K, V are in
the cache).

At decode the whole window is read once for one token, so the work is bytes of K and V.
SDPA's fused kernels parallelise over heads only (Hkv programs for one query), which leaves
most of an H200 idle: with SDPA (enable_gqa) the captured decode step grew ~2.2 ms per 1k
tokens of context over 48 layers. Here the window is split across programs (flash-decoding)
and the splits combined after (timed against SDPA by scripts/bench_decode_attention.py):
- _split_kernel, grid (Hkv, NS, cdiv(R, BLOCK_R)): rows r = t*G + g (query head h*G + g of
  token t) of KV head h, BLOCK_R a program, against keys [s*CHUNK, (s+1)*CHUNK) in blocks of
  BLOCK_N, online softmax in fp32 (log2 domain). The score is one tl.dot over the first Dv
  columns (BLOCK_DV, the next power of two) and, where Dk > Dv (MLA's rope columns), a second
  over the Dk - Dv after them (their own BLOCK_DT), accumulated into the first: padding a
  576-wide MLA key to 1024 would nearly double its work; Dk == Dv compiles without the second.
  tl.dot needs M >= 16, so at T = 1 the G heads are padded to BLOCK_R = max(16, G) rows (zero
  queries, never stored): idle tensor-core lanes, no extra bytes; K and V are read once. For
  more rows (decode_plan.py row_block: T > 1, or a wide Dv) blocks of at most 64 (32 for a
  wide Dv) keep the fp32 acc in registers; each row block rereads the split's K and V (from L2,
  mostly). Keys past a row's last are masked, and keys past the block's last never read (so
  stale or NaN rows are harmless); a split that starts past the block's last writes m = -inf,
  l = 0 and returns before reading q, K or V, so a large window costs little while the context
  is short. For T > 1 a row whose last key lies before the split keeps m = -inf beside rows
  that don't: the softmax subtracts 0 for it (not -inf - -inf = NaN); T = 1 skips that select,
  bit for bit the decode it always was. Writes the unnormalised partials m, l [Hkv, NS, R] and
  acc [Hkv, NS, R, Dv] in fp32.
- _reduce_kernel, grid (H, T): one query head of one token, its splits up to the token's
  last key (the first last // CHUNK + 1: every later one returned early or masked all its
  keys for this row, and is never read) combined by log-sum-exp rescaling in a fixed order
  (deterministic, no atomics); out [T, H, Dv] in q's dtype. With sinks (gpt-oss), the
  head's sink logit adds exp(sink - max) to the denominator.
The position is read on the device only and the plan (decode_plan.py: NS, CHUNK, BLOCK_R,
BLOCK_N, warps, stages) depends on W, T, G, Dv and the dtype alone, so the launch shapes are fixed and a captured
CUDA graph replays for every position in its window. Splits: the window in chunks of at least
MIN_CHUNK keys, at most MAX_SPLITS splits of one token's row blocks: 4 * 64 = 256 programs for
Qwen3-30B-A3B (Hkv = 4) from W = 4096 up, ~2 per SM of an H200, each streaming 64..512 keys
(32..256 KB of K and V); for DeepSeek-V3's latent attention (Hkv = 1, G = 128 rows in 4 blocks
of 32) as many, 4 blocks of 64 splits.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ostinato.kernels.triton.decode_plan import LaunchPlan, launch_plan, next_power_of_2

REDUCE_ELEMS = 4096  # fp32 sums a reduce program holds: BLOCK_S splits x BLOCK_DV


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, qk_scale,
                  T, W, CHUNK, NS,
                  stride_qt, stride_qh, stride_qd, stride_kn, stride_kh, stride_kd,
                  stride_vn, stride_vh, stride_vd,
                  G: tl.constexpr, DV: tl.constexpr, DT: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr):
    h = tl.program_id(0)
    s = tl.program_id(1)
    r0 = tl.program_id(2) * BLOCK_R
    R = T * G
    pos = tl.load(pos_ptr).to(tl.int32)
    t_hi = tl.minimum((r0 + BLOCK_R - 1) // G, T - 1)  # the block's last token
    last = tl.minimum(pos + t_hi, W - 1)  # the block's last valid key
    start = s * CHUNK
    offs_r = r0 + tl.arange(0, BLOCK_R)  # row t*G + g
    mask_r = offs_r < R
    part = (h * NS + s) * R + offs_r  # row of m, l; acc row times DV
    if start > last:
        tl.store(m_ptr + part, tl.full([BLOCK_R], float("-inf"), tl.float32), mask=mask_r)
        tl.store(l_ptr + part, tl.zeros([BLOCK_R], tl.float32), mask=mask_r)
        return  # _reduce_kernel never reads this split's acc
    end = tl.minimum(start + CHUNK, last + 1)
    t_r = tl.minimum(offs_r // G, T - 1)  # padding rows clamped: in bounds, never stored
    end_r = tl.minimum(start + CHUNK, tl.minimum(pos + t_r, W - 1) + 1)  # row r: [start, end_r)
    offs_d = tl.arange(0, BLOCK_DV)  # the first DV columns of q and k, all of v
    mask_d = offs_d < DV
    q_rows = q_ptr + (t_r * stride_qt + (h * G + offs_r % G) * stride_qh)[:, None]
    q = tl.load(q_rows + offs_d[None, :] * stride_qd,
                mask=mask_r[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_R, BLOCK_DV]
    k_base = k_ptr + h * stride_kh
    v_base = v_ptr + h * stride_vh
    if DT > 0:  # q's and k's columns DV..DV + DT - 1 (MLA's rope dims): the score's second dot
        offs_e = DV + tl.arange(0, BLOCK_DT)
        mask_e = offs_e < DV + DT
        q_tail = tl.load(q_rows + offs_e[None, :] * stride_qd,
                         mask=mask_r[:, None] & mask_e[None, :], other=0.0)  # [BLOCK_R, BLOCK_DT]
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_DV, BLOCK_N]
        qk = tl.dot(q, kt, input_precision=PRECISION)
        if DT > 0:
            kt_tail = tl.load(k_base + offs_n[None, :] * stride_kn + offs_e[:, None] * stride_kd,
                              mask=mask_e[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_DT, BLOCK_N]
            qk = tl.dot(q_tail, kt_tail, qk, input_precision=PRECISION)
        qk = qk * qk_scale  # log2 domain
        if CAUSAL:  # each row its own last key; a row whose last key lies before this
            # split keeps m = -inf: subtract 0 there, not -inf (NaN), so its partials (never
            # read) stay m = -inf, l = 0, acc = 0
            qk = tl.where(offs_n[None, :] < end_r[:, None], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # finite: column 0 is valid
            m_sub = m_new
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(qk - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    tl.store(m_ptr + part, m_i, mask=mask_r)
    tl.store(l_ptr + part, l_i, mask=mask_r)
    tl.store(acc_ptr + part[:, None] * DV + offs_d[None, :], acc,
             mask=mask_r[:, None] & mask_d[None, :])


@triton.jit
def _reduce_kernel(m_ptr, l_ptr, acc_ptr, pos_ptr, sink_ptr, out_ptr, T, W, CHUNK, NS,
                   stride_ot, stride_oh, stride_od,
                   G: tl.constexpr, DV: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_DV: tl.constexpr, SINKS: tl.constexpr):
    qh = tl.program_id(0)  # query head h*G + g
    t = tl.program_id(1)  # token
    h = qh // G
    g = qh % G
    R = T * G
    last = tl.minimum(tl.load(pos_ptr).to(tl.int32) + t, W - 1)
    active = last // CHUNK + 1  # splits holding a valid key; later ones are never read
    rows = h * NS * R + t * G + g  # split s of this head and token: rows + s*R
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < DV
    m_max = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, active, BLOCK_S):
        ss = s0 + offs_s
        m_max = tl.maximum(m_max, tl.load(m_ptr + rows + ss * R, mask=ss < active,
                                          other=float("-inf")))
    m_all = tl.max(m_max, axis=0)  # finite: split 0 is active
    den = tl.zeros([BLOCK_S], tl.float32)
    num = tl.zeros([BLOCK_S, BLOCK_DV], tl.float32)
    for s0 in range(0, active, BLOCK_S):
        ss = s0 + offs_s
        mask_s = ss < active
        w = tl.exp2(tl.load(m_ptr + rows + ss * R, mask=mask_s, other=float("-inf")) - m_all)
        den += w * tl.load(l_ptr + rows + ss * R, mask=mask_s, other=0.0)
        a = tl.load(acc_ptr + (rows + ss * R)[:, None] * DV + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        num += a * w[:, None]
    den_all = tl.sum(den, axis=0)
    if SINKS:  # a key no value comes with; its logit in natural-log units, as the scaled scores:
        # to the log2 domain (one far above the scores overflows to inf: out 0, its limit)
        sink = tl.load(sink_ptr + qh).to(tl.float32) * 1.4426950408889634
        den_all += tl.exp2(sink - m_all)
    o = tl.sum(num, axis=0) / den_all
    tl.store(out_ptr + t * stride_ot + qh * stride_oh + offs_d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=mask_d)


def decode_attention(q, k_cache, v_cache, position, window, scale=None, out=None, *, sinks=None,
                     chunk=None, block_n=None, block_r=None, num_warps=None, num_stages=None):
    """softmax(q k^T * scale) v, token t over cache rows 0..position + t (and < window) -> [T, H, Dv]
    ([H, Dv] for q [H, Dk]). sinks [H] (gpt-oss): one logit per query head that joins each softmax's
    denominator as a key with no value, softmax over [q k^T * scale, sink]; None: no such term.

    q [T, H, Dk] (T >= 1 tokens at positions position..position + T - 1, their K and V already in
    the cache) or [H, Dk] (T = 1); k_cache [>= window, Hkv, Dk] and v_cache [>= window, Hkv, Dv],
    Dv <= Dk, of q's dtype (v_cache may be a view of k_cache's first Dv columns); position [1] int64
    on q's device; window: W, a Python int. scale: 1/sqrt(Dk) by default. out: T*H*Dv elements
    (contiguous), else allocated. chunk, block_n, block_r (rows a split program), num_warps,
    num_stages: overrides of decode_plan.launch_plan's for tests and tuning. No host value depends
    on the position (capturable).
    """
    H, Dk = q.shape[-2], q.shape[-1]
    q3 = q if q.dim() == 3 else q[None]
    T = q3.shape[0]
    Hkv, Dv = k_cache.shape[1], v_cache.shape[-1]
    assert q.dim() in (2, 3) and T >= 1, "q [T, H, Dk] or [H, Dk]"
    assert k_cache.shape[1:] == (Hkv, Dk) and v_cache.shape[1:] == (Hkv, Dv) and 1 <= Dv <= Dk, "shapes"
    assert H % Hkv == 0, "query heads a multiple of the KV heads"
    assert min(k_cache.shape[0], v_cache.shape[0]) >= window >= 1, "the cache is shorter than W"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the caches must share a dtype"
    assert sinks is None or (sinks.shape == (H,) and sinks.is_contiguous()), "sinks [H]"
    G = H // Hkv
    plan = launch_plan(T, G, Dv, window, itemsize=q.element_size(), chunk=chunk, block_n=block_n, block_r=block_r,
                       num_warps=num_warps, num_stages=num_stages)
    if scale is None:
        scale = 1.0 / math.sqrt(Dk)
    dev = q.device
    m = torch.empty(Hkv, plan.splits, T * G, dtype=torch.float32, device=dev)
    l_ = torch.empty_like(m)
    acc = torch.empty(Hkv, plan.splits, T * G, Dv, dtype=torch.float32, device=dev)
    if out is None:
        out = torch.empty(q.shape[:-1] + (Dv,), dtype=q.dtype, device=dev)
    assert out.is_contiguous() and out.numel() == T * H * Dv, "out must be contiguous, T*H*Dv elements"
    o3 = out.view(T, H, Dv)
    meta = split_constexprs(T, G, Dk, Dv, plan, q.dtype == torch.float32)
    _split_kernel[(Hkv, plan.splits, triton.cdiv(T * G, plan.block_r))](
        q3, k_cache, v_cache, position, m, l_, acc, scale * math.log2(math.e),
        T, window, plan.chunk, plan.splits,
        q3.stride(0), q3.stride(1), q3.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        **meta, num_warps=plan.num_warps)
    block_dv = meta["BLOCK_DV"]
    _reduce_kernel[(H, T)](
        m, l_, acc, position, m if sinks is None else sinks, o3, T, window, plan.chunk, plan.splits,
        o3.stride(0), o3.stride(1), o3.stride(2), G=G, DV=Dv,
        BLOCK_S=min(32, next_power_of_2(plan.splits), REDUCE_ELEMS // block_dv), BLOCK_DV=block_dv,
        SINKS=sinks is not None, num_warps=4)
    return out


def split_constexprs(T: int, G: int, Dk: int, Dv: int, plan: LaunchPlan, fp32: bool) -> dict:
    """_split_kernel's compile-time arguments for T tokens' G rows a KV head, keys Dk and values Dv wide,
    under `plan` (decode_attention's launch; scripts/kernel_resources.py compiles the same): fp32 inputs
    take the ieee dot (no tf32 rounding)."""
    return dict(G=G, DV=Dv, DT=Dk - Dv, BLOCK_R=plan.block_r, BLOCK_DV=max(16, next_power_of_2(Dv)),
                BLOCK_DT=max(16, next_power_of_2(Dk - Dv)), BLOCK_N=plan.block_n, CAUSAL=T > 1,
                PRECISION="ieee" if fp32 else None, NUM_STAGES=plan.num_stages)
