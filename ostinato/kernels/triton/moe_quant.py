"""MoE kernels over quantized expert pools: GGUF blocks dequantized inside the kernels.

Legend: T tokens, K routes per token, D hidden size, F expert FFN size, N pool slots,
R = T*K routes, G groups of lanes per tile step, L = 16 lanes per group.
Pools (uint8, one qtype per tensor, a constexpr of the kernels): w13[N, 2F, row_bytes(qt, D)]
(gate rows then up rows), w2[N, D, row_bytes(qt, F)]; blocks run along the input dimension.

Lanes. The kernels never rebuild a row in its natural order. Each block is read as lanes: a
lane is one payload byte (Q8_0: the bytes i and i + 16) that yields two values, "lo" and
"hi", at element indices the lane knows; 16 consecutive lanes form a group whose values share
their scales. A block is 1 group (Q8_0, MXFP4: 32 values) or 8 (K-quants: 256 values), so
every format is a row of D / 32 groups, and a tile is rows x G groups x 16 lanes: payload
bytes load contiguously, scales once per (row, group), and the activation (x or h) is
gathered at the lanes' element indices instead. A dot product does not care about order: the
matvecs sum lo * x[e_lo] + hi * x[e_hi]; the GEMMs run two tl.dots per step on [G*16]-deep
tiles, one for the lo and one for the hi values. Dequantized values are fp32, computed as
gguf.quants computes them ((d * sc) * q - dmin * m), so an interpreted run matches it bitwise
(compiled, a fused multiply-add may round the last bit differently).

- decode (T small; the same computation as moe_decode, memory bound):
  _decode_w13_kernel, grid (R, F/BLOCK_F): gate and up rows of one route, act(gate, up)
  (silu(gate) * up, or gpu_experts.Epilogue's biases and activation) rounded to the activation
  dtype into h[R, F]; a zero-slot route returns before reading.
  _decode_w2_kernel, grid (T, D/BLOCK_D): the K routes of a token as K * BLOCK_D rows of one
  tile (loads in flight for all of them), zero-slot rows masked off (never read), a fixed-shape
  sum over k (deterministic); writes out[T, D] once.
- prefill: moe_prefill's route alignment and combine around two grouped GEMMs,
  _prefill_w13_kernel and _prefill_w2_kernel, each dequantizing its weight tile [G*16, BLOCK_N]
  in registers and multiplying it with tl.dot in the activation dtype (bf16 in the engine).
- _dequant_kernel: rows of one qtype to fp32 (dequantize_rows): the lanes alone, for tests
  and for whoever needs a dense copy on the GPU.
Zero bytes dequantize to zeros in every format (d = dmin = 0; MXFP4 scale 2^-128 times 0),
so a zero slot filled with zeros is harmless even where it is read (it never is here).
Slot offsets are int64: N * 2F * row_bytes exceeds 2^31 for real pools.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.kernels.triton.expert_act import activate
from ostinato.kernels.triton.moe_prefill import combine_forward

LANES = tl.constexpr(16)  # lanes per group; its 32 values share their scales in every format
# The quantized integers become fp32 by conversion instructions (I2F), which Hopper issues at 16 a clock per SM.
# Session 56 replaced them by the exponent trick (OR into 2^23's bits, subtract 2^23: the same values, no
# conversion left in the SASS) and timed both on one H200 (results/2026-12-07-h200-s56/k_quant_ab.txt, T = 256,
# graph replays, two runs each): Q4_K prefill 1155 -> 1151 us, Q4_K decode 37.9 -> 41.2 us (slower), Q6_K
# prefill 1401 -> 1325 us and decode 50.4 -> 48.3 us. The Q4_K kernels are not bound by the conversions, and
# Q4_K_M's gate/up are Q4_K, so it was not kept. What bound them was the loads: ten byte loads of a Q4_K head per
# (row, group) and the activations gathered two bytes at a time, each load spanning a tile's rows. As words
# (_words) and vectors (_b_tiles' hints), Q4_K prefill at T = 256 took 589 us against 1066 on one H100, decode 32.0
# against 37.6 (session 57, results/2026-12-08-h100-s57/k_quant_ab.txt). Q8_0's and Q6_K's blocks (34, 210 bytes) are
# only 2-byte aligned, and where a row's stride is not a multiple of 16 bytes (Q4_K_M's Q6_K down rows: 630 bytes at
# the 30B shape, 1260 at the 235B's) the compiler knew nothing of it and loaded every lane's byte alone. _rows_at marks
# their rows 2-byte aligned and _fp16 loads d whole: compiled for sm_90 (scripts/sass_loads.py, Triton 3.6), Q6_K's
# prefill w2 kernel went from 53 global load instructions (36 of single bytes) to 36 (17 of two bytes, 2 of one), its
# decode w2 from 86 to 51, Q8_0's from 51 and 80 to 34 and 46 (session 58; not yet timed on a GPU).


@triton.jit
def _half(w, shift):
    """The fp16 in bits shift..shift + 15 of the int32 w, as fp32."""
    return ((w >> shift) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp16(ptr, mask):
    """The fp16 at ptr (a uint8 pointer, 2-byte aligned) as fp32: one load, where bytes took two. Q8_0's and Q6_K's
    blocks (34, 210 bytes) are only 2-byte aligned, and their scale d lies at an even offset (0, 208)."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16), bitcast=True), mask=mask, other=0).to(tl.float32)


@triton.jit
def _q8_0(row, gg, i, mask):
    # 34 bytes: fp16 d, int8 q[32]; lane i holds q[i] (lo) and q[i + 16] (hi).
    blk = row + gg * 34
    d = _fp16(blk, mask)
    e = gg * 32 + i
    q_lo = tl.load(blk + 2 + i, mask=mask, other=0).to(tl.int8, bitcast=True)
    q_hi = tl.load(blk + 18 + i, mask=mask, other=0).to(tl.int8, bitcast=True)
    return d * q_lo.to(tl.float32), d * q_hi.to(tl.float32), e, e + 16


@triton.jit
def _words(blk, mask):
    """The 16-byte head of a Q4_K / Q5_K block at blk as four little-endian int32 words (d and dmin, then the
    12 packed scale bytes): four aligned loads, where bytes took ten (each load spans a tile's rows, so each
    is one more pass through the L1 cache)."""
    w = blk.to(tl.pointer_type(tl.int32), bitcast=True)
    return (tl.load(w, mask=mask, other=0), tl.load(w + 1, mask=mask, other=0),
            tl.load(w + 2, mask=mask, other=0), tl.load(w + 3, mask=mask, other=0))


@triton.jit
def _k_scale_min(w1, w2, w3, j):
    """6-bit scale and min of sub-block j (0..7) from the 12 packed scale bytes, words w1..w3 (Q4_K, Q5_K):
    bytes j, j + 4 and (j < 4 ? j : j - 4) of them, each the byte j % 4 of a word."""
    low = j < 4
    shift = 8 * (j % 4)
    a = (tl.where(low, w1, w2) >> shift) & 255
    b = (tl.where(low, w2, w3) >> shift) & 255
    c = (w1 >> shift) & 255
    sc = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
    m = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def _q45_k(row, gg, i, mask, FIVE: tl.constexpr):
    # Q4_K, 144 bytes: fp16 d, fp16 dmin, scales[12], qs[128]. Q5_K, 176 bytes: the same with
    # qh[32] before qs. Group gb covers qs bytes 16 gb..16 gb + 15 of 32-byte chunk c = gb // 2,
    # whose low nibbles are sub-block 2c and high nibbles 2c + 1; Q5_K's fifth bits of value
    # e are bit e // 32 of qh[e % 32]. Blocks are 16-byte aligned (144, 176): the head loads as words.
    gb = gg % 8
    c = gb // 2
    if FIVE:
        blk = row + (gg // 8) * 176
        q = tl.load(blk + 48 + gb * 16 + i, mask=mask, other=0).to(tl.int32)
        qh = tl.load(blk + 16 + (gb % 2) * 16 + i, mask=mask, other=0).to(tl.int32)
        q_lo = (q & 15) | (((qh >> (2 * c)) & 1) << 4)
        q_hi = (q >> 4) | (((qh >> (2 * c + 1)) & 1) << 4)
    else:
        blk = row + (gg // 8) * 144
        q = tl.load(blk + 16 + gb * 16 + i, mask=mask, other=0).to(tl.int32)
        q_lo = q & 15
        q_hi = q >> 4
    w0, w1, w2, w3 = _words(blk, mask)
    d = _half(w0, 0)
    dmin = _half(w0, 16)
    sc_lo, m_lo = _k_scale_min(w1, w2, w3, 2 * c)
    sc_hi, m_hi = _k_scale_min(w1, w2, w3, 2 * c + 1)
    lo = (d * sc_lo) * q_lo.to(tl.float32) - dmin * m_lo
    hi = (d * sc_hi) * q_hi.to(tl.float32) - dmin * m_hi
    e = (gg // 8) * 256 + c * 64 + (gb % 2) * 16 + i
    return lo, hi, e, e + 32


@triton.jit
def _q6_k(row, gg, i, mask):
    # 210 bytes: ql[128], qh[64], int8 scales[16], fp16 d. Half h = gb // 4 of the block (128
    # values) has ql bytes 64h.., qh bytes 32h..; lane jj of the half holds value jj (low
    # nibble) and jj + 64 (high nibble), their top two bits in qh[32h + jj % 32] at bits
    # 2 (jj // 32) and 4 + 2 (jj // 32); one int8 scale per 16 values.
    gb = gg % 8
    half = gb // 4
    gq = gb % 4
    blk = row + (gg // 8) * 210
    ql = tl.load(blk + gb * 16 + i, mask=mask, other=0).to(tl.int32)
    qh = tl.load(blk + 128 + half * 32 + (gq % 2) * 16 + i, mask=mask, other=0).to(tl.int32)
    shift = (gq // 2) * 2
    q_lo = ((ql & 15) | (((qh >> shift) & 3) << 4)) - 32
    q_hi = ((ql >> 4) | (((qh >> (shift + 4)) & 3) << 4)) - 32
    d = _fp16(blk + 208, mask)
    sc_lo = tl.load(blk + 192 + half * 8 + gq, mask=mask, other=0).to(tl.int8, bitcast=True)
    sc_hi = tl.load(blk + 196 + half * 8 + gq, mask=mask, other=0).to(tl.int8, bitcast=True)
    lo = (d * sc_lo.to(tl.float32)) * q_lo.to(tl.float32)
    hi = (d * sc_hi.to(tl.float32)) * q_hi.to(tl.float32)
    e = (gg // 8) * 256 + half * 128 + gq * 16 + i
    return lo, hi, e, e + 64


@triton.jit
def _e2m1x2(n):
    """Twice the e2m1 value of nibble n (bit 3 the sign): 0, 1, 2, 3, 4, 6, 8, 12."""
    m = n & 7
    v = tl.where(m < 2, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
    return tl.where(n >= 8, -v, v).to(tl.float32)


@triton.jit
def _mxfp4(row, gg, i, mask):
    # 17 bytes: E8M0 exponent x, qs[16]; lane i holds value i (low nibble) and i + 16 (high).
    # gguf doubles the e2m1 values and halves the scale: 2^(x - 128), built from its bits so
    # that x < 2 (denormal results) is exact too.
    blk = row + gg * 17
    x = tl.load(blk, mask=mask, other=0).to(tl.int32)
    scale = tl.where(x < 2, (x + 1) * 0x200000, (x - 1) << 23).to(tl.float32, bitcast=True)
    q = tl.load(blk + 1 + i, mask=mask, other=0).to(tl.int32)
    e = gg * 32 + i
    return scale * _e2m1x2(q & 15), scale * _e2m1x2(q >> 4), e, e + 16


@triton.jit
def _lanes(row, gg, i, mask, QT: tl.constexpr):
    """Values of lanes i of groups gg of the rows at row (uint8 pointers), masked loads.

    Shapes broadcast: row over rows, gg over groups, i over the 16 lanes. Returns lo, hi
    (fp32, the full broadcast shape) and their element indices in the row (no row axis).
    """
    if QT == "Q8_0":
        lo, hi, e_lo, e_hi = _q8_0(row, gg, i, mask)
    elif QT == "Q4_K":
        lo, hi, e_lo, e_hi = _q45_k(row, gg, i, mask, False)
    elif QT == "Q5_K":
        lo, hi, e_lo, e_hi = _q45_k(row, gg, i, mask, True)
    elif QT == "Q6_K":
        lo, hi, e_lo, e_hi = _q6_k(row, gg, i, mask)
    else:
        tl.static_assert(QT == "MXFP4", "moe_quant: unsupported qtype")
        lo, hi, e_lo, e_hi = _mxfp4(row, gg, i, mask)
    return lo, hi, e_lo, e_hi


WORD_BYTES = {"Q4_K": 4, "Q5_K": 4, "Q8_0": 2, "Q6_K": 2}  # the widest load of a block's head (_words, _fp16)


@triton.jit
def _rows_at(base, offs, stride, QT: tl.constexpr):
    """base + offs * stride (offs [*, 1, 1] or [1, 1, *], int64 offsets): rows of QT blocks. Q8_0's and Q6_K's
    are marked 2-byte aligned (check_words ensures it), so that their lanes load two bytes at a time where the
    compiler cannot know it from the stride (Q4_K_M's Q6_K down rows of 3 or 6 blocks, 630 and 1260 bytes)."""
    rows = base + offs.to(tl.int64) * stride
    if QT == "Q8_0" or QT == "Q6_K":
        rows = tl.multiple_of(rows, [2, 2, 2])
    return rows


def check_words(q: torch.Tensor, qtype: str) -> None:
    """Q4_K and Q5_K blocks' heads load as int32 words (_words), Q8_0's and Q6_K's scale as one fp16 (_fp16): q's
    start and row strides must be multiples of WORD_BYTES[qtype]. Every pool and weight the engine allocates is;
    a view at an odd byte offset is not."""
    align = WORD_BYTES.get(qtype, 1)
    if q.data_ptr() % align or any(s % align for s in q.stride()[:-1]):
        raise ValueError(f"moe_quant: {qtype} rows must start on {align}-byte boundaries (start {q.data_ptr()}, "
                         f"strides {tuple(q.stride())})")


@triton.jit(do_not_specialize=["M"])
def _dequant_kernel(q_ptr, out_ptr, M, n, stride_q, stride_o,
                    QT: tl.constexpr, BLOCK_R: tl.constexpr, GROUPS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None, None]
    gg = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)[None, :, None]
    i = tl.arange(0, LANES)[None, None, :]
    mask = (rows < M) & (gg < n // 32)
    lo, hi, e_lo, e_hi = _lanes(_rows_at(q_ptr, rows, stride_q, QT), gg, i, mask, QT)
    out_row = out_ptr + rows.to(tl.int64) * stride_o
    tl.store(out_row + e_lo, lo, mask=mask)
    tl.store(out_row + e_hi, hi, mask=mask)


def dequantize_rows(q: torch.Tensor, qtype: str, n: int, block_r: int = 16, groups: int = 8,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 q[M, row_bytes(qtype, n)] (unit last stride) -> float32 [M, n] on q's device, or into
    `out` [M, n] (unit last stride; its dtype's rounding of the fp32 values)."""
    check_words(q, qtype)
    M = q.shape[0]
    out = torch.empty(M, n, dtype=torch.float32, device=q.device) if out is None else out
    grid = (triton.cdiv(M, block_r), triton.cdiv(n // 32, groups))
    _dequant_kernel[grid](q, out, M, n, q.stride(0), out.stride(0), QT=qtype, BLOCK_R=block_r,
                          GROUPS=groups)
    return out


@triton.jit
def _decode_w13_kernel(x_ptr, slots_ptr, w13_ptr, h_ptr, b13_ptr, zero_lo, zero_hi, K, D, F,
                       stride_xt, stride_ws, stride_wr, ALPHA, LIMIT,
                       QT: tl.constexpr, BLOCK_F: tl.constexpr, GROUPS: tl.constexpr,
                       NUM_STAGES: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    route = tl.program_id(0)
    pid_f = tl.program_id(1)
    s = tl.load(slots_ptr + route)
    if (s >= zero_lo) & (s < zero_hi):
        return  # h of this route is never read: _decode_w2_kernel skips it too
    t = route // K
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_f = (offs_f < F)[:, None, None]
    expert = w13_ptr + s.to(tl.int64) * stride_ws
    gate_rows = _rows_at(expert, offs_f[:, None, None], stride_wr, QT)  # [BLOCK_F, 1, 1]
    up_rows = _rows_at(expert, offs_f[:, None, None] + F, stride_wr, QT)
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    groups = tl.arange(0, GROUPS)[None, :, None]
    i = tl.arange(0, LANES)[None, None, :]
    num_groups = D // 32
    acc_g = tl.zeros([BLOCK_F, GROUPS, LANES], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_F, GROUPS, LANES], dtype=tl.float32)
    for g0 in tl.range(0, num_groups, GROUPS, num_stages=NUM_STAGES):
        gg = g0 + groups
        ok = gg < num_groups
        mask = mask_f & ok
        g_lo, g_hi, e_lo, e_hi = _lanes(gate_rows, gg, i, mask, QT)
        u_lo, u_hi, _, _ = _lanes(up_rows, gg, i, mask, QT)
        x_lo = tl.load(x_row + e_lo, mask=ok, other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + e_hi, mask=ok, other=0.0).to(tl.float32)
        acc_g += g_lo * x_lo + g_hi * x_hi
        acc_u += u_lo * x_lo + u_hi * x_hi
    gate = tl.sum(tl.sum(acc_g, axis=2), axis=1)
    up = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    if HAS_BIAS:  # b13[N, 2F] fp32: gate biases, then up
        bias_row = b13_ptr + s.to(tl.int64) * 2 * F + offs_f
        gate += tl.load(bias_row, mask=offs_f < F, other=0.0)
        up += tl.load(bias_row + F, mask=offs_f < F, other=0.0)
    h = activate(gate, up, ACT, ALPHA, LIMIT)
    tl.store(h_ptr + route.to(tl.int64) * F + offs_f, h.to(h_ptr.dtype.element_ty),
             mask=offs_f < F)


@triton.jit
def _decode_w2_kernel(h_ptr, slots_ptr, weights_ptr, w2_ptr, out_ptr, b2_ptr, zero_lo, zero_hi, K, D, F,
                      stride_ws, stride_wr, stride_ot,
                      QT: tl.constexpr, KP: tl.constexpr, BLOCK_D: tl.constexpr,
                      GROUPS: tl.constexpr, NUM_STAGES: tl.constexpr, HAS_BIAS: tl.constexpr):
    # Tile rows are (k, d) pairs, k-major: all K routes of the token at once, as moe_decode.
    t = tl.program_id(0)
    pid_d = tl.program_id(1)
    r = tl.arange(0, KP * BLOCK_D)
    k = r // BLOCK_D
    d = pid_d * BLOCK_D + r % BLOCK_D
    route = t * K + k
    s = tl.load(slots_ptr + route, mask=k < K, other=zero_lo)
    live = (k < K) & ((s < zero_lo) | (s >= zero_hi)) & (d < D)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    out_row = out_ptr + t.to(tl.int64) * stride_ot + offs_d
    if tl.sum(live.to(tl.int32), axis=0) == 0:
        tl.store(out_row, tl.zeros([BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=offs_d < D)
        return
    rows = _rows_at((w2_ptr + s.to(tl.int64) * stride_ws)[:, None, None], d[:, None, None], stride_wr, QT)
    h_rows = (h_ptr + route.to(tl.int64) * F)[:, None, None]
    live3 = live[:, None, None]
    groups = tl.arange(0, GROUPS)[None, :, None]
    i = tl.arange(0, LANES)[None, None, :]
    num_groups = F // 32
    acc = tl.zeros([KP * BLOCK_D, GROUPS, LANES], dtype=tl.float32)
    for g0 in tl.range(0, num_groups, GROUPS, num_stages=NUM_STAGES):
        gg = g0 + groups
        mask = live3 & (gg < num_groups)
        w_lo, w_hi, e_lo, e_hi = _lanes(rows, gg, i, mask, QT)
        h_lo = tl.load(h_rows + e_lo, mask=mask, other=0.0).to(tl.float32)
        h_hi = tl.load(h_rows + e_hi, mask=mask, other=0.0).to(tl.float32)
        acc += w_lo * h_lo + w_hi * h_hi
    part = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:  # b2[N, D] fp32, of the live rows only, before the routing weight
        part += tl.load(b2_ptr + s.to(tl.int64) * D + d, mask=live, other=0.0)
    part = part * tl.load(weights_ptr + route, mask=live, other=0.0)
    y = tl.sum(tl.reshape(part, (KP, BLOCK_D)), axis=0)
    tl.store(out_row, y.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def decode_forward(x, slots, weights, w13_pool, w2_pool, qtypes, zero_lo, zero_hi, out,
                   cfg_w13, cfg_w2, epi):
    """x[T, D] (contiguous), slots[T, K] int32, weights[T, K] f32 (contiguous) -> out[T, D].

    qtypes = (qtype of w13, qtype of w2); h is rounded to x's dtype, as prefill's; epi: the
    activation and optional bias pools (gpu_experts.Epilogue).
    """
    T, K = slots.shape
    D = x.shape[1]
    F = w13_pool.shape[1] // 2
    check_words(w13_pool, qtypes[0])
    check_words(w2_pool, qtypes[1])
    e = epi.kernel_args(x)
    h = torch.empty(T * K, F, dtype=x.dtype, device=x.device)  # [R, F]
    grid = (T * K, triton.cdiv(F, cfg_w13["BLOCK_F"]))
    _decode_w13_kernel[grid](x, slots, w13_pool, h, e["b13_ptr"], zero_lo, zero_hi, K, D, F,
                             x.stride(0), w13_pool.stride(0), w13_pool.stride(1), e["ALPHA"], e["LIMIT"],
                             QT=qtypes[0], BLOCK_F=cfg_w13["BLOCK_F"], GROUPS=cfg_w13["GROUPS"],
                             NUM_STAGES=cfg_w13["num_stages"], HAS_BIAS=e["HAS_BIAS"], ACT=e["ACT"],
                             num_warps=cfg_w13["num_warps"])
    grid = (T, triton.cdiv(D, cfg_w2["BLOCK_D"]))
    _decode_w2_kernel[grid](h, slots, weights, w2_pool, out, e["b2_ptr"], zero_lo, zero_hi, K, D, F,
                            w2_pool.stride(0), w2_pool.stride(1), out.stride(0),
                            QT=qtypes[1], KP=triton.next_power_of_2(K), BLOCK_D=cfg_w2["BLOCK_D"],
                            GROUPS=cfg_w2["GROUPS"], NUM_STAGES=cfg_w2["num_stages"],
                            HAS_BIAS=e["HAS_BIAS"], num_warps=cfg_w2["num_warps"])
    return out


@triton.jit
def _b_tiles(rows, gg, i, mask, QT: tl.constexpr, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr):
    """tl.dot's B operands [G*16, BLOCK_N] (lo and hi values, fp32) and their element indices."""
    lo, hi, e_lo, e_hi = _lanes(rows, gg, i, mask, QT)  # [G, 16, BLOCK_N], [G, 16, 1]
    b_lo = tl.reshape(lo, (GROUPS * LANES, BLOCK_N))
    b_hi = tl.reshape(hi, (GROUPS * LANES, BLOCK_N))
    # A group's 16 element indices are consecutive from a multiple of 16 in every format; said so, the
    # activations' gathers become vector loads (the reshape hides it from the compiler)
    e_lo = tl.max_contiguous(tl.multiple_of(tl.reshape(e_lo, (GROUPS * LANES,)), LANES), LANES)
    e_hi = tl.max_contiguous(tl.multiple_of(tl.reshape(e_hi, (GROUPS * LANES,)), LANES), LANES)
    return b_lo, b_hi, e_lo, e_hi


@triton.jit(do_not_specialize=["R"])
def _prefill_w13_kernel(x_ptr, w13_ptr, h_ptr, sorted_routes_ptr, block_slots_ptr, num_padded_ptr, b13_ptr,
                        R, K, D, F, stride_xt, stride_ws, stride_wr, ALPHA, LIMIT,
                        QT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        GROUPS: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
                        ACT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    s = tl.load(block_slots_ptr + pid_m)
    if s < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    routes = tl.load(sorted_routes_ptr + offs_m)
    valid = routes < R
    x_rows = x_ptr + (routes // K).to(tl.int64)[:, None] * stride_xt  # [BLOCK_M, 1]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = (offs_n < F)[None, None, :]
    # weight tiles [G, 16, BLOCK_N]: lanes down, rows across (the orientation of B)
    expert = w13_ptr + s.to(tl.int64) * stride_ws
    gate_rows = _rows_at(expert, offs_n[None, None, :], stride_wr, QT)
    up_rows = _rows_at(expert, offs_n[None, None, :] + F, stride_wr, QT)
    groups = tl.arange(0, GROUPS)[:, None, None]
    i = tl.arange(0, LANES)[None, :, None]
    num_groups = D // 32
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dtype = x_ptr.dtype.element_ty
    for g0 in range(0, num_groups, GROUPS):
        gg = g0 + groups
        mask = (gg < num_groups) & mask_n
        # gate's tiles, then up's: fewer dequantized tiles live at once (registers)
        b_lo, b_hi, e_lo, e_hi = _b_tiles(gate_rows, gg, i, mask, QT, GROUPS, BLOCK_N)
        a_mask = valid[:, None] & (e_lo < D)[None, :]
        a_lo = tl.load(x_rows + e_lo[None, :], mask=a_mask, other=0.0)
        a_hi = tl.load(x_rows + e_hi[None, :], mask=a_mask, other=0.0)
        acc_g = tl.dot(a_lo, b_lo.to(dtype), acc_g, input_precision=PRECISION)
        acc_g = tl.dot(a_hi, b_hi.to(dtype), acc_g, input_precision=PRECISION)
        b_lo, b_hi, _, _ = _b_tiles(up_rows, gg, i, mask, QT, GROUPS, BLOCK_N)
        acc_u = tl.dot(a_lo, b_lo.to(dtype), acc_u, input_precision=PRECISION)
        acc_u = tl.dot(a_hi, b_hi.to(dtype), acc_u, input_precision=PRECISION)
    if HAS_BIAS:  # b13[N, 2F] fp32: a column's gate and up biases
        bias_row = b13_ptr + s.to(tl.int64) * 2 * F + offs_n
        acc_g += tl.load(bias_row, mask=offs_n < F, other=0.0)[None, :]
        acc_u += tl.load(bias_row + F, mask=offs_n < F, other=0.0)[None, :]
    h = activate(acc_g, acc_u, ACT, ALPHA, LIMIT)
    h_ptrs = h_ptr + routes.to(tl.int64)[:, None] * F + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n < F)[None, :])


@triton.jit(do_not_specialize=["R"])
def _prefill_w2_kernel(h_ptr, w2_ptr, y_ptr, weights_ptr, sorted_routes_ptr, block_slots_ptr,
                       num_padded_ptr, b2_ptr, R, D, F, stride_ws, stride_wr,
                       QT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       GROUPS: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    s = tl.load(block_slots_ptr + pid_m)
    if s < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    routes = tl.load(sorted_routes_ptr + offs_m)
    valid = routes < R
    h_rows = h_ptr + routes.to(tl.int64)[:, None] * F  # [BLOCK_M, 1]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = (offs_n < D)[None, None, :]
    rows = _rows_at(w2_ptr + s.to(tl.int64) * stride_ws, offs_n[None, None, :], stride_wr, QT)
    groups = tl.arange(0, GROUPS)[:, None, None]
    i = tl.arange(0, LANES)[None, :, None]
    num_groups = F // 32
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dtype = h_ptr.dtype.element_ty
    for g0 in range(0, num_groups, GROUPS):
        gg = g0 + groups
        mask = (gg < num_groups) & mask_n
        b_lo, b_hi, e_lo, e_hi = _b_tiles(rows, gg, i, mask, QT, GROUPS, BLOCK_N)
        a_mask = valid[:, None] & (e_lo < F)[None, :]
        a_lo = tl.load(h_rows + e_lo[None, :], mask=a_mask, other=0.0)
        a_hi = tl.load(h_rows + e_hi[None, :], mask=a_mask, other=0.0)
        acc = tl.dot(a_lo, b_lo.to(dtype), acc, input_precision=PRECISION)
        acc = tl.dot(a_hi, b_hi.to(dtype), acc, input_precision=PRECISION)
    if HAS_BIAS:  # b2[N, D] fp32, before the routing weight
        acc += tl.load(b2_ptr + s.to(tl.int64) * D + offs_n, mask=offs_n < D, other=0.0)[None, :]
    acc *= tl.load(weights_ptr + routes, mask=valid, other=0.0)[:, None]
    y_ptrs = y_ptr + routes.to(tl.int64)[:, None] * D + offs_n[None, :]
    tl.store(y_ptrs, acc, mask=valid[:, None] & (offs_n < D)[None, :])


def prefill_forward(x, slots, weights, w13_pool, w2_pool, qtypes, zero_lo, zero_hi, out, aligned,
                    cfg, cfg_combine, epi):
    """x[T, D], slots[T, K] int32, weights[T, K] f32 (contiguous), aligned routes -> out[T, D].

    aligned: (sorted_routes, block_slots, num_padded) from moe_prefill.align_forward or
    gpu_experts.align_routes with cfg["BLOCK_M"]. h[R, F] is kept in x's dtype. epi: the
    activation and optional bias pools (gpu_experts.Epilogue).
    """
    T, K = slots.shape
    R = T * K
    D = x.shape[1]
    F = w13_pool.shape[1] // 2
    sorted_routes, block_slots, num_padded = aligned
    check_words(w13_pool, qtypes[0])
    check_words(w2_pool, qtypes[1])
    num_blocks = block_slots.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else None  # fp32 tests: no tf32 rounding
    tiles = {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "GROUPS": cfg["GROUPS"],
             "PRECISION": precision, "num_warps": cfg["num_warps"],
             "num_stages": cfg["num_stages"]}
    e = epi.kernel_args(x)
    h = torch.empty(R, F, dtype=x.dtype, device=x.device)  # [R, F]
    y = torch.empty(R, D, dtype=torch.float32, device=x.device)  # [R, D]
    grid = (num_blocks, triton.cdiv(F, cfg["BLOCK_N"]))
    _prefill_w13_kernel[grid](x, w13_pool, h, sorted_routes, block_slots, num_padded, e["b13_ptr"], R, K, D, F,
                              x.stride(0), w13_pool.stride(0), w13_pool.stride(1), e["ALPHA"], e["LIMIT"],
                              QT=qtypes[0], HAS_BIAS=e["HAS_BIAS"], ACT=e["ACT"], **tiles)
    grid = (num_blocks, triton.cdiv(D, cfg["BLOCK_N"]))
    _prefill_w2_kernel[grid](h, w2_pool, y, weights, sorted_routes, block_slots, num_padded, e["b2_ptr"], R, D,
                             F, w2_pool.stride(0), w2_pool.stride(1), QT=qtypes[1], HAS_BIAS=e["HAS_BIAS"],
                             **tiles)
    return combine_forward(y, slots, out, zero_lo, zero_hi, cfg_combine)
