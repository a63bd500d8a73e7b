"""The staging kernels of a captured prefill pass (layers/moe/staging.py): the rule in one launch
(`plan_experts`), and the copy: each staged expert's bytes from
its row of a layer's page-locked host stack, read by the kernel through its UVA address, into its flex
slot of a pool tensor. A kernel reads host memory at 51 GB/s on an H100, 92-94% of a memcpy's pace
(scripts/bench_zero_copy.py, results/2026-12-06-h100-s39/), and it needs no host decision: which
experts, and where, come from the device (staging.plan).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 8192  # bytes a program copies a step
STEPS = 8  # steps of a program, at most: an expert's tensor gets cdiv(bytes, CHUNK * STEPS) programs


@triton.jit
def _stage_kernel(src, dst, rows_ptr, pick_ptr, rank_ptr, flex_lo,
                  NBYTES: tl.constexpr, CHUNK: tl.constexpr, STEPS: tl.constexpr):
    """Program (e, p): if expert e is staged, the steps p, p + P, ... of CHUNK bytes of its NBYTES
    from row rows[e] of src to row flex_lo + rank[e] of dst."""
    e = tl.program_id(0)
    if tl.load(pick_ptr + e) == 0:
        return
    row = tl.load(rows_ptr + e).to(tl.int64)
    slot = (tl.load(rank_ptr + e) + flex_lo).to(tl.int64)
    P = tl.num_programs(1)
    for i in range(STEPS):
        o = (tl.program_id(1) + i * P).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        m = o < NBYTES
        tl.store(dst + slot * NBYTES + o, tl.load(src + row * NBYTES + o, mask=m), mask=m)


def copy_experts(src, dst: torch.Tensor, rows: torch.Tensor, pick: torch.Tensor, rank: torch.Tensor,
                 flex_lo: int, programs: int | None = None, chunk: int | None = None) -> None:
    """dst [slots, bytes] uint8: row flex_lo + rank[e] gets row rows[e] of src, for each e with pick[e];
    src: the host stack's bytes [rows, bytes] (a HostPointer on CUDA, a tensor under the interpreter);
    rows, rank [E] int32, pick [E] bool. One launch, no host sync: capturable.
    programs: on that many programs of `chunk`-byte steps (a power of two, default FEW_CHUNK), for copies
    beside other work (a next layer's prefetch, layers/moe/staging.py: OSTINATO_PREFETCH_PROGRAMS); None:
    the default grid, a program per 64 KiB of every expert. In session 53's replay the prefetch on the
    default grid and the copy stream made a captured pass's worker wait about 1.2 ms longer a layer for 12
    experts, more than their copy takes at 51 GB/s (0.7 ms; results/2026-12-07-h100-s53/); on 64 programs
    and a stream of its own, 1.8 ms longer in a whole 253-token turn (results/2026-12-07-h100-s54/).
    Which of the two changes did it, and the few programs' pace over PCIe, are for
    scripts/bench_stage_copy.py to measure."""
    nbytes = dst.shape[1]
    if programs is not None:
        chunk = chunk or FEW_CHUNK
        chunks = triton.cdiv(nbytes, chunk)
        _stage_few_kernel[(min(programs, chunks),)](src, dst, rows, pick, rank, flex_lo, pick.shape[0],
                                                    NBYTES=nbytes, CHUNK=chunk, CHUNKS=chunks)
        return
    _stage_kernel[(pick.shape[0], triton.cdiv(nbytes, CHUNK * STEPS))](src, dst, rows, pick, rank, flex_lo,
                                                                       NBYTES=nbytes, CHUNK=CHUNK, STEPS=STEPS)


@triton.jit
def _stage_few_kernel(src, dst, rows_ptr, pick_ptr, rank_ptr, flex_lo, E,
                      NBYTES: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """Program p: for each staged expert e in turn, its chunks p, p + P, ... of CHUNK bytes (of NBYTES,
    CHUNKS of them) from row rows[e] of src to row flex_lo + rank[e] of dst."""
    p = tl.program_id(0)
    P = tl.num_programs(0)
    for e in range(E):
        if tl.load(pick_ptr + e) != 0:
            row = tl.load(rows_ptr + e).to(tl.int64)
            slot = (tl.load(rank_ptr + e) + flex_lo).to(tl.int64)
            for c in range(p, CHUNKS, P):
                o = c * CHUNK + tl.arange(0, CHUNK)  # within one expert's NBYTES: int32 will do
                m = o < NBYTES
                tl.store(dst + slot * NBYTES + o, tl.load(src + row * NBYTES + o, mask=m), mask=m)


FEW_CHUNK = 16384  # bytes a program copies a step on a few programs: 64 of them keep 1 MiB in flight


@triton.jit(do_not_specialize=["R", "cap", "flex_lo", "min_routes"])
def _plan_kernel(ids_ptr, count_ptr, table_ptr, routes_ptr, row_ptr, pick_ptr, rank_ptr, bytes_ptr,
                 expert_bytes, cap, flex_lo, min_routes, upload, alpha, per_expert, per_route, R,
                 K: tl.constexpr, E: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr, BALANCE: tl.constexpr, MEAN: tl.constexpr):
    """One program: layers/moe/staging.py plan's rule over ids [R] (R = B K, row-major) of a pass whose
    first count rows are real, table [E] int32 -> routes [E] int32 (the cold experts' routes, scratch),
    row [E] int32, pick [E] uint8, rank [E] int32; bytes [1] int64 += the staged experts' bytes."""
    e = tl.arange(0, BLOCK_E)
    in_e = e < E
    n_real = tl.load(count_ptr) * K
    routes = tl.zeros([BLOCK_E], dtype=tl.int32)
    for r0 in range(0, R, BLOCK_R):  # the histogram of the real rows' routes, a block of routes at a time
        r = r0 + tl.arange(0, BLOCK_R)
        ids = tl.load(ids_ptr + r, mask=(r < R) & (r < n_real), other=-1).to(tl.int32)
        routes += tl.sum((ids[None, :] == e[:, None]).to(tl.int32), axis=1)
    cold = in_e & (tl.load(table_ptr + e, mask=in_e, other=0) < 0)
    routes = tl.where(cold, routes, 0)
    if BALANCE:
        tl.store(routes_ptr + e, routes, mask=in_e)
        tl.debug_barrier()  # every expert's routes stored before any is read back below
        key = routes.to(tl.int64) * (E + 1) + (E - e)  # distinct: most routes first, then the lower id
        place = tl.zeros([BLOCK_E], dtype=tl.int32)  # experts before e in that order
        before = tl.zeros([BLOCK_E], dtype=tl.int64)  # their routes and e's own
        for j0 in range(0, BLOCK_E, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            rj = tl.load(routes_ptr + j, mask=j < E, other=0)
            kj = tl.where(j < E, rj.to(tl.int64) * (E + 1) + (E - j), -1)
            ahead = kj[None, :] > key[:, None]
            place += tl.sum(ahead.to(tl.int32), axis=1)
            before += tl.sum(tl.where(ahead | (kj[None, :] == key[:, None]), rj[None, :].to(tl.int64), 0), axis=1)
        routed = routes > 0
        n = tl.sum(routed.to(tl.int64), axis=0)
        total = tl.sum(routes.to(tl.int64), axis=0)
        k = place.to(tl.int64) + 1  # staging e and every expert before it
        up = k * upload
        cpu = alpha + per_expert * (n - k) + per_route * (total - before)
        cost = tl.where(k >= n, up, tl.maximum(up, cpu))
        big = 9223372036854775807
        cost = tl.where(routed & (k <= cap), cost, big)
        none = tl.where(n > 0, alpha + per_expert * n + per_route * total, 0)  # k = 0: the CPU takes them all
        best = tl.min(cost, axis=0)
        k_best = tl.where(none <= best, 0, tl.min(tl.where(cost == best, k, big), axis=0))
        pick = routed & (k <= k_best)
        rank = place
    else:
        if MEAN:  # at least the mean expert's routes in this pass: ceil(n K / E)
            min_routes = tl.maximum(min_routes, (n_real + E - 1) // E)
        pick = cold & (routes >= min_routes)
        rank = tl.cumsum(pick.to(tl.int32), axis=0) - 1
        pick = pick & (rank < cap)
    tl.store(row_ptr + e, tl.where(pick, rank + flex_lo, -1), mask=in_e)
    tl.store(pick_ptr + e, pick.to(tl.uint8), mask=in_e)
    tl.store(rank_ptr + e, rank, mask=in_e)
    tl.store(bytes_ptr, tl.load(bytes_ptr) + tl.sum(pick.to(tl.int64), axis=0) * expert_bytes)


def plan_experts(ids: torch.Tensor, count: torch.Tensor, table: torch.Tensor, cap: int, flex_lo: int,
                 expert_bytes: int, staged_bytes: torch.Tensor, *, least: int = 0, mean: bool = False,
                 costs: tuple[int, int, int, int] | None = None):
    """layers/moe/staging.py plan in one launch, with no host sync (capturable): ids [B, K] int64, count [1]
    int32 (the real rows), table [E] int32; the rule as staging.kernel_rule gives it: at least `least` routes
    (and the layer's mean expert's where `mean`), or the calibrated `costs` (StageCosts' four integers).
    -> (row [E] int32, pick [E] bool, rank [E] int32); staged_bytes [] int64 grows by the staged experts' bytes."""
    B, K = ids.shape
    E = table.shape[0]
    dev = ids.device
    routes = torch.empty(E, dtype=torch.int32, device=dev)
    row = torch.empty(E, dtype=torch.int32, device=dev)
    pick = torch.empty(E, dtype=torch.bool, device=dev)
    rank = torch.empty(E, dtype=torch.int32, device=dev)
    balance = costs is not None
    costs = tuple(costs) if balance else (0, 0, 0, 0)
    BLOCK_E = triton.next_power_of_2(E)
    _plan_kernel[(1,)](ids.contiguous(), count, table, routes, row, pick.view(torch.uint8), rank, staged_bytes,
                       expert_bytes, cap, flex_lo, least, *costs, B * K, K=K, E=E,
                       BLOCK_R=max(16, min(256, 8192 // BLOCK_E)), BLOCK_E=BLOCK_E, BLOCK_J=min(BLOCK_E, 32),
                       BALANCE=balance, MEAN=mean, num_warps=4)
    return row, pick, rank
