"""GPU half of the decode-graph handshake with the native CPU worker (layers/moe/graph_worker.py).

Inside the captured decode step, per MoE layer:
  post      one program: copy the token's routing (ids, weights) and activations into
            page-locked, device-mapped host memory, write has_cold (does any routed expert
            map to "cold" in the device index table?), then publish post_flag = seq with
            release semantics at system scope, so the worker sees the data before the flag;
            with borrowed memory it also scores the layer's cold routes and counts its
            borrowed hits (Borrowing.observe's arithmetic, in the same kernel: no launch);
  (the GPU branch runs here, concurrently with the CPU worker)
  wait_add_rows  the join, in three operations of the stream:
            wait  one program reads has_cold once into a device word, and if it is set spins
                  until done_flag == seq (acquire, system scope);
            copy  the copy engine brings the worker's fp32 partial into a device buffer
                  (`CopyJoin`, shared by every layer in stream order);
            add   the partial (where has_cold) added to the GPU branch's fp32 partial, rounded
                  once to the activation dtype; reads device memory only.
A step starts with `bump`, which increments the device-side sequence number; nothing on the
host changes between replays. Every post also writes the step's token count (1 for decode).

A short prefill pass captured as a graph (engine/graph.py PassGraphs) posts n of its B rows (n on
the device: the pass is padded to B, the rows past n are never read by the worker):
  post_rows  the activations of the n real rows cross into the mapped buffer in a kernel of many programs,
             then (stream-ordered after it) one program writes ids, weights, n and has_cold (over
             the n rows) and publishes post_flag as `post` does;
  wait_add_rows  as in a decode step, over B rows; the add keeps the GPU branch's sum alone in
             the rows past n.

Why the copy: an add kernel that read the partial in mapped host memory (volatile loads, the join
until session 38) moved it at 0.23-0.51 GB/s on an H100, 4.3-6.0 ms a layer for 255 rows, where the
copy and the add take 0.06-0.10 ms; replayed 255-token passes took 432 ms against 263 ms
(results/2026-12-06-h100-s38/; scripts/bench_handshake.py times the join alone).

Outside graphs, a prefill pass's split layers may join their CPU branch the same way
(`wait_value`, hybrid.py's deferred combine): the stream spins until the CPU pool has stored
the call's number into a page-locked word, so the host goes on launching the next layer instead
of waiting for the CPU itself.

Host-memory tensors are passed to Triton through `HostPointer` (UVA: the device address of
page-locked memory equals its host address).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


class HostPointer:
    """A page-locked host tensor presented to Triton as a device pointer (same address under UVA)."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


@triton.jit
def _bump(seq_ptr):
    tl.store(seq_ptr, tl.load(seq_ptr) + 1)


@triton.jit
def _post(ids_ptr, w_ptr, x_ptr, table_ptr, seq_ptr,
          h_ids, h_w, h_x, h_has_cold, h_post, h_tokens, scores_ptr, hits_ptr, flex_lo,
          K: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SCORE: tl.constexpr):
    k = tl.arange(0, K)
    ids = tl.load(ids_ptr + k)
    tl.store(h_ids + k, ids.to(tl.int32))
    tl.store(h_w + k, tl.load(w_ptr + k))
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        tl.store(h_x + d, tl.load(x_ptr + d, mask=d < D), mask=d < D)
    slot = tl.load(table_ptr + ids)
    seq = tl.load(seq_ptr)
    has_cold = tl.max((slot < 0).to(tl.int32), axis=0)
    if SCORE:  # one program and distinct ids: plain loads and stores, each score added once
        tl.store(scores_ptr + ids, tl.load(scores_ptr + ids) + (slot < 0).to(tl.float32))
        tl.store(hits_ptr, tl.load(hits_ptr) + tl.sum((slot >= flex_lo).to(tl.int64), axis=0))
    tl.store(h_tokens, 1)
    tl.store(h_has_cold, has_cold * seq)  # 0, or the step: lets the worker see it fell behind
    tl.debug_barrier()  # every thread's stores are done before the flag goes out
    tl.atomic_xchg(h_post, seq, sem="release", scope="sys")


@triton.jit
def _copy_rows(x_ptr, h_x, count_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    if t >= tl.load(count_ptr):  # a padding row: the worker never reads it
        return
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tl.store(h_x + t * D + d, tl.load(x_ptr + t * D + d, mask=d < D), mask=d < D)


@triton.jit
def _post_rows(ids_ptr, w_ptr, table_ptr, seq_ptr, count_ptr, h_ids, h_w, h_has_cold, h_tokens, h_post,
               pick_ptr, h_staged, K: tl.constexpr, BLOCK: tl.constexpr, ROUTES: tl.constexpr,
               E: tl.constexpr, BLOCK_E: tl.constexpr, STAGED: tl.constexpr):
    r = tl.arange(0, BLOCK)
    m = r < ROUTES
    n = tl.load(count_ptr)
    ids = tl.load(ids_ptr + r, mask=m, other=0)
    tl.store(h_ids + r, ids.to(tl.int32), mask=m)
    tl.store(h_w + r, tl.load(w_ptr + r, mask=m, other=0.0), mask=m)
    slot = tl.load(table_ptr + ids, mask=m, other=0)
    seq = tl.load(seq_ptr)
    has_cold = tl.max(((slot < 0) & m & (r // K < n)).to(tl.int32), axis=0)
    if STAGED:  # the experts this pass computes on the GPU: the worker leaves them out
        e = tl.arange(0, BLOCK_E)
        tl.store(h_staged + e, tl.load(pick_ptr + e, mask=e < E, other=0).to(tl.uint8), mask=e < E)
    tl.store(h_tokens, n)
    tl.store(h_has_cold, has_cold * seq)
    tl.debug_barrier()
    tl.atomic_xchg(h_post, seq, sem="release", scope="sys")


@triton.jit
def _wait_rows(h_has_cold, h_done, seq_ptr, cold_ptr):
    has = tl.load(h_has_cold, volatile=True)
    tl.store(cold_ptr, has)  # the flag in device memory for the add: one read of mapped memory
    if has != 0:
        seq = tl.load(seq_ptr)
        while tl.atomic_add(h_done, 0, sem="acquire", scope="sys") != seq:
            pass


@triton.jit
def _add_rows(gpu_ptr, src, cold_ptr, count_ptr, y_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = d < D
    acc = tl.load(gpu_ptr + t * D + d, mask=m, other=0.0)
    if (tl.load(cold_ptr) != 0) & (t < tl.load(count_ptr)):  # both written earlier in the stream
        acc += tl.load(src + t * D + d, mask=m, other=0.0)
    tl.store(y_ptr + t * D + d, acc.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["value"])
def _wait_value(word_ptr, value):
    while tl.atomic_add(word_ptr, 0, sem="acquire", scope="sys") != value:
        pass


def wait_value(word: HostPointer, value: int) -> None:
    """The current stream waits until the page-locked int32 `word` holds `value` (stored with
    release semantics by the CPU: CpuExperts.submit's notify): one program of one warp spins,
    and every later operation of the stream sees what the CPU wrote before the store."""
    _wait_value[(1,)](word, value, num_warps=1)


def bump(seq: torch.Tensor) -> None:
    _bump[(1,)](seq)


def post(ids, weights, x, table_row, seq, h_ids, h_w, h_x, h_has_cold, h_post, h_tokens, score=None) -> None:
    """ids [1, K] int64, weights [1, K] fp32, x [1, D], table_row [E] int32 (device);
    the h_* are this layer's HostPointer views of the shared buffers (GraphHandshake).
    score: (scores_row [E] fp32, hits [] int64, flex_lo) of borrowed memory, or None."""
    K, D = ids.shape[1], x.shape[1]
    scores, hits, flex_lo = score if score is not None else (table_row, seq, 0)  # unread without SCORE
    _post[(1,)](ids, weights, x, table_row, seq, h_ids, h_w, h_x, h_has_cold, h_post, h_tokens, scores, hits,
                flex_lo, K=K, D=D, BLOCK_D=1024, SCORE=score is not None, num_warps=4)


def post_rows(ids, weights, x, table_row, seq, count, h_ids, h_w, h_x, h_has_cold, h_post, h_tokens,
              pick=None, h_staged=None) -> None:
    """A captured prefill pass's post: ids [B, K] int64, weights [B, K] fp32, x [B, D] (device, rows
    contiguous), count [1] int32 (device): the pass's real rows n <= B; the h_* this layer's HostPointer
    views of the shared buffers; pick [E] bool (device) with h_staged, the layer's row of the shared
    marks: the experts the pass stages (layers/moe/staging.py), posted with the rest. The n real rows of x cross
    in a kernel of their own (a program per row and block; the padding rows' return at once: the worker
    never reads them), which ends before the flag's kernel begins."""
    B, K = ids.shape
    D = x.shape[1]
    assert x.is_contiguous() and ids.is_contiguous() and weights.is_contiguous(), "rows must be contiguous"
    assert (pick is None) == (h_staged is None), "the staged marks need both pick and h_staged"
    BLOCK_D = 1024
    E = pick.shape[0] if pick is not None else 1
    _copy_rows[(B, triton.cdiv(D, BLOCK_D))](x, h_x, count, D=D, BLOCK_D=BLOCK_D, num_warps=4)
    _post_rows[(1,)](ids, weights, table_row, seq, count, h_ids, h_w, h_has_cold, h_tokens, h_post,
                     pick if pick is not None else table_row, h_staged if h_staged is not None else h_tokens,
                     K=K, BLOCK=triton.next_power_of_2(B * K), ROUTES=B * K, E=E,
                     BLOCK_E=triton.next_power_of_2(E), STAGED=pick is not None, num_warps=4)


class CopyJoin:
    """The join's device buffers: `rows` [R, D] fp32, which the worker's partial of up to R rows is copied
    into after the wait, and `cold` [1] int32, the layer's has_cold as the wait read it."""

    def __init__(self, max_rows: int, hidden: int, device):
        self.rows = torch.empty(max_rows, hidden, dtype=torch.float32, device=device)
        self.cold = torch.zeros(1, dtype=torch.int32, device=device)


def wait_add_rows(gpu_out, h_out, h_has_cold, h_done, seq, count, y, join: CopyJoin) -> None:
    """gpu_out [B, D] fp32 (device), h_out the layer's [>= B, D] fp32 (host: a HostPointer, or the
    tensor), count [1] int32 (device): the real rows, y [B, D] (device, the layer output): the wait, the
    B rows copied into join.rows (stream-ordered after it: the copy engine reads what the worker stored),
    then the add; rows past count keep the GPU branch's sum alone."""
    B, D = gpu_out.shape
    assert gpu_out.is_contiguous() and y.is_contiguous(), "rows must be contiguous"
    _wait_rows[(1,)](h_has_cold, h_done, seq, join.cold, num_warps=1)
    host = h_out if isinstance(h_out, torch.Tensor) else h_out.t  # a HostPointer's tensor
    src = join.rows[:B]
    src.copy_(host[:B], non_blocking=True)
    BLOCK_D = 512
    _add_rows[(B, triton.cdiv(D, BLOCK_D))](gpu_out, src, join.cold, count, y, D=D, BLOCK_D=BLOCK_D, num_warps=4)
