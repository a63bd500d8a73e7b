"""GPU branch of a hybrid MoE layer: the K routes of each token computed from pool slots.

Legend: T tokens, K routes per token, D hidden size, F expert FFN size, N pool slots,
R = T*K routes, P padded route positions (prefill), B = P / BLOCK_M route blocks.

The dispatcher (not here) maps every route's expert id through the layer's index table
to a slot of the GPU's expert pool; a cold route maps to a "zero slot" in
[zero_lo, zero_hi). So every token always has exactly K slots and every shape below
depends on T, K and the pool, never on the routing: the forward is CUDA-graph capturable
(no host sync, no `.item()`, no data-dependent sizes). A zero-slot route contributes
exactly zero, and the kernels skip reading its weights.

Two Triton paths, chosen by T (a shape, not data):
- decode (T <= tuning["decode_max_tokens"]): GEMV-like, memory bound; one program per
  (route, F block) for w13 fused with silu*mul, then one per (token, D block) over all
  K routes at once for w2 (kernels/triton/moe_decode.py).
- prefill: routes sorted stably by slot on the device and block-aligned (padded size
  bounded by R + min(max_distinct, R) * (BLOCK_M - 1), so the grid is fixed and its
  surplus programs exit early on a device-side count); two grouped tl.dot GEMMs, then a
  fixed-order sum over k (kernels/triton/moe_prefill.py).
Deterministic, bitwise: no float atomics; the only atomics count routes per slot.

`slot_experts_torch` is the same semantics in plain PyTorch: the CPU path and the oracle.
Block sizes are tuning data (kernels/tuned/moe_<device>.json, written by
scripts/bench_gpu_experts.py --tune), with DEFAULT_TUNING when no file exists.
"""
from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import NamedTuple

import torch

from ostinato.config import SILU, ExpertAct

TUNED_DIR = Path(__file__).resolve().parents[2] / "kernels" / "tuned"

# Used when no tuned file exists for the device (values: an H200's tuned file). Prefill
# configs are keyed by the largest token count they serve; the smallest key >= T is used
# (the largest key beyond that).
DEFAULT_TUNING: dict = {
    "decode_max_tokens": 8,
    "decode_w13": {"BLOCK_F": 8, "BLOCK_D": 256, "num_warps": 2, "num_stages": 3},
    "decode_w2": {"BLOCK_D": 4, "BLOCK_F": 256, "num_warps": 8, "num_stages": 1},
    "combine": {"BLOCK_D": 512, "num_warps": 4},
    # backend "triton": moe_prefill.align_forward; "torch": align_routes below.
    "align": {"backend": "triton", "CHUNK": 256, "SUB": 64, "TILE": 64, "ROWS": 4,
              "num_warps": 4, "scan_warps": 8},
    "prefill": {
        "320": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
        "1280": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
        "1000000": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8,
                    "num_stages": 3},
    },
}


def device_tag(device: torch.device) -> str:
    """'NVIDIA H200' -> 'h200': the suffix of the tuned file for this device."""
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "").strip()
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_")


@functools.lru_cache(maxsize=None)
def _tuning_for(device_type: str, index: int | None) -> dict:
    return load_tuning(device_tag(torch.device(device_type, index)))


def tuned_path(tag: str) -> Path:
    return TUNED_DIR / f"moe_{tag}.json"


@functools.lru_cache(maxsize=None)
def load_tuning(tag: str) -> dict:
    """Defaults, overridden by kernels/tuned/moe_<tag>.json when present (unknown keys ignored)."""
    tuning = copy.deepcopy(DEFAULT_TUNING)
    path = tuned_path(tag)
    if path.exists():
        for key, value in json.loads(path.read_text()).items():
            if key not in tuning:  # "_meta", retired keys
                continue
            if isinstance(value, dict) and key != "prefill":
                value = {**tuning[key], **value}  # keeps keys added since the file was written
            tuning[key] = value
    return tuning


def bucket_sizes(tuning: dict) -> list[int]:
    """A pass size in each bucket of a tuning's prefill configs (this module's or gpu_quant's): the
    upper bound of each but the last, one past the last but one's for the last. A warm-up pass of
    each compiles every tile config and its alignment kernels before a measured pass meets one
    (load.warm_up): session 23's 235B replay compiled them in two tool turns, 0.29 and 0.35 s each."""
    bounds = sorted(int(b) for b in tuning["prefill"])
    return bounds[:-1] + [bounds[-2] + 1 if len(bounds) > 1 else 1]


def prefill_config(tuning: dict, num_tokens: int, dtype=torch.bfloat16) -> dict:
    """The tile config of the smallest bucket >= num_tokens (tuned for 16-bit weights)."""
    buckets = sorted(tuning["prefill"].items(), key=lambda kv: int(kv[0]))
    cfg = next((c for bound, c in buckets if num_tokens <= int(bound)), buckets[-1][1])
    if dtype.itemsize == 4:  # fp32 (tests): same shared memory as the 16-bit tiles
        cfg = dict(cfg, BLOCK_K=max(16, cfg["BLOCK_K"] // 2))
    return cfg


def _is_hot(slots: torch.Tensor, zero_lo: int, zero_hi: int) -> torch.Tensor:
    return (slots < zero_lo) | (slots >= zero_hi)


def slot_experts_torch(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi, out=None, *,
                       out_dtype=None, b13_pool=None, b2_pool=None, act: ExpertAct = SILU):
    """Plain PyTorch: loop over the distinct hot slots (host sync), fp32 math.

    x[T, D], slots[T, K] int, weights[T, K] f32, w13_pool[N, 2F, D], w2_pool[N, D, F],
    optional biases b13_pool[N, 2F], b2_pool[N, D] (fp32)
    -> out[T, D] = sum_k weights[t,k] * (w2[s] @ act(w13[s][:F] @ x[t] + b13[s][:F],
                                                     w13[s][F:] @ x[t] + b13[s][F:]) + b2[s])
    with act's output rounded to the weights' dtype, as the kernels do.
    """
    return slot_loop(x, slots, weights, lambda s: (w13_pool[s].float(), w2_pool[s].float()), w2_pool.dtype,
                     zero_lo, zero_hi, out, out_dtype=out_dtype, b13_pool=b13_pool, b2_pool=b2_pool, act=act)


def slot_loop(x, slots, weights, weights_of, h_dtype, zero_lo, zero_hi, out=None, *,
              out_dtype=None, b13_pool=None, b2_pool=None, act: ExpertAct = SILU):
    """The plain-PyTorch oracle of a hot-slot pass, over any weight format: `weights_of(s)` gives slot s's
    (w13 [2F, D], w2 [D, F]) as fp32, and act's output is rounded to `h_dtype` before the down projection."""
    T, K = slots.shape
    flat = slots.reshape(-1).long()  # [R]
    partial = torch.zeros(T * K, x.shape[1], dtype=torch.float32, device=x.device)  # [R, D]
    wflat = weights.reshape(-1).float()
    for s in torch.unique(flat[_is_hot(flat, zero_lo, zero_hi)]).tolist():
        routes = (flat == s).nonzero().squeeze(1)
        xs = x[routes // K].float()  # [n, D]
        w13, w2 = weights_of(s)
        gu = xs @ w13.t()  # [n, 2F]
        if b13_pool is not None:
            gu = gu + b13_pool[s].float()
        gate, up = gu.chunk(2, dim=-1)  # [n, F] each
        h = act(gate, up).to(h_dtype).float()
        y = h @ w2.t()
        if b2_pool is not None:
            y = y + b2_pool[s].float()
        partial[routes] = y * wflat[routes, None]
    result = partial.view(T, K, -1).sum(1)  # fixed order over k
    if out is None:
        return result.to(out_dtype or x.dtype)
    return out.copy_(result)


class AlignedRoutes(NamedTuple):
    """Hot routes sorted by slot, each slot's group padded to a multiple of BLOCK_M.

    Only the first num_padded entries (num_padded / BLOCK_M blocks) are meaningful.
    """

    sorted_routes: torch.Tensor  # [P] int32 route id t*K+k, or R for padding
    block_slots: torch.Tensor  # [B] int32 slot of each route block
    num_padded: torch.Tensor  # [1] int64 padded positions used by hot routes


def padded_size(num_routes: int, block_m: int, max_distinct: int) -> int:
    """Upper bound on padded positions; depends on shapes only, never on routing."""
    p = num_routes + min(max_distinct, num_routes) * (block_m - 1)
    return -(-p // block_m) * block_m


def align_routes(slots, zero_lo: int, zero_hi: int, block_m: int,
                 max_distinct: int) -> AlignedRoutes:
    """Sort routes by slot and block-align them with fixed-shape torch ops (no host sync).

    The oracle of moe_prefill.align_forward (same layout), and its fallback.
    Zero-slot routes get the largest key, so they sort after every hot group; their
    blocks lie beyond num_padded and are never computed. max_distinct bounds the number
    of distinct hot slots one call can see (e.g. the experts of a layer); exceeding it
    makes the scatter below go out of bounds.
    """
    flat = slots.reshape(-1)
    num_routes = flat.numel()
    device = flat.device
    sentinel = torch.iinfo(torch.int32).max
    hot = _is_hot(flat, zero_lo, zero_hi)
    key = torch.where(hot, flat.to(torch.int32), sentinel)  # [R]
    sorted_key, order = torch.sort(key, stable=True)  # [R]
    first = torch.searchsorted(sorted_key, sorted_key, right=False)  # start of own group
    after = torch.searchsorted(sorted_key, sorted_key, right=True)  # end of own group
    count = after - first
    padded = (count + block_m - 1) // block_m * block_m
    idx = torch.arange(num_routes, device=device)
    is_end = idx == after - 1
    pad_at_end = torch.where(is_end, padded - count, 0)
    dest = idx + torch.cumsum(pad_at_end, 0) - pad_at_end  # padded position of each sorted route
    size = padded_size(num_routes, block_m, max_distinct)
    sorted_routes = torch.full((size,), num_routes, dtype=torch.int32, device=device)
    sorted_routes.index_copy_(0, dest, order.to(torch.int32))
    slot_at = torch.full((size,), -1, dtype=torch.int32, device=device)
    slot_at.index_copy_(0, dest, torch.where(sorted_key == sentinel, -1, sorted_key))
    block_slots = slot_at[::block_m].contiguous()
    hot_sorted = sorted_key != sentinel
    num_padded = torch.where(is_end & hot_sorted, padded, 0).sum().reshape(1)
    return AlignedRoutes(sorted_routes, block_slots, num_padded)


def triton_inputs(x, slots, weights, out, out_dtype):
    """The Triton entry points' common start (bf16 and quantized pools): out [T, D] made, or
    checked, and the inputs contiguous in the kernels' dtypes -> (x, slots, weights, out)."""
    T, D = slots.shape[0], x.shape[1]
    if out is None:
        out = torch.empty(T, D, dtype=out_dtype or x.dtype, device=x.device)
    assert out.shape == (T, D) and out.stride(1) == 1, "out must be [T, D] with unit last stride"
    return x.contiguous(), slots.to(torch.int32).contiguous(), weights.to(torch.float32).contiguous(), out


class Epilogue(NamedTuple):
    """What the kernels apply around the two matmuls of an expert: optional fp32 bias pools
    b13[N, 2F] and b2[N, D] (None: no bias) and the activation (config.ExpertAct)."""

    b13: torch.Tensor | None
    b2: torch.Tensor | None
    act: ExpertAct

    @classmethod
    def of(cls, b13_pool, b2_pool, act: ExpertAct) -> "Epilogue":
        if (b13_pool is None) != (b2_pool is None):
            raise ValueError("b13_pool and b2_pool go together")
        for b in (b13_pool, b2_pool):
            if b is not None:
                assert b.dtype == torch.float32 and b.is_contiguous(), "bias pools are contiguous fp32"
        return cls(b13_pool, b2_pool, act)

    def kernel_args(self, x: torch.Tensor) -> dict:
        """The kernels' bias pointers (x stands in when absent: never read), HAS_BIAS, ACT,
        ALPHA and LIMIT."""
        has = self.b13 is not None
        return {"b13_ptr": self.b13 if has else x, "b2_ptr": self.b2 if has else x, "HAS_BIAS": has,
                "ACT": self.act.code, "ALPHA": float(self.act.alpha), "LIMIT": float(self.act.limit)}


def slot_experts_triton(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi, out=None, *,
                        out_dtype=None, max_distinct=None, tuning=None, b13_pool=None, b2_pool=None,
                        act: ExpertAct = SILU):
    """The Triton paths on x's device (CUDA, or CPU under TRITON_INTERPRET=1)."""
    T = slots.shape[0]
    x, slots, weights, out = triton_inputs(x, slots, weights, out, out_dtype)
    if T == 0:
        return out
    assert x.dtype == w13_pool.dtype == w2_pool.dtype, "x and the pools must share a dtype"
    epi = Epilogue.of(b13_pool, b2_pool, act)
    tuning = tuning or _tuning_for(x.device.type, x.device.index)
    if T <= tuning["decode_max_tokens"]:
        from ostinato.kernels.triton.moe_decode import decode_forward

        return decode_forward(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi, out,
                              tuning["decode_w13"], tuning["decode_w2"], epi)
    from ostinato.kernels.triton.moe_prefill import prefill_forward

    cfg = prefill_config(tuning, T, x.dtype)
    aligned = aligned_routes(slots, zero_lo, zero_hi, w13_pool.shape[0], cfg["BLOCK_M"], tuning, max_distinct)
    return prefill_forward(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi, out,
                           aligned, cfg, tuning["combine"], epi)


def aligned_routes(slots, zero_lo, zero_hi, num_slots: int, block_m: int, tuning: dict,
                   max_distinct: int | None) -> AlignedRoutes:
    """A prefill pass's routes sorted by slot into blocks of block_m (the grouped GEMM's input),
    by torch or by the Triton kernel as the tuning says; max_distinct bounds the slots a pass
    can route to (default: every non-zero slot)."""
    from ostinato.kernels.triton.moe_prefill import align_forward

    distinct = max(num_slots - (zero_hi - zero_lo) if max_distinct is None else max_distinct, 1)
    if tuning["align"]["backend"] == "torch":
        return align_routes(slots, zero_lo, zero_hi, block_m, distinct)
    size = padded_size(slots.numel(), block_m, distinct)
    return AlignedRoutes(*align_forward(slots, zero_lo, zero_hi, num_slots, block_m, size, tuning["align"]))


def slot_experts_forward(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi, out=None, *,
                         out_dtype=None, max_distinct=None, b13_pool=None, b2_pool=None,
                         act: ExpertAct = SILU):
    """GPU branch of one MoE layer: out[T, D] = sum over the K slots of each token.

    x[T, D] (bf16 or fp32), slots[T, K] int32 pool slots, weights[T, K] float32,
    w13_pool[N, 2F, D], w2_pool[N, D, F]; [zero_lo, zero_hi) are the zero slots.
    The experts' activation `act` and optional fp32 biases b13_pool[N, 2F], b2_pool[N, D]
    (a zero slot's never read: a cold route adds nothing, bias included).
    Output dtype: out's when given, else out_dtype or x's (pass torch.float32 for fp32).
    max_distinct: bound on distinct hot slots in one call (e.g. experts per layer); it
    only sizes prefill's padded buffer, default: all non-zero slots of the pool.
    CUDA tensors run the Triton kernels (capturable); CPU tensors the torch path.
    """
    if x.device.type == "cpu":
        return slot_experts_torch(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi, out,
                                  out_dtype=out_dtype, b13_pool=b13_pool, b2_pool=b2_pool, act=act)
    return slot_experts_triton(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi, out,
                               out_dtype=out_dtype, max_distinct=max_distinct, b13_pool=b13_pool,
                               b2_pool=b2_pool, act=act)
