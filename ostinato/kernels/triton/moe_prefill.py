"""Prefill kernels: grouped GEMMs over routes sorted by pool slot.

Legend: T tokens, K routes per token, D hidden size, F expert FFN size, N pool slots,
R = T*K routes, P padded positions, B = P / BLOCK_M route blocks (one slot each).
Pools: w13[N, 2F, D] (gate rows then up rows), w2[N, D, F].

Alignment (align_forward, or gpu_experts.align_routes in torch ops): hot routes sorted
stably by slot, each slot's group padded to a multiple of BLOCK_M: sorted_routes[P]
(route id t*K+k, R for padding), block_slots[B], num_padded[1]. Shapes depend on T, K
and the pool size only, so the grid is fixed; programs past num_padded (device-side) or
on a block outside the call's slot window (all slots, or a chunk's: expert_gemms) return at once.
- _align_count_kernel, grid (R/CHUNK): per-chunk slot histograms hist[R/CHUNK, NB].
- _align_scan_kernel, one program: prefixes over chunks and over slots.
- _align_scatter_kernel, grid (R/SUB): each route's padded position and block slots.
A fill and three launches instead of the ~20 small torch ops of align_routes, which
cost 70-110 us of GPU time per call in a graph and 400-800 us eager on an H200. The
scatter's in-chunk rank is quadratic in CHUNK (33 us at CHUNK=1024, 4 us at 256).
- _w13_kernel, grid (B, F/BLOCK_N): gathers x rows of a block's routes and multiplies
  them by the gate and the up rows of its slot; act(gate + b, up + b) in the epilogue
  (silu(gate) * up, or gpu_experts.Epilogue's biases and activation), stored to h[R, F] by
  route id (pool dtype, the operand of the second tl.dot).
- _w2_kernel, grid (B, D/BLOCK_N): h rows @ w2[slot]^T (+ the down bias), times the routing
  weight, stored in fp32 to y[R, D] by route id.
- _combine_kernel, grid (T, D/BLOCK_D): out[t] = sum of y[t*K + k] over hot k in the
  order k = 0..K-1 (deterministic, no atomics); zero-slot rows of y are never read.
Slot offsets are int64: N * 2F * D exceeds 2^31 elements for real pools.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.kernels.triton.expert_act import activate


@triton.jit(do_not_specialize=["R"])
def _align_count_kernel(slots_ptr, hist_ptr, zero_lo, zero_hi, R,
                        NUM_BINS: tl.constexpr, CHUNK: tl.constexpr):
    # hist[c, s] = hot routes of chunk c on slot s. Integer atomics: exact, order-free.
    c = tl.program_id(0)
    row = hist_ptr + c * NUM_BINS
    bins = tl.arange(0, NUM_BINS)
    tl.store(row + bins, tl.zeros([NUM_BINS], dtype=tl.int32))
    tl.debug_barrier()  # the zeros land before any thread of this program adds
    offs = c * CHUNK + tl.arange(0, CHUNK)
    s = tl.load(slots_ptr + offs, mask=offs < R, other=0)
    hot = (offs < R) & ((s < zero_lo) | (s >= zero_hi))
    tl.atomic_add(row + s, tl.full([CHUNK], 1, tl.int32), mask=hot, sem="relaxed")


@triton.jit(do_not_specialize=["num_chunks"])
def _align_scan_kernel(hist_ptr, starts_ptr, num_padded_ptr, num_chunks,
                       NUM_BINS: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr):
    # One program: hist rows become exclusive prefixes over chunks (ROWS rows a step, to
    # shorten the chain of dependent loads); slot groups, padded to BLOCK_M, are laid out
    # in slot order from starts[s].
    bins = tl.arange(0, NUM_BINS)
    count = tl.zeros([NUM_BINS], dtype=tl.int32)
    for c0 in range(0, num_chunks, ROWS):
        rows = c0 + tl.arange(0, ROWS)
        ptrs = hist_ptr + rows[:, None] * NUM_BINS + bins[None, :]
        mask = (rows < num_chunks)[:, None]
        h = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(h, 0) - h + count[None, :], mask=mask)
        count += tl.sum(h, 0)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(starts_ptr + bins, tl.cumsum(padded, 0) - padded)
    tl.store(num_padded_ptr, tl.sum(padded, 0).to(tl.int64))


@triton.jit(do_not_specialize=["R", "size"])
def _align_scatter_kernel(slots_ptr, hist_ptr, starts_ptr, sorted_routes_ptr, block_slots_ptr,
                          zero_lo, zero_hi, R, size, NUM_BINS: tl.constexpr, CHUNK: tl.constexpr,
                          SUB: tl.constexpr, TILE: tl.constexpr, BLOCK_M: tl.constexpr):
    # Route r goes to starts[s] + (earlier chunks' routes on s) + (earlier routes of its
    # own chunk on s): the stable order by (slot, route id), so the layout is deterministic.
    # The first route of each BLOCK_M block names the block's slot.
    pid = tl.program_id(0)
    c = pid // (CHUNK // SUB)
    offs = pid * SUB + tl.arange(0, SUB)
    s = tl.load(slots_ptr + offs, mask=offs < R, other=0)
    hot = (offs < R) & ((s < zero_lo) | (s >= zero_hi))
    rank = tl.load(hist_ptr + c * NUM_BINS + s, mask=hot, other=0)
    for j0 in range(c * CHUNK, pid * SUB + SUB, TILE):
        offs_j = j0 + tl.arange(0, TILE)
        s_j = tl.load(slots_ptr + offs_j, mask=offs_j < R, other=0)
        hot_j = (offs_j < R) & ((s_j < zero_lo) | (s_j >= zero_hi))
        same = (s[:, None] == s_j[None, :]) & hot_j[None, :] & (offs_j[None, :] < offs[:, None])
        rank += tl.sum(same.to(tl.int32), axis=1)
    dest = tl.load(starts_ptr + s, mask=hot, other=0) + rank
    # Positions past size only occur when a call breaks its max_distinct promise: dropped.
    ok = hot & (dest < size)
    tl.store(sorted_routes_ptr + dest, offs, mask=ok)
    tl.store(block_slots_ptr + dest // BLOCK_M, s, mask=ok & (rank % BLOCK_M == 0))


def align_forward(slots, zero_lo, zero_hi, num_slots, block_m, size, cfg):
    """Triton counterpart of gpu_experts.align_routes: three launches, no host sync.

    slots[T, K] int32 -> sorted_routes[size] int32, block_slots[size / block_m] int32,
    num_padded[1] int64. Entries past num_padded are left unwritten: no kernel reads them.
    """
    flat = slots.reshape(-1)
    R = flat.numel()
    device = flat.device
    chunk, sub = cfg["CHUNK"], cfg["SUB"]
    num_bins = triton.next_power_of_2(num_slots)
    num_chunks = triton.cdiv(R, chunk)
    hist = torch.empty(num_chunks, num_bins, dtype=torch.int32, device=device)
    starts = torch.empty(num_bins, dtype=torch.int32, device=device)
    sorted_routes = torch.full((size,), R, dtype=torch.int32, device=device)  # R: padding
    block_slots = torch.empty(size // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int64, device=device)
    _align_count_kernel[(num_chunks,)](flat, hist, zero_lo, zero_hi, R, NUM_BINS=num_bins,
                                       CHUNK=chunk, num_warps=cfg["num_warps"])
    _align_scan_kernel[(1,)](hist, starts, num_padded, num_chunks, NUM_BINS=num_bins,
                             BLOCK_M=block_m, ROWS=cfg["ROWS"], num_warps=cfg["scan_warps"])
    _align_scatter_kernel[(num_chunks * (chunk // sub),)](
        flat, hist, starts, sorted_routes, block_slots, zero_lo, zero_hi, R, size,
        NUM_BINS=num_bins, CHUNK=chunk, SUB=sub, TILE=cfg["TILE"], BLOCK_M=block_m,
        num_warps=cfg["num_warps"])
    return sorted_routes, block_slots, num_padded


@triton.jit(do_not_specialize=["R", "slot_lo", "slot_hi"])
def _w13_kernel(x_ptr, w13_ptr, h_ptr, sorted_routes_ptr, block_slots_ptr, num_padded_ptr, b13_ptr,
                R, K, D, F, slot_lo, slot_hi, stride_xt, stride_we, stride_wf, stride_wd, ALPHA, LIMIT,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    s = tl.load(block_slots_ptr + pid_m)
    if (s < slot_lo) | (s >= slot_hi):  # another window's block (a chunked call)
        return
    s -= slot_lo
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    routes = tl.load(sorted_routes_ptr + offs_m)
    valid = routes < R
    tokens = (routes // K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < F
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    bg_ptrs = (w13_ptr + s.to(tl.int64) * stride_we
               + offs_k[:, None] * stride_wd + offs_n[None, :] * stride_wf)
    bu_ptrs = bg_ptrs + F * stride_wf
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        mask_k = offs_k < D - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        b_mask = mask_k[:, None] & mask_n[None, :]
        bg = tl.load(bg_ptrs, mask=b_mask, other=0.0)
        bu = tl.load(bu_ptrs, mask=b_mask, other=0.0)
        acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        bg_ptrs += BLOCK_K * stride_wd
        bu_ptrs += BLOCK_K * stride_wd
    if HAS_BIAS:  # b13[N, 2F] fp32: a column's gate and up biases
        bias_row = b13_ptr + s.to(tl.int64) * 2 * F + offs_n
        acc_g += tl.load(bias_row, mask=mask_n, other=0.0)[None, :]
        acc_u += tl.load(bias_row + F, mask=mask_n, other=0.0)[None, :]
    h = activate(acc_g, acc_u, ACT, ALPHA, LIMIT)
    h_ptrs = h_ptr + routes.to(tl.int64)[:, None] * F + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["R", "slot_lo", "slot_hi"])
def _w2_kernel(h_ptr, w2_ptr, y_ptr, weights_ptr, sorted_routes_ptr, block_slots_ptr,
               num_padded_ptr, b2_ptr, R, D, F, slot_lo, slot_hi, stride_we, stride_wd, stride_wf,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    s = tl.load(block_slots_ptr + pid_m)
    if (s < slot_lo) | (s >= slot_hi):  # another window's block (a chunked call)
        return
    s -= slot_lo
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    routes = tl.load(sorted_routes_ptr + offs_m)
    valid = routes < R
    rows = routes.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * F + offs_k[None, :]
    b_ptrs = (w2_ptr + s.to(tl.int64) * stride_we
              + offs_k[:, None] * stride_wf + offs_n[None, :] * stride_wd)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        mask_k = offs_k < F - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wf
    if HAS_BIAS:  # b2[N, D] fp32, before the routing weight
        acc += tl.load(b2_ptr + s.to(tl.int64) * D + offs_n, mask=mask_n, other=0.0)[None, :]
    acc *= tl.load(weights_ptr + routes, mask=valid, other=0.0)[:, None]
    y_ptrs = y_ptr + rows[:, None] * D + offs_n[None, :]
    tl.store(y_ptrs, acc, mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _combine_kernel(y_ptr, slots_ptr, out_ptr, zero_lo, zero_hi, K, D, stride_ot,
                    BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in range(K):
        route = t * K + k
        s = tl.load(slots_ptr + route)
        if (s < zero_lo) | (s >= zero_hi):
            acc += tl.load(y_ptr + route.to(tl.int64) * D + offs_d, mask=mask_d, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_d, acc.to(out_ptr.dtype.element_ty),
             mask=mask_d)


def expert_gemms(x, w13_pool, w2_pool, weights, aligned, h, y, cfg, epi, window=None):
    """The two grouped GEMMs of aligned routes: h[R, F] = act(x w13^T) and y[R, D] = weights * (h w2^T),
    in place, route by route. window (lo, hi): only the blocks of slots lo..hi-1, whose experts sit at
    lo..hi-1 - lo of the pools (a chunk of a larger set: gpu_quant's dequantized path); None: all."""
    R, F = h.shape
    K = R // x.shape[0]
    D = x.shape[1]
    sorted_routes, block_slots, num_padded = aligned
    num_blocks = block_slots.shape[0]
    lo, hi = window or (0, w13_pool.shape[0])
    precision = "ieee" if x.dtype == torch.float32 else None  # fp32 tests: no tf32 rounding
    tiles = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                 PRECISION=precision, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    e = epi.kernel_args(x)
    grid = (num_blocks, triton.cdiv(F, cfg["BLOCK_N"]))
    _w13_kernel[grid](x, w13_pool, h, sorted_routes, block_slots, num_padded, e["b13_ptr"], R, K, D, F, lo, hi,
                      x.stride(0), w13_pool.stride(0), w13_pool.stride(1), w13_pool.stride(2),
                      e["ALPHA"], e["LIMIT"], HAS_BIAS=e["HAS_BIAS"], ACT=e["ACT"], **tiles)
    grid = (num_blocks, triton.cdiv(D, cfg["BLOCK_N"]))
    _w2_kernel[grid](h, w2_pool, y, weights, sorted_routes, block_slots, num_padded, e["b2_ptr"], R, D, F, lo, hi,
                     w2_pool.stride(0), w2_pool.stride(1), w2_pool.stride(2), HAS_BIAS=e["HAS_BIAS"], **tiles)


def combine_forward(y, slots, out, zero_lo, zero_hi, cfg_combine):
    """out[t] = the sum of y[t*K + k] over t's hot routes, k = 0..K-1 (_combine_kernel)."""
    T, K = slots.shape
    D = y.shape[1]
    grid = (T, triton.cdiv(D, cfg_combine["BLOCK_D"]))
    _combine_kernel[grid](y, slots, out, zero_lo, zero_hi, K, D, out.stride(0),
                          BLOCK_D=cfg_combine["BLOCK_D"], num_warps=cfg_combine["num_warps"])
    return out


def prefill_forward(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi, out, aligned, cfg,
                    cfg_combine, epi):
    """x[T, D], slots[T, K] int32, weights[T, K] f32 (contiguous), aligned routes -> out[T, D];
    epi: the activation and optional bias pools (gpu_experts.Epilogue)."""
    R = slots.numel()
    h = torch.empty(R, w2_pool.shape[2], dtype=w13_pool.dtype, device=x.device)  # [R, F]
    y = torch.empty(R, x.shape[1], dtype=torch.float32, device=x.device)  # [R, D]
    expert_gemms(x, w13_pool, w2_pool, weights, aligned, h, y, cfg, epi)
    return combine_forward(y, slots, out, zero_lo, zero_hi, cfg_combine)
