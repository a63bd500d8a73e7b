"""Benchmark and tune the quantized-expert kernels of the GPU branch (layers/moe/gpu_quant.py) on CUDA.

Legend: T tokens, K routes per token, D hidden, F expert FFN size, E experts per layer,
N pool slots, L layers measured. Shapes are Qwen3-30B-A3B's (D=2048, F=768, K=8, E=128).
Each qtype gets a pool of random blocks (payload random, scales small) of L layers of E
experts plus K zero slots; consecutive calls use other layers, so one call's weights are not
in L2 from the one before.

- decode, T=1, all K routes hot: a CUDA graph of L layer calls; time per layer from CUDA
  events (median of replays); effective bandwidth = quantized bytes of the K experts read
  (w13 + w2) / time, against a measured device copy bandwidth.
- prefill, T=512 (--prefill-tokens), uniform routing, all routes hot: graph time, TFLOP/s = 2 T K 3 D F / time.
- the same for the bf16 kernels (gpu_experts) on a bf16 pool, as the baseline.
- prefill the other way, at T = 32, 64, 128, 192, 256, 512 and 2048 (--dequant-prefill): the engine's dequantized
  path (gpu_quant.slot_experts_dequant_triton: the pass's slots dequantized to bf16 in chunks,
  then the bf16 kernels) against the quantized kernels, both eager (the path syncs once a call):
  where the tuning's dequant_min_tokens should lie; with --tune, that threshold is written to the
  tuned file too (dequant_threshold).
- a correctness check per qtype: relative error against slot_experts_quant_torch.
- --tune (before the benchmark, which then runs with its result): sweeps decode_w13, then
  decode_w2 (the other held at its current value), then the prefill tile config of each token
  bucket (80, 320, 1000000: timed at T = 64, 256, 512), timing the sum of Q4_K_M's two pairs,
  Q4_K/Q4_K and Q4_K/Q6_K, as above (graph replays, layers cycled); configs that fail to
  compile or run are skipped and counted. Rounds per kernel: tiles near the current one's at
  its per-thread register load, then (decode) num_warps, then num_stages of the best so far
  (the *_candidates functions say what is pruned and why). The chosen configs must pass the
  oracle check (REL_ERR_BOUND) for every pair in CONFIGS (else the next fastest, else the
  default); then ostinato/kernels/tuned/moe_quant_<device>.json is written (a _meta block:
  device, versions, shapes, formats, sweep counts) and a default -> tuned line per kernel
  printed. --tune-budget-s stops the sweep (the best so far kept; each kernel's current
  config is always timed); the oracle check and the benchmark come after it (~1 minute more).
Prints a table; the last line is one JSON document. Usage:
  python scripts/bench_gpu_quant.py [--layers 8] [--qtypes Q4_K Q8_0 ...] [--no-bf16]
  python scripts/bench_gpu_quant.py --tune [--tune-budget-s 150] [--layers 8]
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ostinato.bench.report import source_state
from ostinato.layers.moe import gpu_experts as ge
from ostinato.layers.moe import gpu_quant as gq
from ostinato.quant import formats
from ostinato.planner.cost_model import one_switch
from scripts.bench_gpu_experts import copy_bandwidth, replay_times

D, F, K, E = 2048, 768, 8, 128
DECODE_T, PREFILL_T = 1, 512
# passes the dequantized path is timed at: from the smallest above the decode kernels' (8 tokens), so that
# its threshold can land wherever the two paths cross; 192 where the split with uploads may start
DEQUANT_SIZES = (32, 64, 128, 192, 256, PREFILL_T, 2048)
# (w13 qtype, w2 qtype): each format alone, and Q4_K_M's Q6_K-down layers
CONFIGS = [("Q8_0", "Q8_0"), ("Q4_K", "Q4_K"), ("Q5_K", "Q5_K"), ("Q6_K", "Q6_K"),
           ("MXFP4", "MXFP4"), ("Q4_K", "Q6_K")]
SCALE_FIELDS = {"Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "MXFP4": []}


def random_rows(shape, n, qtype):
    """uint8 [*shape, row_bytes] on the GPU: random payload, scales that keep |w| ~ 1/sqrt(n)."""
    q = torch.randint(0, 256, (*shape, formats.row_bytes(qtype, n)), dtype=torch.uint8,
                      device="cuda")
    blocks = q.view(-1, formats.block_bytes(qtype))
    if qtype == "MXFP4":
        blocks[:, 0] = 118
    for offset in SCALE_FIELDS[qtype]:
        d = torch.full((blocks.shape[0],), 2e-5, dtype=torch.float16, device="cuda")
        blocks[:, offset:offset + 2] = d.view(torch.uint8).view(-1, 2)
    return q


def make_pool(qtypes, layers):
    """w13, w2 of L*E + K slots; the last K are the zero slots (zero bytes)."""
    n = layers * E + K
    w13 = random_rows((n, 2 * F), D, qtypes[0])
    w2 = random_rows((n, D), F, qtypes[1])
    w13[n - K:] = 0
    w2[n - K:] = 0
    return w13, w2, n - K, n


def expert_bytes(qtypes):
    return 2 * F * formats.row_bytes(qtypes[0], D) + D * formats.row_bytes(qtypes[1], F)


def routing(layer, T):
    """slots[T, K] int32 of layer's experts (slots layer*E ..), weights[T, K]: all hot."""
    ids = torch.rand(T, E, device="cuda").argsort(dim=1)[:, :K]
    return (layer * E + ids).to(torch.int32), torch.softmax(torch.randn(T, K, device="cuda"), -1)


def graph_ms(fn, reps=30):
    """Median and p90 time of one replay of a graph holding fn."""
    times, _ = replay_times(fn, reps)
    return times[len(times) // 2], times[int(0.9 * (len(times) - 1))]


def bench_inputs(layers, T):
    """x[L, T, D], L layers' routes, out[L, T, D]: the inputs of bench's graph."""
    xs = torch.randn(layers, T, D, device="cuda").bfloat16()
    routes = [routing(layer, T) for layer in range(layers)]
    out = torch.empty(layers, T, D, dtype=torch.bfloat16, device="cuda")
    return xs, routes, out


def bench(forward, layers, T, inputs=None, reps=30):
    """Graph of one call per layer (other weights each call): median, p90 us per call."""
    xs, routes, out = inputs or bench_inputs(layers, T)

    def step():
        for layer, (slots, weights) in enumerate(routes):
            forward(xs[layer], slots, weights, out[layer])

    med, p90 = graph_ms(step, reps)
    return 1e3 * med / layers, 1e3 * p90 / layers


def quant_forward(pool, qtypes, tuning=None):
    """One layer call on pool; tuning None: the device's (gpu_quant.load_quant_tuning) with the
    dequantized path off: the quantized kernels' figures (and a graph can hold them)."""
    w13, w2, zero_lo, zero_hi = pool
    tuning = tuning or forced_tuning("prefill")

    def forward(x, slots, weights, out):
        gq.slot_experts_quant_triton(x, slots, weights, w13, w2, zero_lo, zero_hi, out,
                                     qtypes=qtypes, max_distinct=E, tuning=tuning)
    return forward


def check(pool, qtypes, tuning=None, tokens=(DECODE_T, 3, 200)):
    """Max relative error of decode and prefill against the torch path (dequantized fp32)."""
    w13, w2, zero_lo, zero_hi = pool
    errs = {}
    for T in tokens:
        x = torch.randn(T, D, device="cuda").bfloat16()
        slots, weights = routing(0, T)
        got = gq.slot_experts_quant_triton(x, slots, weights, w13, w2, zero_lo, zero_hi,
                                           qtypes=qtypes, max_distinct=E, tuning=tuning).float()
        want = gq.slot_experts_quant_torch(x, slots, weights, w13, w2, zero_lo, zero_hi,
                                           qtypes=qtypes, out_dtype=torch.float32)
        errs[T] = ((got - want).abs().max() / want.abs().max()).item()
    return errs


def run_config(qtypes, layers, copy_bw, prefill_t=PREFILL_T):
    pool = make_pool(qtypes, layers)
    errs = check(pool, qtypes)
    forward = quant_forward(pool, qtypes)
    dec_us, dec_p90 = bench(forward, layers, DECODE_T)
    pre_us, pre_p90 = bench(forward, layers, prefill_t)
    decode_bytes = K * expert_bytes(qtypes)
    gbps = decode_bytes / dec_us / 1e3
    return {"qtypes": list(qtypes), "expert_bytes": expert_bytes(qtypes), "rel_err": errs,
            "decode_us": dec_us, "decode_p90_us": dec_p90, "decode_GBps": gbps,
            "decode_bw_fraction": gbps / copy_bw, "prefill_us": pre_us, "prefill_p90_us": pre_p90,
            "prefill_tflops": 2 * prefill_t * K * 3 * D * F / pre_us / 1e6}


def eager_us(forward, layers, T, inputs, reps=10):
    """One call per layer as a pass issues them, without a graph (the dequantized path syncs once a
    call to find its slots): median us per call over reps rounds, timed by CUDA events."""
    xs, routes, out = inputs

    def step():
        for layer, (slots, weights) in enumerate(routes):
            forward(xs[layer], slots, weights, out[layer])

    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return 1e3 * sorted(times)[len(times) // 2] / layers


def run_dequant_prefill(qtypes, layers):
    """Prefill at DEQUANT_SIZES tokens, the quantized kernels against the engine's dequantized path
    (gpu_quant.slot_experts_dequant_triton: the pass's slots dequantized in chunks for the bf16
    kernels), both eager, us per layer call; and the tuning's threshold between them."""
    pool = make_pool(qtypes, layers)
    out = {}
    for T in DEQUANT_SIZES:
        inputs = bench_inputs(layers, T)
        quant = quant_forward(pool, qtypes, forced_tuning("prefill"))
        deq = quant_forward(pool, qtypes, forced_tuning("dequant"))
        q_us, d_us = eager_us(quant, layers, T, inputs), eager_us(deq, layers, T, inputs)
        x, (slots, weights) = inputs[0][0], inputs[1][0]
        want, got = torch.empty(T, D, dtype=torch.bfloat16, device="cuda"), torch.empty(T, D, dtype=torch.bfloat16,
                                                                                         device="cuda")
        quant(x, slots, weights, want)
        deq(x, slots, weights, got)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        out[T] = {"quant_us": q_us, "dequant_bf16_us": d_us, "speedup": q_us / d_us, "rel_diff": err}
    return {"qtypes": list(qtypes), "chunk": gq.DEQUANT_CHUNK,
            "dequant_min_tokens": gq.load_quant_tuning(ge.device_tag(torch.device("cuda")))["dequant_min_tokens"],
            "prefill": out}


def dequant_threshold(deq: list[dict]) -> int | None:
    """Where the dequantized path should start (the tuning's dequant_min_tokens): the planner's
    one-switch rule (cost_model.one_switch, as for Np) on the us of the formats (run_dequant_prefill's
    results) summed: the fewest tokens from which it is faster at every larger measured size; None
    where it is not faster at the largest size."""
    if not deq:
        return None
    sizes = sorted(set.intersection(*(set(r["prefill"]) for r in deq)))
    total = lambda key: [sum(r["prefill"][T][key] for r in deq) for T in sizes]  # noqa: E731
    return one_switch(sizes, total("quant_us"), total("dequant_bf16_us"))[0]


def forced_tuning(path):
    """The device's tuning with prefill's quantized kernels or the dequantized path for every large T."""
    tuning = copy.deepcopy(gq.load_quant_tuning(ge.device_tag(torch.device("cuda"))))
    tuning["dequant_min_tokens"] = 1 if path == "dequant" else None
    return tuning


def run_bf16(layers, copy_bw):
    n = layers * E + K
    w13 = torch.randn(n, 2 * F, D, device="cuda").mul_(0.02).bfloat16()
    w2 = torch.randn(n, D, F, device="cuda").mul_(0.02).bfloat16()
    w13[n - K:] = 0
    w2[n - K:] = 0

    def forward(x, slots, weights, out):
        ge.slot_experts_triton(x, slots, weights, w13, w2, n - K, n, out, max_distinct=E)

    dec_us, dec_p90 = bench(forward, layers, DECODE_T)
    pre_us, pre_p90 = bench(forward, layers, PREFILL_T)
    nbytes = 3 * D * F * 2
    gbps = K * nbytes / dec_us / 1e3
    return {"qtypes": ["BF16", "BF16"], "expert_bytes": nbytes, "decode_us": dec_us,
            "decode_p90_us": dec_p90, "decode_GBps": gbps, "decode_bw_fraction": gbps / copy_bw,
            "prefill_us": pre_us, "prefill_p90_us": pre_p90,
            "prefill_tflops": 2 * PREFILL_T * K * 3 * D * F / pre_us / 1e6}


# --- --tune: the sweep (plain functions: tests/test_quant_tuning.py runs them with fake times) ---

TUNE_FORMATS = [("Q4_K", "Q4_K"), ("Q4_K", "Q6_K")]  # Q4_K_M files: Q4_K, some layers' down Q6_K
TUNED_KEYS = ["decode_w13", "decode_w2", "prefill"]  # the rest keeps following the defaults
DECODE_KEYS = ("decode_w13", "decode_w2")
# The bf16 tuning's bucket of prefill chunks up to 80 tokens, which DEFAULT_QUANT_TUNING lacks
# (there 9..320 tokens share one config): tuned as well.
EXTRA_BUCKETS = ("80",)
# 1e-2: the bound of tests/test_moe_quant_triton.py for bf16 activations, on the same measure
# (max |got - want| / max |want|); the untuned kernels measure 2e-3 to 5e-3 here.
REL_ERR_BOUND = 1e-2
BLOCKS, GROUP_CHOICES = (1, 2, 4, 8, 16), (1, 2, 4, 8)
DECODE_WARPS, STAGES = (1, 2, 4, 8), (1, 2, 3)
PREFILL_BM, PREFILL_BN, PREFILL_WARPS = (16, 32, 64, 128), (32, 64, 128), (4, 8)
LANES = 16  # lanes per group of a tile (32 values: moe_quant's LANES)
MAX_PER_THREAD = 64  # fp32 accumulator (+ prefill's dequantized tile) values a thread holds
TILE_RANGE = 4  # decode tiles swept: within this factor of the current tile's values per step
PHASE_WEIGHTS = {"decode_w13": 1, "decode_w2": 2, "prefill": 3}  # ~ their compiles (1, 2, 3 each)
CHECK_TRIES = 3  # the fastest configs of a kernel tried against the oracle before its default


def next_pow2(n):
    return 1 << max(0, math.ceil(n) - 1).bit_length()


def cfg_key(cfg):
    return tuple(sorted(cfg.items()))


def distance(a, b):
    """Sum of |log2| ratios over a's fields: how far config a is from b."""
    return sum(abs(math.log2(a[k] / b[k])) for k in a)


@dataclass(frozen=True)
class DecodeSpec:
    """A decode kernel's tile [rows * block, GROUPS, LANES] stepping over n_groups groups."""
    block: str  # "BLOCK_F" (w13) or "BLOCK_D" (w2)
    n_block: int  # the output rows the block runs over (F or D)
    n_groups: int  # 32-value groups along the input (D / 32 or F / 32)
    rows: int  # tile rows per block row: 1, or w2's KP routes of a token at once
    accs: int  # fp32 accumulators of the tile's shape (w13: gate and up)


def decode_spec(key, d=D, f=F, k=K):
    if key == "decode_w13":
        return DecodeSpec("BLOCK_F", f, d // 32, 1, 2)
    return DecodeSpec("BLOCK_D", d, f // 32, next_pow2(k), 1)


def decode_elements(cfg, spec):
    return spec.rows * cfg[spec.block] * cfg["GROUPS"] * LANES


def decode_per_thread(cfg, spec):
    return spec.accs * decode_elements(cfg, spec) / (32 * cfg["num_warps"])


def decode_feasible(cfg, spec):
    """Not pruned: a block within the rows, GROUPS dividing the groups (no masked steps), a
    lane for every thread (fewer: replicated warps, redundant with fewer warps), registers
    within MAX_PER_THREAD, no more pipeline stages than loop steps."""
    g = cfg["GROUPS"]
    return (cfg[spec.block] <= spec.n_block and spec.n_groups % g == 0
            and decode_elements(cfg, spec) >= 32 * cfg["num_warps"]
            and decode_per_thread(cfg, spec) <= MAX_PER_THREAD
            and cfg["num_stages"] <= spec.n_groups // g)


def decode_shape_candidates(current, spec):
    """Round 1: (block, GROUPS) tiles within TILE_RANGE of the current tile, num_warps scaled
    with the tile (the current per-thread load), the current num_stages; nearest tiles first."""
    tile = current[spec.block] * current["GROUPS"]
    out = []
    for b, g in itertools.product(BLOCKS, GROUP_CHOICES):
        ratio = b * g / tile
        if not 1 / TILE_RANGE <= ratio <= TILE_RANGE or spec.n_groups % g:
            continue
        nw = min(max(2 ** round(math.log2(current["num_warps"] * ratio)), 1), max(DECODE_WARPS))
        cfg = {spec.block: b, "GROUPS": g, "num_warps": nw,
               "num_stages": min(current["num_stages"], spec.n_groups // g)}
        if decode_feasible(cfg, spec):
            out.append((abs(math.log2(ratio)), -b, cfg))
    return [cfg for *_, cfg in sorted(out, key=lambda t: t[:2])]


def decode_warp_candidates(best, spec):
    """Round 2: the best tile with the other num_warps."""
    return [c for c in (dict(best, num_warps=nw) for nw in DECODE_WARPS)
            if c != best and decode_feasible(c, spec)]


def decode_stage_candidates(best, spec):
    """Round 3: the best config with the other num_stages."""
    return [c for c in (dict(best, num_stages=s) for s in STAGES)
            if c != best and decode_feasible(c, spec)]


def prefill_bm_cap(T, k=K, e=E):
    """Twice the routes an expert gets at T (uniform routing), at least 16: a larger BLOCK_M
    only pads (each expert's routes fit in one block already)."""
    return max(16, next_pow2(2 * T * k / e))


def prefill_tile_per_thread(cfg):
    """Dequantized weight values (lo and hi tiles [G*16, BLOCK_N], fp32) per thread."""
    return 2 * cfg["GROUPS"] * LANES * cfg["BLOCK_N"] / (32 * cfg["num_warps"])


def prefill_acc_per_thread(cfg):
    """Accumulator values per thread of _prefill_w13_kernel (gate and up [BLOCK_M, BLOCK_N])."""
    return 2 * cfg["BLOCK_M"] * cfg["BLOCK_N"] / (32 * cfg["num_warps"])


def prefill_feasible(cfg, T, d=D, f=F, k=K, e=E):
    """Not pruned: BLOCK_M up to prefill_bm_cap, BLOCK_N within D and F, GROUPS dividing D/32
    and F/32 (both kernels step by it), accumulators plus the dequantized tile within
    MAX_PER_THREAD values per thread."""
    g = cfg["GROUPS"]
    return (cfg["BLOCK_M"] <= prefill_bm_cap(T, k, e) and cfg["BLOCK_N"] <= min(d, f)
            and (d // 32) % g == 0 and (f // 32) % g == 0
            and prefill_acc_per_thread(cfg) + prefill_tile_per_thread(cfg) <= MAX_PER_THREAD)


def prefill_shape_candidates(current, T, d=D, f=F, k=K, e=E):
    """Round 1 of a bucket: (BLOCK_M, BLOCK_N, GROUPS, num_warps) whose dequantized tile per
    thread is the current config's (its register budget), the current num_stages; nearest
    to the current config first."""
    want = prefill_tile_per_thread(current)
    out = []
    for bm, bn, g, nw in itertools.product(PREFILL_BM, PREFILL_BN, GROUP_CHOICES, PREFILL_WARPS):
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "GROUPS": g, "num_warps": nw,
               "num_stages": current["num_stages"]}
        if prefill_tile_per_thread(cfg) == want and prefill_feasible(cfg, T, d, f, k, e):
            out.append((distance(cfg, current), cfg))
    return [cfg for _, cfg in sorted(out, key=lambda t: t[0])]


def prefill_stage_candidates(best, T, d=D, f=F, k=K, e=E):
    """Round 2 of a bucket: its best config with the other num_stages."""
    return [c for c in (dict(best, num_stages=s) for s in STAGES)
            if c != best and prefill_feasible(c, T, d, f, k, e)]


def config_major(per_key):
    """(key, cfg) items config by config, each for every key it is a candidate of (one compile
    serves them all, and a budget stop leaves the keys with the same configs timed); configs
    in the order of their best rank in any key's list."""
    order = {}
    for key, cands in per_key.items():
        for rank, cfg in enumerate(cands):
            best, _, keys = order.get(cfg_key(cfg), (rank, cfg, []))
            order[cfg_key(cfg)] = (min(best, rank), cfg, keys + [key])
    return [(key, cfg) for _, cfg, keys in sorted(order.values(), key=lambda t: t[0])
            for key in keys]


def bucket_tokens(bound, prefill_t=PREFILL_T):
    """The T a prefill bucket is timed at: the largest power of two <= its bound, at most
    prefill_t (80 -> 64, 320 -> 256, 1000000 -> 512)."""
    return min(prefill_t, 1 << (int(bound).bit_length() - 1))


def tune_buckets(base):
    """The prefill buckets tuned: the defaults' and EXTRA_BUCKETS, those whose T is prefill's."""
    bounds = sorted(set(base["prefill"]) | set(EXTRA_BUCKETS), key=int)
    return [b for b in bounds if bucket_tokens(b) > base["decode_max_tokens"]]


class Budget:
    """A deadline for the whole sweep, shared out among its phases."""

    def __init__(self, seconds, clock=time.monotonic):
        self.clock = clock
        self.end = clock() + seconds

    def deadline(self, weight, weights_left):
        """A phase's deadline: its weight's share of the time left (unused time rolls on)."""
        now = self.clock()
        return now + max(0.0, self.end - now) * weight / weights_left


class Sweep:
    """Times of candidate configs per tuning key, from time_fn(key, cfg) -> us.

    A config that raises (does not compile, does not fit, fails at run time) or gives no
    finite positive time is skipped, counted in failed and never chosen; a config failed once
    is not tried for another key (the same kernels). Past the deadline, candidates are left
    untimed (counted) unless forced; each is timed at most once per key.
    """

    def __init__(self, time_fn, clock=time.monotonic, log=print, label=str):
        self.time_fn, self.clock, self.log, self.label = time_fn, clock, log, label
        self.deadline = math.inf
        self.times: dict = {}  # key -> {cfg_key: (us, cfg)}
        self.failed: dict = {}  # cfg_key -> reason
        self.untimed = 0

    def run(self, items, force=False):
        for key, cfg in items:
            k = cfg_key(cfg)
            if k in self.times.get(key, {}) or k in self.failed:
                continue
            if not force and self.clock() >= self.deadline:
                self.untimed += 1
                continue
            try:
                us = float(self.time_fn(key, cfg))
                if not (math.isfinite(us) and us > 0):
                    raise ValueError(f"time {us}")
            except Exception as exc:  # a tile that does not fit (shared memory, registers)
                self.failed[k] = f"{type(exc).__name__}: {str(exc)[:120]}"
                self.log(f"  {self.label(key)} {cfg}: skipped ({self.failed[k]})")
                continue
            self.times.setdefault(key, {})[k] = (us, dict(cfg))
            self.log(f"  {self.label(key)} {cfg}: {us:.1f} us")

    def ranked(self, key):
        """The configs timed for key, fastest first (ties: the earlier timed)."""
        return [cfg for _, cfg in sorted(self.times.get(key, {}).values(), key=lambda t: t[0])]

    def best(self, key):
        ranked = self.ranked(key)
        return ranked[0] if ranked else None

    def time_of(self, key, cfg):
        entry = self.times.get(key, {}).get(cfg_key(cfg))
        return entry[0] if entry else None

    def counts(self):
        return {"timed": sum(len(v) for v in self.times.values()), "failed": len(self.failed),
                "untimed": self.untimed}


def prefill_trial(tuning, cfg):
    """tuning with cfg for every prefill T."""
    return dict(tuning, prefill={"1000000": dict(cfg)})


def tune_configs(time_fn, base, budget, buckets, d=D, f=F, k=K, e=E, clock=time.monotonic,
                 log=print):
    """The sweep from base (a complete tuning): decode_w13, then decode_w2 (the other at its
    current value), then each bucket's prefill config; time_fn(tuning, T) -> us of a complete
    trial tuning at T tokens. Returns the Sweep and the fastest tuning (unchecked)."""
    tuning = copy.deepcopy(base)
    tokens = {b: bucket_tokens(b) for b in buckets}

    def trial(key, cfg):
        if key in DECODE_KEYS:
            return time_fn(dict(tuning, **{key: dict(cfg)}), DECODE_T)
        return time_fn(prefill_trial(tuning, cfg), tokens[key])

    sweep = Sweep(trial, clock, log,
                  label=lambda key: key if key in DECODE_KEYS else f"prefill<={key}")
    weights_left = sum(PHASE_WEIGHTS.values())
    for key in DECODE_KEYS:
        sweep.deadline = budget.deadline(PHASE_WEIGHTS[key], weights_left)
        weights_left -= PHASE_WEIGHTS[key]
        spec, current = decode_spec(key, d, f, k), tuning[key]
        log(f"{key}: from {current}")
        sweep.run([(key, current)], force=True)  # the baseline, whatever the budget
        sweep.run([(key, c) for c in decode_shape_candidates(current, spec)])
        for candidates in (decode_warp_candidates, decode_stage_candidates):
            sweep.run([(key, c) for c in candidates(sweep.best(key) or current, spec)])
        tuning[key] = sweep.best(key) or current
    sweep.deadline = budget.deadline(PHASE_WEIGHTS["prefill"], weights_left)
    current = {b: gq.prefill_config(base, T, torch.bfloat16) for b, T in tokens.items()}
    log(f"prefill buckets {tokens}: from {current}")
    sweep.run([(b, current[b]) for b in buckets], force=True)
    sweep.run(config_major({b: prefill_shape_candidates(current[b], T, d, f, k, e)
                            for b, T in tokens.items()}))
    sweep.run(config_major({b: prefill_stage_candidates(sweep.best(b) or current[b], T, d, f, k, e)
                            for b, T in reversed(list(tokens.items()))}))
    tuning["prefill"] = {b: sweep.best(b) or current[b] for b in buckets}
    return sweep, tuning


def first_passing(ranked, passes, tries=CHECK_TRIES):
    """The first of the first tries configs in ranked that passes(cfg); None if none does."""
    return next((cfg for cfg in ranked[:tries] if passes(cfg)), None)


def checked_tuning(base, sweep, passes, buckets, tries=CHECK_TRIES, log=print):
    """Per kernel, the fastest of the sweep's configs that passes(tuning, tokens) (the oracle
    check at the T the kernel serves), trying tries of them; else the kernel's default."""
    tuning = copy.deepcopy(base)
    for key in DECODE_KEYS:
        cfg = first_passing(sweep.ranked(key),
                            lambda c: passes(dict(tuning, **{key: c}), (DECODE_T, 3)), tries)
        if cfg is None:
            log(f"  {key}: none of the fastest {tries} passed the check: the default kept")
        tuning[key] = dict(cfg or base[key])
    prefill = {}
    for b in buckets:
        T = bucket_tokens(b)
        cfg = first_passing(sweep.ranked(b), lambda c: passes(prefill_trial(tuning, c), (T,)),
                            tries)
        if cfg is None:
            log(f"  prefill <= {b}: none of the fastest {tries} passed the check: the default kept")
        prefill[b] = dict(cfg or gq.prefill_config(base, T, torch.bfloat16))
    tuning["prefill"] = prefill
    return tuning


def before_after(base, tuning, sweep, buckets):
    """(kernel, T, default us, tuned us, tuned config) from the sweep's times."""
    rows = [(key, DECODE_T, sweep.time_of(key, base[key]), sweep.time_of(key, tuning[key]),
             tuning[key]) for key in DECODE_KEYS]
    for b in buckets:
        T = bucket_tokens(b)
        default = gq.prefill_config(base, T, torch.bfloat16)
        rows.append((f"prefill<={b}", T, sweep.time_of(b, default),
                     sweep.time_of(b, tuning["prefill"][b]), tuning["prefill"][b]))
    return rows


def format_before_after(rows):
    def us(v):
        return "n/a" if v is None else f"{v:.1f}"

    lines = ["default -> tuned, us per layer call, Q4_K/Q4_K + Q4_K/Q6_K "
             "(decode_w2's default timed with the tuned decode_w13):"]
    for name, T, before, after, cfg in rows:
        gain = f" ({before / after:.2f}x)" if before and after else ""
        lines.append(f"  {name:16s} T={T:<4d} {us(before):>8s} -> {us(after):>8s}{gain}  {cfg}")
    return lines


def write_quant_tuning(tuning, tag, meta, keys=TUNED_KEYS, meta_key="_meta"):
    """gpu_quant.quant_tuned_path(tag) with meta (under meta_key, with the commit of the kernels tuned: a report
    names it, gpu_quant.quant_tuning_source) and tuning's `keys`, the file's other entries kept (the dense
    matvec's, scripts/bench_quant_linear.py); clears the loaded tunings."""
    path = gq.quant_tuned_path(tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc |= {meta_key: {**meta, **source_state()}, **{key: tuning[key] for key in keys}}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    gq.clear_quant_tuning_cache()
    return path, doc


class TuneRig:
    """The pools of the timed formats (L layers) and fixed inputs per T: time of a tuning."""

    def __init__(self, layers, formats_, tokens):
        self.layers = layers
        self.pools = {qtypes: make_pool(qtypes, layers) for qtypes in formats_}
        self.inputs = {T: bench_inputs(layers, T) for T in tokens}

    def us(self, tuning, T):
        """Sum over the formats of bench's median us per layer call (decode 30, prefill 10
        replays)."""
        reps = 30 if T <= tuning["decode_max_tokens"] else 10
        tuning = dict(tuning, dequant_min_tokens=None)  # the quantized kernels, captured
        return sum(bench(quant_forward(pool, qtypes, tuning), self.layers, T, self.inputs[T],
                         reps)[0] for qtypes, pool in self.pools.items())


class OracleCheck:
    """check() of a tuning for every pair in configs (pools of one layer): all under the bound."""

    def __init__(self, configs, bound=REL_ERR_BOUND, log=print):
        self.pools = {qtypes: make_pool(qtypes, 1) for qtypes in configs}
        self.bound, self.log = bound, log

    def passes(self, tuning, tokens):
        worst = {}
        for qtypes, pool in self.pools.items():
            try:
                errs = check(pool, qtypes, tuning, tokens)
            except Exception as exc:
                self.log(f"  check {'/'.join(qtypes)} T={tokens}: {type(exc).__name__}: {exc}")
                return False
            worst["/".join(qtypes)] = max(errs.values())
        ok = all(v < self.bound for v in worst.values())  # a NaN fails
        self.log(f"  check T={list(tokens)} {'ok' if ok else 'FAILED'}: max rel err "
                 + " ".join(f"{k} {v:.1e}" for k, v in worst.items()))
        return ok


def run_tune(layers, budget_s, log=print):
    """Sweep, check, write on the current CUDA device; returns the summary for the JSON."""
    import triton

    tag = ge.device_tag(torch.device("cuda"))
    base = gq.default_quant_tuning(tag)
    buckets = tune_buckets(base)
    t0 = time.monotonic()
    rig = TuneRig(layers, TUNE_FORMATS, [DECODE_T] + [bucket_tokens(b) for b in buckets])
    sweep, _ = tune_configs(rig.us, base, Budget(budget_s), buckets, log=log)
    sweep_s = time.monotonic() - t0
    counts = sweep.counts()
    log(f"sweep: {counts['timed']} timed, {counts['failed']} failed (skipped), "
        f"{counts['untimed']} left untimed by the budget, {sweep_s:.0f} s")
    del rig
    torch.cuda.empty_cache()
    log(f"oracle check of the chosen configs, every pair of {CONFIGS} (bound {REL_ERR_BOUND}):")
    oracle = OracleCheck(CONFIGS, log=log)
    tuning = checked_tuning(base, sweep, oracle.passes, buckets, log=log)
    del oracle
    torch.cuda.empty_cache()
    rows = before_after(base, tuning, sweep, buckets)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__,
            "shapes": {"D": D, "F": F, "K": K, "E": E, "layers": layers, "decode_T": DECODE_T,
                       "prefill_T": {b: bucket_tokens(b) for b in buckets}},
            "formats": [list(q) for q in TUNE_FORMATS],
            "checked": {"pairs": [list(q) for q in CONFIGS], "rel_err_bound": REL_ERR_BOUND},
            "sweep": {**counts, "failures": sorted(set(sweep.failed.values())),
                      "budget_s": budget_s, "seconds": round(sweep_s, 1)},
            "us": {name: {"T": T, "default": before, "tuned": after}
                   for name, T, before, after, _ in rows},
            "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "by": "scripts/bench_gpu_quant.py --tune"}
    path, doc = write_quant_tuning(tuning, tag, meta)
    lines = format_before_after(rows)
    log("\n".join([f"wrote {path} ({time.monotonic() - t0:.0f} s)", *lines]))
    return {"file": str(path), "written": doc, "before_after": lines}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="layers of E experts in each pool")
    parser.add_argument("--qtypes", nargs="*", default=None,
                        help="w13 qtypes to run (w2 the same); default: every config")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 baseline")
    parser.add_argument("--prefill-tokens", type=int, default=PREFILL_T,
                        help="T of the prefill timing (a captured tool turn's pass: 256; its tile config is the "
                             "bucket's that holds T)")
    parser.add_argument("--dequant-prefill", action="store_true",
                        help="also time prefill as dequantize-then-bf16 against the quantized kernels")
    parser.add_argument("--tune", action="store_true",
                        help="sweep the block sizes first, write "
                             "kernels/tuned/moe_quant_<device>.json, then benchmark with it")
    parser.add_argument("--tune-budget-s", type=float, default=150.0,
                        help="stop the sweep after this many seconds, keeping the best so far "
                             "(the check and the benchmark follow)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    import triton

    torch.manual_seed(0)
    t0 = time.time()
    copy_bw = copy_bandwidth()
    configs = CONFIGS if args.qtypes is None else [(q, q) for q in args.qtypes]
    print(f"device {torch.cuda.get_device_name()}, {args.layers} layers of {E} experts, "
          f"copy bandwidth {copy_bw:.0f} GB/s")
    tuned = None
    if args.tune:
        tuned = run_tune(args.layers, args.tune_budget_s)
        gq.clear_quant_tuning_cache()  # the benchmark below runs with the file just written
        torch.manual_seed(0)  # and on the pools a plain run makes
    rows = []
    for qtypes in configs:  # each pool is freed before the next one is made
        rows.append(run_config(qtypes, args.layers, copy_bw, args.prefill_tokens))
        torch.cuda.empty_cache()
    if not args.no_bf16:
        rows.append(run_bf16(args.layers, copy_bw))
    print(f"\n{'w13/w2':12s} {'MB/exp':>7s} {'dec us':>7s} {'GB/s':>6s} {'of bw':>6s} "
          f"{'pre us':>8s} {'TFLOP/s':>8s}  rel err")
    for r in rows:
        err = " ".join(f"{v:.1e}" for v in r.get("rel_err", {}).values())
        print(f"{'/'.join(r['qtypes']):12s} {r['expert_bytes'] / 1e6:7.2f} {r['decode_us']:7.1f} "
              f"{r['decode_GBps']:6.0f} {r['decode_bw_fraction']:6.2f} {r['prefill_us']:8.1f} "
              f"{r['prefill_tflops']:8.1f}  {err}")
    deq = []
    if args.dequant_prefill:
        for qtypes in TUNE_FORMATS:  # Q4_K_M's two pairs
            deq.append(run_dequant_prefill(qtypes, args.layers))
            torch.cuda.empty_cache()
        print(f"\nprefill, us per layer call, eager: quantized kernels -> the dequantized path (chunks of "
              f"{gq.DEQUANT_CHUNK} experts, then the bf16 kernels)")
        for r in deq:
            for T, v in r["prefill"].items():
                print(f"  {'/'.join(r['qtypes']):10s} T={T:4d} {v['quant_us']:8.1f} -> {v['dequant_bf16_us']:8.1f} "
                      f"({v['speedup']:.2f}x; outputs apart by {v['rel_diff']:.1e})")
    if tuned is not None and deq:  # the threshold between the two paths, measured: into the tuned file
        threshold = dequant_threshold(deq)
        path, _ = write_quant_tuning({"dequant_min_tokens": threshold}, ge.device_tag(torch.device("cuda")),
                                     {"by": "scripts/bench_gpu_quant.py --tune --dequant-prefill",
                                      "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                      "rule": "the fewest tokens from which the dequantized path is faster at "
                                              "every larger measured size too"},
                                     keys=("dequant_min_tokens",), meta_key="_meta_dequant")
        tuned["dequant_min_tokens"] = threshold
        print(f"\ndequant_min_tokens -> {threshold} ({path})")
    if tuned is not None:
        print("\n" + "\n".join(tuned["before_after"]))
    result = {"bench": "gpu_quant", **source_state(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__,
              "shapes": {"D": D, "F": F, "K": K, "E": E, "layers": args.layers,
                         "decode_T": DECODE_T, "prefill_T": args.prefill_tokens},
              "tuning": gq.load_quant_tuning(ge.device_tag(torch.device("cuda"))),
              "copy_GBps": copy_bw, "results": rows, "dequant_prefill": deq, "seconds": time.time() - t0}
    if tuned is not None:
        result["tune"] = tuned
    print(json.dumps(result))


if __name__ == "__main__":
    main()
