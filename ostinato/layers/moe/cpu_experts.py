"""The CPU branch of a hybrid MoE layer: the cold routes, computed from host memory.

Legend: T tokens, R cold routes, E experts, D hidden size, F expert FFN size.

    out[t] = sum over routes r with token_idx[r] == t of
             weights[r] * w2[e] @ (silu(w13[e][:F] @ x[t]) * (w13[e][F:] @ x[t])),  e = expert_ids[r]

(with the layer's experts' activation and biases where they have them, types.py: gpt-oss adds
b13 to gate and up, clamps them, and adds b2 after the down projection; the biases live in fp32)

written into out[:T] (fp32; rows without a route are zero). CpuExperts owns the host
expert weights of its layers (used in place, never copied: the engine pins them) and a
resident native thread pool; `submit` hands a layer's cold routes to the pool and returns
at once with the GIL released, `wait` works on the remaining tasks and returns when out
is ready. Every tensor passed to submit must stay alive and unchanged until wait
(CpuExperts keeps references).

Precision of the native kernels (see ostinato/kernels/cpu/): products of bf16 values are
exact, every sum is fp32, the intermediate h = silu(gate) * up is rounded once to the
weights' dtype (bf16) before the down projection, as the GPU kernels and the reference model
round it; routes of a token are summed in ascending
expert order. The output is bitwise reproducible and independent of the thread count; it
can differ in the last bits between ISA paths (avx512 / avx512_bf16 / amx). The torch
backend (no compiler, no AVX-512, or asked for) runs `torch_reference` on a worker thread.

Quantized experts (QuantExpertWeights: GGUF blocks, types.py) run on integer-dot kernels
(AVX512_VNNI) that read the blocks in place. Each activation entering a quantized projection
is quantized per 32 values to int8 (`quantize_activations`): x once per token, and h, after
its bf16 rounding, once per route; the weights' integers meet these exactly and the block
scales combine the int32 sums in fp32. `quant_reference` is the same function in torch (the
blocks dequantized by ostinato/quant/formats.py) and the torch backend's path for them; the
two differ only by fp32 summation order. The int8 step costs about 1% relative error in a
layer's output against bf16 activations (random weights, scripts/bench_cpu_quant.py prints
it), the trade llama.cpp's CPU kernels make too (Q8_K / Q8_0 activations); the GPU branch
keeps bf16 activations, so the two branches of a layer agree to that order, not bitwise.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ostinato.config import ConfigError, env_count
from ostinato.threads import process_layout
from ostinato.config import SILU, ExpertAct
from ostinato.layers.moe.types import ExpertWeights, QuantExpertWeights, check_biases
from ostinato.quant import formats

ISAS = {"auto": 0, "avx512": 1, "avx512_bf16": 2, "amx": 3}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
QTYPE_CODES = {"Q8_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4, "MXFP4": 5}  # experts.h QType
# The default of default_amx_int8_min_tokens: from 4 routes an expert. One layer alone on the 16-core
# GPU machine's CPU took 0.81x the row kernels' time at 8 routes an expert and 0.65x at 16 (kernels_amx8.cpp's
# header); in the held-out replays (results/2026-12-06-h100-s42/) the tiles let captured passes stage fewer
# experts (staging.py default_stage_routes: m = 16 with the tiles, 12 without).
AMX_INT8_MIN_TOKENS = 4
# MXFP4's: from 8. Its 17-byte blocks cost the tiles more decoding than Q4_K's (kernels_amx8.cpp
# decode_mxfp4). One gpt-oss-120b layer (128 experts of 2880 x 2880, top-4, every route cold) on the 2-core
# development host with one worker (results/2026-12-07-h100-s48/amx_int8_mxfp4_local.txt) took, against the
# row kernels, 1.48x / 1.39x the time at 32 / 64 tokens from 2 routes, 1.01x / 0.97x at 64 / 128 from 4,
# and 0.74x / 0.55x at 256 / 512 from 8. Not yet measured on the GPU machine's 16 cores.
AMX_INT8_MIN_TOKENS_MXFP4 = 8
_MIN_AMAX = 2.0**-96  # activation blocks below count as zeros (127 / amax stays finite)
_FLOAT_QTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}


def torch_reference(
    w13: torch.Tensor,  # [E, 2F, D]
    w2: torch.Tensor,  # [E, D, F]
    x: torch.Tensor,  # [T, D]
    token_idx: torch.Tensor,  # [R]
    expert_ids: torch.Tensor,  # [R]
    weights: torch.Tensor,  # [R]
    out: torch.Tensor | None = None,  # [>= T, D] fp32
    h_dtype: torch.dtype | None = None,
    *,
    b13: torch.Tensor | None = None,  # [E, 2F]
    b2: torch.Tensor | None = None,  # [E, D]
    act: ExpertAct = SILU,
) -> torch.Tensor:
    """The oracle in plain torch: fp32 math on the given (bf16 or fp32) weights and biases; the
    FFN intermediate h = act(gate, up) is rounded to h_dtype (default: the weights' dtype) before
    the down projection, as the GPU kernels and the reference model do."""
    T, D = x.shape
    F = w2.shape[2]
    if out is None:
        out = torch.empty(T, D, dtype=torch.float32)
    res = out[:T]
    res.zero_()
    tok, eid, wts = token_idx.long(), expert_ids.long(), weights.float()
    for e in torch.unique(eid).tolist():  # ascending: the native summation order
        sel = (eid == e).nonzero().squeeze(1)
        t = tok[sel]
        gu = x[t].float() @ w13[e].float().T  # [n, 2F]
        if b13 is not None:
            gu = gu + b13[e].float()
        h = act(gu[:, :F], gu[:, F:]).to(h_dtype or w2.dtype).float()  # [n, F]
        y = h @ w2[e].float().T  # [n, D]
        if b2 is not None:
            y = y + b2[e].float()
        res.index_add_(0, t, y * wts[sel, None])
    return out


def quantize_activations(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., n] -> int8 q [..., n], fp32 d [..., n / 32]: per block of 32 values,
    amax = max |v|, d = amax / 127, q = round-half-even(v * (127 / amax)) (one fp32 division,
    one fp32 product); a block with amax < 2^-96 (zeros) gives d = 0, q = 0; so v ~ q * d.
    The native kernels quantize bit-identically (quantize_activations in kernels/cpu/experts.h)."""
    blocks = v.float().reshape(*v.shape[:-1], v.shape[-1] // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    live = amax >= _MIN_AMAX
    inv = torch.where(live, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv).clamp_(-127, 127).to(torch.int8)
    return q.reshape(v.shape), torch.where(live, amax / 127.0, torch.zeros_like(amax)).squeeze(-1)


def _through_q8(v: torch.Tensor) -> torch.Tensor:
    """v as the quantized kernels see it: q * d (fp32)."""
    q, d = quantize_activations(v)
    return (q.float().reshape(*v.shape[:-1], -1, 32) * d[..., None]).reshape(v.shape)


def quant_reference(
    w: QuantExpertWeights,
    x: torch.Tensor,  # [T, D]
    token_idx: torch.Tensor,  # [R]
    expert_ids: torch.Tensor,  # [R]
    weights: torch.Tensor,  # [R]
    out: torch.Tensor | None = None,  # [>= T, D] fp32
) -> torch.Tensor:
    """Quantized experts in plain torch: the used experts' blocks dequantized to fp32, x and
    h quantized as the native kernels quantize them (h after rounding to bf16), fp32 math."""
    T, D = x.shape
    F = w.ffn
    if out is None:
        out = torch.empty(T, D, dtype=torch.float32)
    res = out[:T]
    res.zero_()
    tok, eid, wts = token_idx.long(), expert_ids.long(), weights.float()
    xq = _through_q8(x.float())
    for e in torch.unique(eid).tolist():  # ascending: the native summation order
        sel = (eid == e).nonzero().squeeze(1)
        t = tok[sel]
        gu = xq[t] @ formats.dequantize(w.w13[e], w.qt13, D).T  # [n, 2F]
        if w.b13 is not None:
            gu = gu + w.b13[e].float()
        h = _through_q8(w.act(gu[:, :F], gu[:, F:]).bfloat16().float())  # [n, F]
        y = h @ formats.dequantize(w.w2[e], w.qt2, F).T  # [n, D]
        if w.b2 is not None:
            y = y + w.b2[e].float()
        res.index_add_(0, t, y * wts[sel, None])
    return out


class CpuExperts:
    """Cold experts of several MoE layers on a resident CPU thread pool.

    layers: {layer index: weights} or a list (index = position): ExpertWeights (bf16 or fp32)
    or QuantExpertWeights (GGUF blocks; a 4-tuple (qt13, w13, qt2, w2) is read as one),
    contiguous, on the CPU, each with its activation and optional biases (fp32 ones are used in
    place; others, a few KiB per expert, are copied to fp32 once). cpus: the logical CPU of each pool worker (a thread layout's
    workers, ostinato/threads.py); without it, the layout of a host-driven process with
    num_threads workers (default: every physical core but the caller's, since the thread
    that calls wait() takes tasks as the last worker).
    backend: "native" (the C++ kernels; raises if unavailable), "torch", or "auto".
    isa: cap on the native path ("auto" = best available). spin_us: how long idle workers
    spin before sleeping (microseconds). amx_min_tokens: fewest routes of one expert that
    send it to the AMX tiles (4 was the fastest of 4, 8, 16 for 128-token prefills on the
    16-core GPU host; scripts/bench_cpu_experts.py --amx-min-tokens measures it).
    amx_quant_min_tokens: the same for quantized experts, whose rows the AMX path decodes to
    bf16 first (default: amx_quant_min_tokens(), 0 = never, until its break-even is measured).
    amx_int8_min_tokens: fewest routes of a quantized expert that send its Q4_K / Q6_K / MXFP4
    projections to the AMX int8 tiles, the row kernels' integers 16 rows by 16 routes at once (default:
    default_amx_int8_min_tokens of the layer's format; 0 = never; no effect without AMX-INT8).
    """

    def __init__(
        self,
        layers: Mapping[int, ExpertWeights] | Sequence[ExpertWeights],
        num_threads: int | None = None,
        backend: str = "auto",
        *,
        cpus: Sequence[int] | None = None,
        isa: str = "auto",
        spin_us: int = 2000,
        amx_min_tokens: int = 4,
        amx_quant_min_tokens: int | None = None,
        amx_int8_min_tokens: int | None = None,
    ):
        items = layers.items() if isinstance(layers, Mapping) else enumerate(layers)
        self.layers = {int(i): _checked(i, _as_weights(i, w)) for i, w in items}
        if backend not in ("auto", "native", "torch"):
            raise ValueError(f"backend must be 'auto', 'native' or 'torch', not {backend!r}")
        if isa not in ISAS:
            raise ValueError(f"isa must be one of {sorted(ISAS)}, not {isa!r}")
        if cpus is None:
            cpus = process_layout(cpu_threads=num_threads).workers
        elif num_threads is not None and num_threads != len(cpus):
            raise ValueError(f"num_threads {num_threads} and {len(cpus)} cpus disagree")
        self.cpus = tuple(int(c) for c in cpus)
        self.num_threads = len(self.cpus)
        self.fallback_reason: str | None = None
        self._native = None
        if backend != "torch":
            self.fallback_reason = _native_unavailable(isa)
            if self.fallback_reason is None and any(isinstance(w, QuantExpertWeights) for w in self.layers.values()):
                self.fallback_reason = _quant_unavailable()
            if self.fallback_reason and backend == "native":
                raise RuntimeError(f"native CPU experts unavailable: {self.fallback_reason}")
            if self.fallback_reason:  # said, not silent: a hybrid pass is many times slower on plain torch
                warnings.warn(f"CPU experts on plain torch, not the native kernels: {self.fallback_reason}",
                              RuntimeWarning, stacklevel=2)
        self.backend = "torch" if backend == "torch" or self.fallback_reason else "native"
        if self.backend == "native":
            ext = _extension()
            self._native = ext.ColdExperts(list(self.cpus), int(spin_us))
            if amx_quant_min_tokens is None:
                amx_quant_min_tokens = default_amx_quant_min_tokens()
            self._args = {i: _layer_args(ext, w, isa, amx_min_tokens, amx_quant_min_tokens,
                                         default_amx_int8_min_tokens(getattr(w, "qt13", None))
                                         if amx_int8_min_tokens is None else amx_int8_min_tokens)
                          for i, w in self.layers.items()}
        else:  # torch's intra-op pool on num_threads in its worker (a CUDA runner keeps its own threads at one)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-experts",
                                                initializer=torch.set_num_threads, initargs=(self.num_threads,))
        self._pending: tuple | None = None
        self._future: Future | None = None
        self._notified = False  # the pending call announces its end (submit's notify)

    def submit(
        self,
        layer: int,
        x: torch.Tensor,  # [T, D] bf16 or fp32, rows contiguous
        token_idx: torch.Tensor,  # [R] int32
        expert_ids: torch.Tensor,  # [R] int32
        weights: torch.Tensor,  # [R] fp32
        out: torch.Tensor,  # [>= T, D] fp32, rows contiguous; out[:T] is overwritten
        notify: tuple[torch.Tensor, int] | None = None,
    ) -> None:
        """Starts one layer's cold routes and returns at once; call wait() before reuse.
        notify (native backend only): (word, value), word an int32 tensor in host memory (page-locked
        and device-mapped for a GPU stream to spin on it): the call stores value there once out is
        complete, before wait(); such a call needs no wait() of its own, the next submit() waits for it."""
        self.settle()
        if self._pending is not None:
            raise RuntimeError("CpuExperts.submit() called before wait() of the previous call")
        if notify is not None and self._native is None:
            raise ValueError(f"notify needs the native CPU experts, not the {self.backend!r} backend")
        w = self.layers[layer]
        token_idx, expert_ids, weights = _routes(token_idx, expert_ids, weights)
        _check_io(w, x, out)
        self._pending = (x, token_idx, expert_ids, weights, out)
        if self._native is None:
            if isinstance(w, QuantExpertWeights):
                self._future = self._executor.submit(quant_reference, w, x, token_idx, expert_ids, weights, out)
            else:
                self._future = self._executor.submit(torch_reference, w.w13, w.w2, x, token_idx, expert_ids, weights,
                                                     out, b13=w.b13, b2=w.b2, act=w.act)
            return
        try:
            args = self._fill_args(layer, x, token_idx, expert_ids, weights, out, notify)
            try:
                self._native.submit(args)
            finally:  # the call holds its own copy; the layer's args (which the decode graph's worker
                args.notify, args.notify_value = 0, 0  # copies) announce nothing
        except BaseException:
            self._pending = None
            raise
        self._notified = notify is not None

    def _fill_args(self, layer, x, token_idx, expert_ids, weights, out, notify=None):
        """The layer's native ColdArgs pointed at these (already checked) tensors."""
        a = self._args[layer]
        if notify is not None:
            word, value = notify
            if word.dtype != torch.int32 or word.device.type != "cpu":
                raise ValueError("notify's word must be an int32 tensor in host memory")
            a.notify, a.notify_value = word.data_ptr(), int(value)
        a.x, a.x_dtype, a.T, a.x_stride = x.data_ptr(), _DTYPES[x.dtype], x.shape[0], x.stride(0)
        a.token_idx, a.expert_ids = token_idx.data_ptr(), expert_ids.data_ptr()
        a.weights, a.R = weights.data_ptr(), token_idx.shape[0]
        a.out, a.out_stride = out.data_ptr(), out.stride(0)
        return a

    def settle(self) -> None:
        """Wait for a pending call submitted with notify (its end goes to the GPU, not to a wait()):
        before anything else uses the pool (the next submit, the decode graph's worker)."""
        if self._pending is not None and self._notified:
            self.wait()

    def wait(self) -> torch.Tensor | None:
        """Blocks until the submitted call is done; returns its out (None if none pending)."""
        if self._pending is None:
            return None
        out = self._pending[-1]
        try:
            if self._native is not None:
                self._native.wait()
            else:
                self._future.result()
        finally:
            self._pending, self._future, self._notified = None, None, False
        return out

    def forward(self, layer, x, token_idx, expert_ids, weights, out=None) -> torch.Tensor:
        """Synchronous submit + wait; allocates out [T, D] fp32 if not given."""
        if out is None:
            out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32)
        self.submit(layer, x, token_idx, expert_ids, weights, out)
        self.wait()
        return out

    def ready(self) -> bool:
        """The submitted call has finished (wait() is still required)."""
        if self._pending is None:
            return True
        return self._native.ready() if self._native is not None else self._future.done()

    def set_isa(self, isa: str) -> None:
        """Caps the native path of later calls: "auto", "avx512", "avx512_bf16" or "amx"."""
        if isa not in ISAS:
            raise ValueError(f"isa must be one of {sorted(ISAS)}, not {isa!r}")
        if self._native is not None:
            reason = _native_unavailable(isa)
            if reason:
                raise RuntimeError(reason)
            for a in self._args.values():
                a.isa = ISAS[isa]

    @property
    def cpu_features(self) -> dict:
        """What the native kernels can use on this CPU ({} for the torch backend)."""
        return _extension().cpu_features() if self._native is not None else {}

    def reserve(self, max_routes: int, max_tokens: int) -> None:
        """Sizes the native workspace so that calls up to these sizes allocate nothing."""
        if self._native is not None:
            self.settle()
            E, D, F = (max(dims) for dims in zip(*(_dims(w) for w in self.layers.values())))
            tiles = any(a.amx_int8_min_tokens > 0 for a in self._args.values())
            self._native.reserve(max_routes, max_tokens, E, D, F, tiles)

    def read_seconds(self, buf: torch.Tensor) -> float:
        """Native: seconds for the pool's workers (and the calling thread) to read `buf` once, in 1
        MiB tasks (ColdExperts::read_seconds): the host read bandwidth the kernels can get."""
        if self._native is None:
            raise RuntimeError("read_seconds needs the native backend")
        self.settle()
        return self._native.read_seconds(buf.data_ptr(), buf.numel() * buf.element_size())

    def last_stats(self) -> dict:
        """Native: which ISA path the last call used and how many experts went to AMX."""
        return self._native.last_stats() if self._native is not None else {"isa": "torch"}

    def close(self) -> None:
        self.wait()
        self._native = None
        if self.backend == "torch":
            self._executor.shutdown()


def _dims(w: ExpertWeights | QuantExpertWeights) -> tuple[int, int, int]:
    """(E, D, F) of a layer's experts."""
    if isinstance(w, QuantExpertWeights):
        return w.num_experts, w.hidden, w.ffn
    return w.w13.shape[0], w.w13.shape[2], w.w2.shape[2]


def _as_weights(i, w) -> ExpertWeights | QuantExpertWeights:
    """A layer's experts as ExpertWeights or QuantExpertWeights; block types of a float GGUF
    type (BF16, F32 views; F16 copied to fp32 once) become ExpertWeights."""
    if isinstance(w, ExpertWeights) or (not isinstance(w, QuantExpertWeights) and len(w) == 2):
        return _fp32_biases(ExpertWeights(*w))
    q = _fp32_biases(QuantExpertWeights(*w))
    floats = (q.qt13 in _FLOAT_QTYPES, q.qt2 in _FLOAT_QTYPES)
    if floats == (False, False):
        for qt in (q.qt13, q.qt2):
            if qt not in QTYPE_CODES:
                formats.block_size(qt)  # ConfigError for a name Ostinato does not know
                raise ConfigError(f"layer {i}: the CPU experts compute {', '.join(QTYPE_CODES)} "
                                  f"and float types, not {qt}")
        return q
    if q.qt13 != q.qt2:
        raise ConfigError(f"layer {i}: gate/up are {q.qt13} and down is {q.qt2}; the CPU experts need both in "
                          "block formats or both in one float type (convert the layer to one of them at load)")
    dtype = _FLOAT_QTYPES[q.qt13]

    def as_float(t):
        v = t.contiguous().view(dtype)
        return v.float() if dtype == torch.float16 else v

    return ExpertWeights(as_float(q.w13), as_float(q.w2), q.b13, q.b2, q.act)


def _fp32_biases(w):
    """w with contiguous fp32 biases (the kernels' type), copied only when they are not (one missing:
    left for check_biases to name)."""
    if w.b13 is None or w.b2 is None or all(b.dtype == torch.float32 and b.is_contiguous()
                                            for b in (w.b13, w.b2)):
        return w
    return w._replace(b13=w.b13.float().contiguous(), b2=w.b2.float().contiguous())


def _checked_quant(i, w: QuantExpertWeights) -> QuantExpertWeights:
    if w.w13.dim() != 3 or w.w2.dim() != 3:
        raise ConfigError(f"layer {i}: quantized w13 and w2 must be 3-D byte stacks, got "
                          f"{tuple(w.w13.shape)} and {tuple(w.w2.shape)}")
    E, F2 = w.w13.shape[:2]
    D = w.w2.shape[1]
    want13, want2 = (E, F2, formats.row_bytes(w.qt13, D)), (E, D, formats.row_bytes(w.qt2, F2 // 2))
    if F2 % 2 or tuple(w.w13.shape) != want13 or tuple(w.w2.shape) != want2:
        raise ConfigError(f"layer {i}: {w.qt13} w13 {tuple(w.w13.shape)} and {w.qt2} w2 {tuple(w.w2.shape)} "
                          f"are not [E, 2F, row_bytes(qt13, D)] = {want13} and [E, D, row_bytes(qt2, F)] = {want2}")
    for name, t in (("w13", w.w13), ("w2", w.w2)):
        if t.dtype != torch.uint8 or t.device.type != "cpu":
            raise ConfigError(f"layer {i}: quantized {name} must be uint8 bytes on the CPU ({t.dtype}, {t.device})")
        if not t.is_contiguous():
            raise ConfigError(f"layer {i}: {name} is not contiguous; make it contiguous once at load time")
    return w


def _checked(i, w):
    w = _checked_quant(i, w) if isinstance(w, QuantExpertWeights) else _checked_float(i, w)
    E, D, F = _dims(w)
    try:
        check_biases(w, E, F, D, f"layer {i}")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return w


def _checked_float(i, w):
    E, F2, D = w.w13.shape
    if w.w2.shape != (E, D, F2 // 2) or F2 % 2:
        raise ValueError(f"layer {i}: w13 {tuple(w.w13.shape)} and w2 {tuple(w.w2.shape)} "
                         "are not [E, 2F, D] and [E, D, F]")
    for name, t in (("w13", w.w13), ("w2", w.w2)):
        if t.dtype not in _DTYPES or t.dtype != w.w13.dtype or t.device.type != "cpu":
            raise ValueError(f"layer {i}: {name} must be bf16 or fp32 on the CPU, like w13 ({t.dtype}, {t.device})")
        if not t.is_contiguous():
            raise ValueError(f"layer {i}: {name} is not contiguous; make it contiguous once at load time")
    return w


def _check_io(w, x: torch.Tensor, out: torch.Tensor) -> None:
    D = _dims(w)[1]
    xs, os_ = x.stride(), out.stride()
    if len(xs) != 2 or x.shape[1] != D or xs[1] != 1 or x.dtype not in _DTYPES or x.device.type != "cpu":
        raise ValueError(f"x must be [T, {D}] bf16/fp32 on the CPU with contiguous rows, "
                         f"got {tuple(x.shape)} {x.dtype} {x.device} strides {xs}")
    if (len(os_) != 2 or out.shape[1] != D or os_[1] != 1 or out.shape[0] < x.shape[0]
            or out.dtype != torch.float32 or out.device.type != "cpu"):
        raise ValueError(f"out must be [>= {x.shape[0]}, {D}] fp32 on the CPU with contiguous rows, "
                         f"got {tuple(out.shape)} {out.dtype} {out.device} strides {os_}")


def _is_vector(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and t.dim() == 1 and t.is_contiguous() and t.device.type == "cpu"


def _routes(token_idx, expert_ids, weights):
    """The routes as 1-D contiguous int32, int32, fp32 CPU tensors (copies only if needed)."""
    if not (_is_vector(token_idx, torch.int32) and _is_vector(expert_ids, torch.int32)
            and _is_vector(weights, torch.float32)):
        if not (token_idx.device.type == expert_ids.device.type == weights.device.type == "cpu"):
            raise ValueError("routes must be CPU tensors")
        token_idx = token_idx.reshape(-1).to(torch.int32).contiguous()
        expert_ids = expert_ids.reshape(-1).to(torch.int32).contiguous()
        weights = weights.reshape(-1).to(torch.float32).contiguous()
    if not token_idx.shape[0] == expert_ids.shape[0] == weights.shape[0]:
        raise ValueError(f"token_idx, expert_ids and weights must have one length, got "
                         f"{token_idx.shape[0]}, {expert_ids.shape[0]}, {weights.shape[0]}")
    return token_idx, expert_ids, weights


def _extension():
    from ostinato.kernels.cpu.build import load_cpu_extension

    return load_cpu_extension()


def _native_unavailable(isa: str) -> str | None:
    from ostinato.kernels.cpu.build import load_error

    ext = _extension()
    if ext is None:
        return load_error()
    feats = ext.cpu_features()
    if not feats["avx512"]:
        return "this CPU lacks AVX-512 (F, BW, VL)"
    if isa != "auto" and not feats[isa]:
        return f"this CPU does not support isa {isa!r} ({feats})"
    return None


def default_amx_quant_min_tokens() -> int:
    """The fewest routes of a quantized expert that send it to the AMX tiles, rows decoded to bf16
    (ColdArgs::amx_quant_min_tokens): OSTINATO_AMX_QUANT, default 0 (never: every route on the row
    kernels). A switch to measure the path in the engine, before and after in one process;
    scripts/bench_cpu_quant.py --amx-quant measures its break-even alone."""
    return env_count("OSTINATO_AMX_QUANT", 0, "routes")


def default_amx_int8_min_tokens(qtype: str | None = None) -> int:
    """The fewest routes of a quantized expert that send its Q4_K / Q6_K / MXFP4 projections to the AMX
    int8 tiles (ColdArgs::amx_int8_min_tokens): OSTINATO_AMX_INT8 (0: never), else AMX_INT8_MIN_TOKENS, or
    AMX_INT8_MIN_TOKENS_MXFP4 for a layer whose gate/up are MXFP4 (qtype)."""
    default = AMX_INT8_MIN_TOKENS_MXFP4 if qtype == "MXFP4" else AMX_INT8_MIN_TOKENS
    return env_count("OSTINATO_AMX_INT8", default, "routes")


def int8_tiles_by_default() -> bool:
    """Whether the native CPU experts put a quantized expert's larger groups of routes on the AMX int8
    tiles by default (OSTINATO_AMX_INT8 not 0, and this CPU has AMX-INT8 and the extension loads)."""
    if default_amx_int8_min_tokens() == 0:
        return False
    ext = _extension()
    return ext is not None and bool(ext.cpu_features()["amx_int8"])


def _quant_unavailable() -> str | None:
    if not _extension().cpu_features()["avx512_vnni"]:
        return "this CPU lacks AVX512_VNNI, which the quantized experts' kernels use"
    return None


def _layer_args(ext, w, isa: str, amx_min_tokens: int, amx_quant_min_tokens: int, amx_int8_min_tokens: int):
    a = ext.ColdArgs()
    a.w13, a.w2 = w.w13.data_ptr(), w.w2.data_ptr()
    if isinstance(w, QuantExpertWeights):
        a.qt13, a.qt2 = QTYPE_CODES[w.qt13], QTYPE_CODES[w.qt2]
    else:
        a.w_dtype = _DTYPES[w.w13.dtype]
    a.E, a.D, a.F = _dims(w)
    a.isa, a.amx_min_tokens, a.amx_quant_min_tokens = ISAS[isa], amx_min_tokens, amx_quant_min_tokens
    a.amx_int8_min_tokens = amx_int8_min_tokens
    a.act, a.act_alpha, a.act_limit = w.act.code, w.act.alpha, w.act.limit
    if w.b13 is not None:  # fp32 and contiguous (_fp32_biases), kept alive by the layer's weights
        a.b13, a.b2 = w.b13.data_ptr(), w.b2.data_ptr()
    return a
