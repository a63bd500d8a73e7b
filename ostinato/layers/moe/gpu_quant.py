"""GPU branch over quantized expert pools: slot_experts_forward with GGUF block weights.

Legend: T tokens, K routes per token, D hidden size, F expert FFN size, N pool slots.

Quantized experts stay in their GGUF block formats in the GPU pool, uint8
w13[N, 2F, row_bytes(qt13, D)] (gate rows then up rows, one qtype) and
w2[N, D, row_bytes(qt2, F)] (down; Q4_K_M gives some layers Q6_K here), and the kernels of
kernels/triton/moe_quant.py dequantize inside: a pool slot costs its quantized bytes, and
decode, which reads each hot expert once, reads 3.5x (Q4_K) fewer bytes than bf16.
Everything else is gpu_experts': the zero slots (a cold route reads one, never its bytes),
the choice of decode or prefill kernels by T (a shape, not data), the device-side route
alignment and the fixed-order combine; no host sync, CUDA-graph capturable, deterministic.

The semantics, which slot_experts_quant_torch states in plain PyTorch (the CPU path and the
oracle): the weights are the dequantized fp32 values; h = silu(gate) * up is rounded to the
activation dtype (bf16 in the engine), as the bf16 path rounds it to the weights' dtype; the
down projection and the weighted sum over k are fp32. The decode kernels multiply in fp32;
the prefill kernels round the dequantized tile to the activation dtype for tl.dot.

Block sizes: DEFAULT_QUANT_TUNING, overridden by kernels/tuned/moe_quant_<device>.json when
one exists (written by `scripts/bench_gpu_quant.py --tune`, which sweeps the decode and prefill
configs on the device and checks the chosen ones against slot_experts_quant_torch); the
alignment and combine configs are gpu_experts' tuning for the device (the same kernels).
"""
from __future__ import annotations

import copy
import functools
import json

import torch

from ostinato.config import ConfigError
from ostinato.layers.moe import gpu_experts as ge
from ostinato.config import SILU, ExpertAct
from ostinato.quant.formats import dequantize, row_bytes

QUANT_QTYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")  # the block formats the kernels read

# GROUPS: groups of 16 lanes (32 values) per tile step; prefill buckets as gpu_experts'
# (the smallest key >= T). Not measured yet: chosen by compiling for sm_90 (Triton 3.9) as
# the larger tiles whose kernels spill no more than a few bytes of registers in any qtype.
DEFAULT_QUANT_TUNING: dict = {
    "decode_max_tokens": 8,
    # passes of at least this many tokens dequantize their experts to the activation dtype, DEQUANT_CHUNK at a
    # time, for the bf16 kernels (slot_experts_dequant_triton); None: no pass does. It was 512, from the H200 of
    # session 11, where a layer call of Q4_K_M's pairs took 1.9x less time that way at T = 512
    # (results/2026-12-02-h200-s11, --dequant-prefill). The quantized kernels of 48416b5 (loads as words and
    # vectors) made their prefill 1.8-2.0x faster, and the one device measured with them, an H100, found that path
    # never faster: 0.40x and 0.61x as fast at T = 2048 (results/2026-12-08-h100-s57/k_tune_gpu.txt). A device's
    # own tuning (`scripts/bench_gpu_quant.py --tune`) sets it by measurement; without one there is no scratch.
    "dequant_min_tokens": None,
    # dense weights kept in blocks (layers/quant_linear.py): passes of at most this many tokens run the matvec,
    # larger ones dequantize the weight and run the GEMM. Not measured yet: the matvec reads the weight once per
    # token (0.56 bytes a value in Q4_K), a dequantized GEMM writes and reads 2 bytes a value in bf16 besides
    "dense_matvec_max_tokens": 4,
    "dense_matvec": {"BLOCK_N": 1, "GROUPS": 8, "num_warps": 1, "num_stages": 3},
    "decode_w13": {"BLOCK_F": 8, "GROUPS": 4, "num_warps": 4, "num_stages": 2},
    "decode_w2": {"BLOCK_D": 4, "GROUPS": 4, "num_warps": 4, "num_stages": 1},
    "prefill": {
        "320": {"BLOCK_M": 16, "BLOCK_N": 64, "GROUPS": 4, "num_warps": 8, "num_stages": 2},
        "1000000": {"BLOCK_M": 64, "BLOCK_N": 64, "GROUPS": 4, "num_warps": 8,
                    "num_stages": 2},
    },
}


DEQUANT_CHUNK = 16  # experts dequantized at once by a large pass: the scratch the capacity test counts


def dequant_scratch_bytes(D: int, F: int, num_experts: int, itemsize: int, quant_bytes: int) -> int:
    """The dequantized path's buffers beside a pass's other expert buffers: a chunk (DEQUANT_CHUNK, or
    a layer's experts if fewer) in the activation dtype, and the chunk's quantized rows gathered."""
    chunk = min(DEQUANT_CHUNK, num_experts)
    return chunk * 3 * D * F * itemsize + chunk * quant_bytes


def quant_tuned_path(tag: str):
    return ge.TUNED_DIR / f"moe_quant_{tag}.json"


def quant_tuning_source(device: torch.device) -> dict:
    """Where `device`'s tuning of the quantized kernels comes from, as a report says it: its tuned file's name and
    when and at which commit it was tuned (_meta; None where the file did not record it), or file None: the
    defaults. A file tuned for older kernels still loads; this lets a reader see it."""
    path = quant_tuned_path(ge.device_tag(device))
    if not path.exists():
        return {"file": None}
    meta = json.loads(path.read_text()).get("_meta", {})
    return {"file": path.name, "written": meta.get("written"), "commit": meta.get("commit")}


def default_quant_tuning(tag: str) -> dict:
    """DEFAULT_QUANT_TUNING (a copy) plus gpu_experts' align and combine for the device."""
    base = ge.load_tuning(tag)
    tuning = copy.deepcopy(DEFAULT_QUANT_TUNING)
    tuning["align"], tuning["combine"] = dict(base["align"]), dict(base["combine"])
    return tuning


@functools.cache
def fewest_dequant_tokens() -> float:
    """The smallest pass that any tuning takes the dequantized path at: the default's threshold and
    every tuned file's (kernels/tuned/moe_quant_*.json; `scripts/bench_gpu_quant.py --tune
    --dequant-prefill` sets it by measurement); inf where none does. A plan does not know its
    device's tuning, so the capacity test counts the path's scratch from here. Read once
    (clear_quant_tuning_cache forgets it)."""
    values = [DEFAULT_QUANT_TUNING["dequant_min_tokens"]]
    for path in sorted(ge.TUNED_DIR.glob("moe_quant_*.json")):
        values.append(json.loads(path.read_text()).get("dequant_min_tokens", values[0]))
    return min((v for v in values if v), default=float("inf"))


@functools.cache
def load_quant_tuning(tag: str) -> dict:
    """Defaults plus gpu_experts' align and combine, overridden by moe_quant_<tag>.json."""
    tuning = default_quant_tuning(tag)
    path = quant_tuned_path(tag)
    if path.exists():
        for key, value in json.loads(path.read_text()).items():
            if key not in tuning:  # "_meta", retired keys
                continue
            if isinstance(value, dict) and key != "prefill":
                value = {**tuning[key], **value}
            tuning[key] = value
    return tuning


def prefill_config(tuning: dict, num_tokens: int, dtype: torch.dtype) -> dict:
    """The tile config of the smallest bucket >= num_tokens."""
    buckets = sorted(tuning["prefill"].items(), key=lambda kv: int(kv[0]))
    cfg = next((c for bound, c in buckets if num_tokens <= int(bound)), buckets[-1][1])
    if dtype.itemsize == 4:  # fp32 activations (tests): the shared memory of 16-bit tiles
        cfg = dict(cfg, GROUPS=max(1, cfg["GROUPS"] // 2))
    return cfg


def check_quant_pools(x, w13_pool, w2_pool, qtypes) -> None:
    """ConfigError unless the pools are uint8 [N, 2F, row_bytes(qt13, D)], [N, D, row_bytes(qt2, F)]."""
    for qtype in qtypes:
        if qtype not in QUANT_QTYPES:
            raise ConfigError(
                f"GPU expert kernels read {', '.join(QUANT_QTYPES)} blocks, not {qtype!r}: "
                f"requantize the experts (llama-quantize ... Q4_K_M) or load them as bf16")
    D = x.shape[-1]
    N, two_f, _ = w13_pool.shape
    F = two_f // 2
    want13 = (N, 2 * F, row_bytes(qtypes[0], D))
    want2 = (N, D, row_bytes(qtypes[1], F))
    for name, pool, want, qtype in [("w13", w13_pool, want13, qtypes[0]),
                                    ("w2", w2_pool, want2, qtypes[1])]:
        if pool.dtype != torch.uint8 or tuple(pool.shape) != want or pool.stride(2) != 1:
            raise ConfigError(
                f"the {name} pool of {qtype} experts must be a uint8 tensor {list(want)} with "
                f"unit last stride for hidden size {D} and expert FFN size {F}; got {pool.dtype} "
                f"{list(pool.shape)}: check the expert tensors' shapes and types in the GGUF file")


def slot_experts_quant_torch(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi, out=None, *,
                             qtypes, out_dtype=None, b13_pool=None, b2_pool=None, act: ExpertAct = SILU):
    """Plain PyTorch: loop over the distinct hot slots (host sync), dequantized fp32 weights.

    out[T, D] = sum_k weights[t,k] * (w2[s] @ round(act(w13[s][:F] @ x[t] + b13[s][:F],
                                                        w13[s][F:] @ x[t] + b13[s][F:])) + b2[s])
    with w = dequantize(pool[s]), round() to x's dtype, the biases optional.
    """
    D, F = x.shape[1], w13_pool.shape[1] // 2
    return ge.slot_loop(x, slots, weights,
                        lambda s: (dequantize(w13_pool[s], qtypes[0], D), dequantize(w2_pool[s], qtypes[1], F)),
                        x.dtype, zero_lo, zero_hi, out, out_dtype=out_dtype, b13_pool=b13_pool, b2_pool=b2_pool,
                        act=act)


def dequant_from(tuning: dict, dtype: torch.dtype) -> float:
    """The fewest tokens of a pass over quantized experts that takes the dequantized path under `tuning`,
    with activations in `dtype` (inf: none; fp32 activations never do)."""
    if dtype == torch.float32:
        return float("inf")
    return tuning.get("dequant_min_tokens") or float("inf")


def slot_experts_quant_triton(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi, out=None, *,
                              qtypes, out_dtype=None, max_distinct=None, tuning=None, b13_pool=None,
                              b2_pool=None, act: ExpertAct = SILU):
    """The Triton paths on x's device (CUDA, or CPU under TRITON_INTERPRET=1)."""
    T = slots.shape[0]
    x, slots, weights, out = ge.triton_inputs(x, slots, weights, out, out_dtype)
    if T == 0:
        return out
    epi = ge.Epilogue.of(b13_pool, b2_pool, act)
    tuning = tuning or _quant_tuning_for(x.device.type, x.device.index)
    if T <= tuning["decode_max_tokens"]:
        from ostinato.kernels.triton.moe_quant import decode_forward

        return decode_forward(x, slots, weights, w13_pool, w2_pool, qtypes, zero_lo, zero_hi, out,
                              tuning["decode_w13"], tuning["decode_w2"], epi)
    if T >= dequant_from(tuning, x.dtype):
        chunk = min(DEQUANT_CHUNK, max_distinct or DEQUANT_CHUNK)  # never more than a call's distinct slots
        return slot_experts_dequant_triton(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi, out,
                                           qtypes=qtypes, epi=epi, chunk=chunk)
    from ostinato.kernels.triton.moe_quant import prefill_forward

    cfg = prefill_config(tuning, T, x.dtype)
    aligned = ge.aligned_routes(slots, zero_lo, zero_hi, w13_pool.shape[0], cfg["BLOCK_M"], tuning, max_distinct)
    return prefill_forward(x, slots, weights, w13_pool, w2_pool, qtypes, zero_lo, zero_hi, out,
                           aligned, cfg, tuning["combine"], epi)


def slot_experts_dequant_triton(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi, out, *, qtypes, epi,
                                chunk: int = DEQUANT_CHUNK):
    """A large pass: the distinct hot slots it routes to (one host sync), renumbered 0..n-1 in slot
    order and its routes aligned once on those numbers; then `chunk` experts at a time are dequantized
    into a scratch pool in x's dtype, and the bf16 grouped GEMMs (moe_prefill.expert_gemms) run on the
    blocks of that chunk's experts alone, writing their routes' rows of h and y; one combine at the end.
    So a chunk costs its dequantization and two launches, and every route is computed once. The same
    values as the quantized prefill kernels (weights rounded to x's dtype for the dot, h rounded, fp32
    accumulation, the fixed sum over k) up to the dot's order within a tile."""
    from ostinato.kernels.triton.moe_prefill import combine_forward, expert_gemms
    from ostinato.kernels.triton.moe_quant import dequantize_rows

    T, K = slots.shape
    D, F = x.shape[1], w13_pool.shape[1] // 2
    flat = slots.reshape(-1).long()
    is_hot = (flat < zero_lo) | (flat >= zero_hi)
    hot = torch.unique(flat[is_hot])  # sorted distinct slots
    n_hot = int(hot.numel())
    if n_hot == 0:
        return out.zero_()
    # each route's number among them; a cold route gets n_hot, the zero range [n_hot, bins)
    bins = max(w13_pool.shape[0], n_hot + 1)  # the pool's size: the alignment's bins as the plain path's
    rank = torch.where(is_hot, torch.searchsorted(hot, flat), n_hot).to(torch.int32).view(T, K)
    tuning = ge.load_tuning(ge.device_tag(x.device))  # the bf16 kernels'
    cfg = ge.prefill_config(tuning, T, x.dtype)
    aligned = ge.aligned_routes(rank, n_hot, bins, bins, cfg["BLOCK_M"], tuning, n_hot)
    chunk = min(chunk, n_hot)
    s13 = torch.empty(chunk, 2 * F, D, dtype=x.dtype, device=x.device)
    s2 = torch.empty(chunk, D, F, dtype=x.dtype, device=x.device)
    sb13 = None if epi.b13 is None else torch.empty(chunk, 2 * F, dtype=torch.float32, device=x.device)
    sb2 = None if epi.b2 is None else torch.empty(chunk, D, dtype=torch.float32, device=x.device)
    chunk_epi = ge.Epilogue.of(sb13, sb2, epi.act)
    h = torch.empty(T * K, F, dtype=x.dtype, device=x.device)
    y = torch.empty(T * K, D, dtype=torch.float32, device=x.device)
    for lo in range(0, n_hot, chunk):
        part = hot[lo:lo + chunk]
        n = part.numel()
        dequantize_rows(w13_pool[part].reshape(n * 2 * F, -1), qtypes[0], D, out=s13[:n].view(n * 2 * F, D))
        dequantize_rows(w2_pool[part].reshape(n * D, -1), qtypes[1], F, out=s2[:n].view(n * D, F))
        if sb13 is not None:
            sb13[:n], sb2[:n] = epi.b13[part], epi.b2[part]
        expert_gemms(x, s13, s2, weights, aligned, h, y, cfg, chunk_epi, window=(lo, lo + n))
    return combine_forward(y, rank, out, n_hot, bins, tuning["combine"])


@functools.cache
def _quant_tuning_for(device_type: str, index: int | None) -> dict:
    return load_quant_tuning(ge.device_tag(torch.device(device_type, index)))


def quant_tuning(device: torch.device) -> dict:
    """The quantized kernels' tuning for `device` (load_quant_tuning of its tag), loaded once."""
    return _quant_tuning_for(device.type, device.index)


def clear_quant_tuning_cache() -> None:
    """Forget the loaded tunings (after a tuned file is written or its folder changes)."""
    load_quant_tuning.cache_clear()
    _quant_tuning_for.cache_clear()
    fewest_dequant_tokens.cache_clear()


def slot_experts_quant_forward(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi, out=None,
                               *, qtypes, out_dtype=None, max_distinct=None, b13_pool=None, b2_pool=None,
                               act: ExpertAct = SILU):
    """GPU branch of one MoE layer over quantized pools: out[T, D] = sum over the K slots.

    As gpu_experts.slot_experts_forward, with w13_pool uint8 [N, 2F, row_bytes(qt13, D)],
    w2_pool uint8 [N, D, row_bytes(qt2, F)] and qtypes = (qt13, qt2), each in QUANT_QTYPES.
    x[T, D] bf16 in the engine (fp16, fp32 in tests); the activation and optional fp32 biases as
    slot_experts_forward takes them. CUDA tensors run the Triton kernels (capturable); CPU
    tensors the torch path.
    """
    check_quant_pools(x, w13_pool, w2_pool, qtypes)
    epi = dict(b13_pool=b13_pool, b2_pool=b2_pool, act=act)
    if x.device.type == "cpu":
        return slot_experts_quant_torch(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi,
                                        out, qtypes=qtypes, out_dtype=out_dtype, **epi)
    return slot_experts_quant_triton(x, slots, weights, w13_pool, w2_pool, zero_lo, zero_hi, out,
                                     qtypes=qtypes, out_dtype=out_dtype, max_distinct=max_distinct, **epi)
