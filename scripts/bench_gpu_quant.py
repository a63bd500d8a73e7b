"""Benchmark the quantized-expert kernels of the GPU branch (layers/moe/gpu_quant.py) on CUDA.

Legend: T tokens, K routes per token, D hidden, F expert FFN size, E experts per layer,
N pool slots, L layers measured. Shapes are Qwen3-30B-A3B's (D=2048, F=768, K=8, E=128).
Each qtype gets a pool of random blocks (payload random, scales small) of L layers of E
experts plus K zero slots; consecutive calls use other layers, so one call's weights are not
in L2 from the one before.

- decode, T=1, all K routes hot: a CUDA graph of L layer calls; time per layer from CUDA
  events (median of replays); effective bandwidth = quantized bytes of the K experts read
  (w13 + w2) / time, against a measured device copy bandwidth.
- prefill, T=512, uniform routing, all routes hot: graph time, TFLOP/s = 2 T K 3 D F / time.
- the same for the bf16 kernels (gpu_experts) on a bf16 pool, as the baseline.
- a correctness check per qtype: relative error against slot_experts_quant_torch.
Prints a table; the last line is one JSON document. Usage:
  python scripts/bench_gpu_quant.py [--layers 8] [--qtypes Q4_K Q8_0 ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ostinato.bench.report import source_state
from ostinato.layers.moe import gpu_experts as ge
from ostinato.layers.moe import gpu_quant as gq
from ostinato.quant import formats
from scripts.bench_gpu_experts import copy_bandwidth, replay_times

D, F, K, E = 2048, 768, 8, 128
DECODE_T, PREFILL_T = 1, 512
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


def bench(forward, layers, T):
    """Graph of one call per layer (other weights each call): median, p90 us per call."""
    xs = torch.randn(layers, T, D, device="cuda").bfloat16()
    routes = [routing(layer, T) for layer in range(layers)]
    out = torch.empty(layers, T, D, dtype=torch.bfloat16, device="cuda")

    def step():
        for layer, (slots, weights) in enumerate(routes):
            forward(xs[layer], slots, weights, out[layer])

    med, p90 = graph_ms(step)
    return 1e3 * med / layers, 1e3 * p90 / layers


def quant_forward(pool, qtypes):
    w13, w2, zero_lo, zero_hi = pool

    def forward(x, slots, weights, out):
        gq.slot_experts_quant_triton(x, slots, weights, w13, w2, zero_lo, zero_hi, out,
                                     qtypes=qtypes, max_distinct=E)
    return forward


def check(pool, qtypes):
    """Max relative error of decode and prefill against the torch path (dequantized fp32)."""
    w13, w2, zero_lo, zero_hi = pool
    errs = {}
    for T in (DECODE_T, 3, 200):
        x = torch.randn(T, D, device="cuda").bfloat16()
        slots, weights = routing(0, T)
        got = gq.slot_experts_quant_triton(x, slots, weights, w13, w2, zero_lo, zero_hi,
                                           qtypes=qtypes, max_distinct=E).float()
        want = gq.slot_experts_quant_torch(x, slots, weights, w13, w2, zero_lo, zero_hi,
                                           qtypes=qtypes, out_dtype=torch.float32)
        errs[T] = ((got - want).abs().max() / want.abs().max()).item()
    return errs


def run_config(qtypes, layers, copy_bw):
    pool = make_pool(qtypes, layers)
    errs = check(pool, qtypes)
    forward = quant_forward(pool, qtypes)
    dec_us, dec_p90 = bench(forward, layers, DECODE_T)
    pre_us, pre_p90 = bench(forward, layers, PREFILL_T)
    decode_bytes = K * expert_bytes(qtypes)
    gbps = decode_bytes / dec_us / 1e3
    return {"qtypes": list(qtypes), "expert_bytes": expert_bytes(qtypes), "rel_err": errs,
            "decode_us": dec_us, "decode_p90_us": dec_p90, "decode_GBps": gbps,
            "decode_bw_fraction": gbps / copy_bw, "prefill_us": pre_us, "prefill_p90_us": pre_p90,
            "prefill_tflops": 2 * PREFILL_T * K * 3 * D * F / pre_us / 1e6}


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="layers of E experts in each pool")
    parser.add_argument("--qtypes", nargs="*", default=None,
                        help="w13 qtypes to run (w2 the same); default: every config")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 baseline")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    import triton

    torch.manual_seed(0)
    t0 = time.time()
    copy_bw = copy_bandwidth()
    configs = CONFIGS if args.qtypes is None else [(q, q) for q in args.qtypes]
    print(f"device {torch.cuda.get_device_name()}, {args.layers} layers of {E} experts, "
          f"copy bandwidth {copy_bw:.0f} GB/s")
    rows = []
    for qtypes in configs:  # each pool is freed before the next one is made
        rows.append(run_config(qtypes, args.layers, copy_bw))
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
    result = {"bench": "gpu_quant", **source_state(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__,
              "shapes": {"D": D, "F": F, "K": K, "E": E, "layers": args.layers,
                         "decode_T": DECODE_T, "prefill_T": PREFILL_T},
              "tuning": gq.load_quant_tuning(ge.device_tag(torch.device("cuda"))),
              "copy_GBps": copy_bw, "results": rows, "seconds": time.time() - t0}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
