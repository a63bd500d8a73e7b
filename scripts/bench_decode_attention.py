"""Benchmark the split-K decode attention kernel against the masked SDPA call it replaces.

Legend: H query heads, Hkv KV heads, Dk / Dv key and value widths, W window, c context (cached
tokens with the new one), L layers measured. Shapes (--shape): Qwen3-30B-A3B's by default, H=32,
Hkv=4, Dk=Dv=128, 48 layers a decode step; deepseek-v3, MLA in the latent space as
models/deepseek_v3.py attends a window: H=128 query rows of one KV head, the latent cache row
[c | kr] of Dk=576 its key and its first Dv=512 columns its value (a view, read in place), 61
layers. bf16.

For each context c the window is the decode graph's: the next power of two >= c (at least
1024), and the position c - 1 (the token being decoded). Per method, a CUDA graph of L
attention calls, each over its own layer's cache (so one call's K and V are not in L2 from
the one before), replayed with CUDA events; us = replay time / L, the time of one layer's
attention in a captured decode step (the KV writes, the same for all methods, excluded).
- kernel: kernels/triton/decode_attention.decode_attention (what _decode_window runs on CUDA).
- sdpa: _decode_window's former CUDA call, q [1, Hkv, G, Dk] with the [1, W] bool mask (for
  deepseek-v3, MLAttention._attend_latent's call: its former windowed decode).
- sdpa_gqa: the form before it, q [1, H, 1, Dk] with enable_gqa (the 2.2 ms per 1k tokens
  per step of results/2026-11-29-h200x2/).
--tokens T > 1 times a short prefill pass's attention instead (PassGraphs: T tokens at c - T ..
c - 1 over a window of --window keys, the runner's max context, default 8292) against the host-driven
pass's call, models/common.causal_attention over the c valid keys (SDPA's fused kernels, enable_gqa;
Qwen3's shape: MLA's host-driven pass attends expanded heads, not timed here).
The masks are computed once per graph, as DecodeWindow.refresh does once per pass. GB/s:
the cache bytes of the c valid keys (K and V; MLA's row once) over the kernel's time. --sweep
also times block and split variants of the kernel per context. Prints a table; the last line
is one JSON document.
Usage: python scripts/bench_decode_attention.py [--shape deepseek-v3] [--contexts 1024 4096 8192 16384] [--sweep]
       python scripts/bench_decode_attention.py --tokens 64 [--window 8292] [--contexts 4096]
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ostinato.bench.report import source_state  # noqa: E402
from scripts.bench_gpu_experts import replay_times  # noqa: E402

SHAPES = {  # H, Hkv, Dk, Dv, layers of a decode step (for the per-step column)
    "qwen3-30b-a3b": dict(H=32, Hkv=4, Dk=128, Dv=128, layers=48),
    "deepseek-v3": dict(H=128, Hkv=1, Dk=576, Dv=512, layers=61),
}


def window_for(context: int) -> int:
    w = 1024
    while w < context:
        w *= 2
    return w


def graph_us(calls, reps: int, per: int) -> float:
    """Median replay time of one graph holding `calls` (in order), over `per`, in us."""
    times, graph = replay_times(lambda: [call() for call in calls], reps)
    del graph
    return 1e3 * statistics.median(times) / per


class Rig:
    """L layers' caches k [W, Hkv, Dk] and v [W, Hkv, Dv] (bf16; Dv < Dk: v the first Dv columns
    of k, as MLA's latent cache), one query per layer, the position on the device."""

    def __init__(self, shape: dict, window: int, context: int, layers: int, tokens: int = 1):
        self.window, self.layers, self.context, self.tokens = window, layers, context, tokens
        self.h, self.hkv, self.dk, self.dv = shape["H"], shape["Hkv"], shape["Dk"], shape["Dv"]
        self.k = [torch.randn(window, self.hkv, self.dk, device="cuda").bfloat16() for _ in range(layers)]
        if self.dv < self.dk:
            self.v = [k[..., :self.dv] for k in self.k]
        else:
            self.v = [torch.randn(window, self.hkv, self.dv, device="cuda").bfloat16() for _ in range(layers)]
        self.q = [torch.randn(tokens, self.h, self.dk, device="cuda").bfloat16() for _ in range(layers)]
        self.position = torch.tensor([context - tokens], device="cuda")  # the first token's
        self.cols = torch.arange(window, device="cuda")[None, :]
        self.mask = None

    def kernel_calls(self, **cfg):
        from ostinato.kernels.triton.decode_attention import decode_attention

        return [lambda i=i: decode_attention(self.q[i], self.k[i], self.v[i], self.position,
                                             self.window, **cfg) for i in range(len(self.q))]

    def refresh(self):
        self.mask = self.cols <= self.position  # [1, W]

    def sdpa(self, i):
        q_ = self.q[i].reshape(1, self.hkv, self.h // self.hkv, self.dk)
        k_ = self.k[i].transpose(0, 1)[None]  # [1, Hkv, W, Dk]
        v_ = self.v[i].transpose(0, 1)[None]
        return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=self.mask).reshape(1, self.h, self.dv)

    def sdpa_gqa(self, i):
        q_ = self.q[i].transpose(0, 1)[None]  # [1, H, 1, Dk]
        k_ = self.k[i].transpose(0, 1)[None]
        v_ = self.v[i].transpose(0, 1)[None]
        return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=self.mask,
                                              enable_gqa=True).transpose(1, 2)

    def causal(self, i):
        """The host-driven pass's attention: the T tokens over the c valid keys, lower-right causal."""
        from ostinato.models.common import causal_attention

        c = self.context
        return causal_attention(self.q[i].transpose(0, 1), self.k[i][:c].transpose(0, 1),
                                self.v[i][:c].transpose(0, 1)).transpose(0, 1)

    def sdpa_calls(self, gqa: bool):
        fn = self.sdpa_gqa if gqa else self.sdpa
        return [self.refresh] + [lambda i=i: fn(i) for i in range(len(self.q))]


def max_err(rig: Rig) -> float:
    """Kernel against the masked SDPA call (T > 1: the host-driven causal call), both bf16, relative to
    the output's scale."""
    got = rig.kernel_calls()[0]()
    if rig.tokens > 1:
        want = rig.causal(0)
    else:
        rig.refresh()
        want = rig.sdpa(0)
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def sweep(rig: Rig, reps: int) -> list[dict]:
    import triton

    from ostinato.kernels.triton.decode_plan import split_plan

    rows = []
    for block_n, warps, stages, splits in itertools.product([32, 64, 128], [2, 4, 8], [2, 3],
                                                            [32, 64, 128]):
        chunk = max(block_n, triton.cdiv(triton.cdiv(rig.window, splits), block_n) * block_n)
        cfg = dict(chunk=chunk, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            us = graph_us(rig.kernel_calls(**cfg), reps, rig.layers)
        except Exception as e:  # a config the device cannot run (e.g. shared memory)
            print(f"    {cfg}: failed ({type(e).__name__})")
            continue
        rows.append({**cfg, "splits": split_plan(rig.window, chunk, block_n)[1], "us": us})
        print(f"    chunk {chunk:5d} block_n {block_n:3d} warps {warps} stages {stages}: "
              f"{us:7.2f} us")
    return sorted(rows, key=lambda r: r["us"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--contexts", type=int, nargs="+", help="default 1024 4096 8192 16384 (with --tokens: those "
                    "within --window)")
    ap.add_argument("--layers", type=int, help="layers (caches) per graph (default: the shape's decode step's)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="also time kernel block/split variants")
    ap.add_argument("--no-gqa", action="store_true", help="skip the enable_gqa SDPA baseline")
    ap.add_argument("--tokens", type=int, default=1, help="T > 1: a short prefill pass of T tokens (Qwen3's shape)")
    ap.add_argument("--window", type=int, default=8292, help="with --tokens: the pass's window (the max context)")
    args = ap.parse_args()
    if args.tokens < 1:
        sys.exit(f"bench_decode_attention: --tokens must be at least 1, not {args.tokens}")
    if args.tokens > 1 and args.shape != "qwen3-30b-a3b":
        sys.exit("bench_decode_attention: --tokens times Qwen3's shape only (MLA's host-driven pass expands its heads)")
    if not torch.cuda.is_available():
        sys.exit("bench_decode_attention: needs a CUDA device (torch.cuda.is_available() is "
                 "False); the kernel's CPU check is tests/test_decode_attention.py")
    try:
        import triton
    except ImportError:
        sys.exit("bench_decode_attention: needs triton")
    from ostinato.kernels.triton.decode_plan import launch_plan

    shape = SHAPES[args.shape]
    H, Hkv, Dk, Dv, step_layers = shape["H"], shape["Hkv"], shape["Dk"], shape["Dv"], shape["layers"]
    layers = args.layers or step_layers
    torch.manual_seed(0)
    rows, sweeps = [], {}
    T = args.tokens
    print(f"decode attention, {args.shape}: H={H} Hkv={Hkv} Dk={Dk} Dv={Dv} bf16, {T} token(s), {layers} layers per graph, "
          f"{torch.cuda.get_device_name()}")
    head = (f"{'context':>8} {'window':>7} {'splits':>6} {'kernel us':>10} {'sdpa us':>9} "
            f"{'gqa us':>8} {'speedup':>8} {'GB/s':>7} {'step ms':>8} {'sdpa ms':>8} {'err':>8}")
    print(head)
    contexts = args.contexts or [c for c in (1024, 4096, 8192, 16384) if T == 1 or c <= args.window]
    for c in contexts:
        w = window_for(c) if T == 1 else args.window
        if T > c or c > w:
            sys.exit(f"bench_decode_attention: context {c} must hold the {T} tokens and fit the window {w}")
        rig = Rig(shape, w, c, layers, T)
        plan = launch_plan(T, H // Hkv, Dv, w)
        chunk, splits = plan.chunk, plan.splits
        err = max_err(rig)
        kernel = graph_us(rig.kernel_calls(), args.reps, layers)
        if T > 1:  # the host-driven pass's call in the sdpa column; no masked or gqa form
            sdpa, gqa = graph_us([lambda i=i, r=rig: r.causal(i) for i in range(layers)], args.reps, layers), None
        else:
            sdpa = graph_us(rig.sdpa_calls(gqa=False), args.reps, layers)
            gqa = None if args.no_gqa else graph_us(rig.sdpa_calls(gqa=True), args.reps, layers)
        row_bytes = Hkv * (Dk if Dv < Dk else Dk + Dv) * 2  # bf16; MLA's value is its key row's
        gbps = c * row_bytes / kernel / 1e3
        row = {"context": c, "window": w, "tokens": T, "position": c - T, "chunk": chunk, "splits": splits,
               "kernel_us": kernel, "sdpa_us": sdpa, "sdpa_gqa_us": gqa, "kernel_gbps": gbps,
               "step_kernel_ms": kernel * step_layers / 1e3,
               "step_sdpa_ms": sdpa * step_layers / 1e3, "max_rel_err": err}
        rows.append(row)
        print(f"{c:>8} {w:>7} {splits:>6} {kernel:>10.2f} {sdpa:>9.2f} "
              f"{'-' if gqa is None else f'{gqa:.2f}':>8} {sdpa / kernel:>7.1f}x {gbps:>7.0f} "
              f"{row['step_kernel_ms']:>8.3f} {row['step_sdpa_ms']:>8.3f} {err:>8.1e}")
        if args.sweep:
            print(f"  sweep at context {c} (window {w}):")
            sweeps[str(c)] = sweep(rig, max(5, args.reps // 3))
            best = sweeps[str(c)][0]
            print(f"  best: {best}")
        del rig
        torch.cuda.empty_cache()
    result = {"bench": "decode_attention", **source_state(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__,
              "shape": {"name": args.shape, "H": H, "Hkv": Hkv, "Dk": Dk, "Dv": Dv, "dtype": "bf16"},
              "layers_per_graph": layers,
              "defaults": {"block_r": plan.block_r, "block_n": plan.block_n, "num_warps": plan.num_warps,
                           "num_stages": plan.num_stages},
              "rows": rows}
    if sweeps:
        result["sweep"] = sweeps
    print(json.dumps(result))


if __name__ == "__main__":
    main()
