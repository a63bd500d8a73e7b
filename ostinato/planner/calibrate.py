"""`ostinato calibrate`: the cost model's constants, measured inside the running engine.

The engine is loaded with the residency (pool, index tables, zero and flex slots, the
page-locked cold experts, the CPU thread pool, under the memory cap), and every timing
goes through its own objects, so the numbers include what serving pays:

  G_l      the GPU branch of one token in layer l: pool.slots_for + pool.forward
           over K hot slots (CUDA events; wall clock on a CPU-only machine), median;
  C_l(r)   the host's time in HybridExperts.split_path for one token with r = 0..K cold routes:
           the GPU branch launched, routing and activations to the host, compact lookup,
           CpuExperts submit/wait on the page-locked cold experts, the partial result queued
           back (the GPU branch runs on meanwhile); median over repetitions that pick
           different cold experts, so the CPU caches do not flatter it; gamma0 = C(0) (the
           handshake and bookkeeping of a layer without cold routes), alpha + beta r fitted
           over r >= 1;
  upload   GB/s of the upload path's copies (page-locked host -> flex slots);
  dense    a decode step with every route forced onto hot experts, minus
           sum_l max(gamma0_l, G_l): attention, norms, routers, head and launches (at a
           short and a long context: its growth per 1k tokens of context); decode steps
           forced to r = 1, 2, K/2, K cold routes per layer check the additive model (an
           engine that decodes as CUDA graphs replays these steps as graphs: dense and the
           CPU branch's alpha, beta as the native worker serves it are fitted from them);
  passes   HybridExperts.split_path and .upload_path on n-token passes (n in --sizes) of a few
           layers, with the routing of real prompts; the host's part of the split path and
           the GPU branches apart, to fit the prefill model; Np = the one-switch rule on
           the measured curves. On CUDA, then the split path with uploads (hybrid.py's
           MixedPass, from the fitted CPU pass and the upload bandwidth) on the same passes.

Everything lands in residency.calibration as data, with the device, date and versions.

Legend: T tokens, K top-k, D hidden, n tokens of a measured pass, r cold routes.
"""
from __future__ import annotations

import datetime
import itertools
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ostinato.config import ConfigError
from ostinato.layers.moe.hybrid import MixedPass
from ostinato.layers.moe.types import TopKOutput
from ostinato.planner import cost_model as cm

DEFAULT_SIZES = (64, 128, 256, 384, 512, 768, 1024, 2048)  # the crossing on the H200 lay between 256 and 512
# A graph step's CPU branch costs alpha per layer with a cold route beyond its routes' work: the
# handshake, a few microseconds when the poller has its core (0.02 ms on the H200 machine). A
# poller that shares its core waits for the scheduler instead (3.5 ms there: issue [H]). Above
# either limit the layout is wrong, and a plan on these constants would be too.
STARVED_ALPHA_MS = 0.2
STARVED_ALPHA_RATIO = 10.0  # against the host-driven alpha of the same layers


@dataclass(frozen=True)
class CalibrateSettings:
    reps: int = 15  # one-token CPU-branch measurements per (layer, r)
    gpu_reps: int = 30  # one-token GPU-branch measurements per layer
    step_reps: int = 24  # forced-hot decode steps
    sizes: tuple[int, ...] = DEFAULT_SIZES
    pass_layers: int = 4  # layers whose n-token passes are timed
    pass_reps: int = 3
    sessions: str = "embedded:4"  # prompts whose routing the passes use
    seed: int = 0


class Clock:
    """Host wall time (with the device synchronised around it) or device time (CUDA events)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def wall(self, fn) -> float:
        """ms from the call to the device being idle again."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return 1e3 * (time.perf_counter() - t0)

    def host(self, fn) -> float:
        """ms until fn returns on the host (work it enqueued may still run)."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        ms = 1e3 * (time.perf_counter() - t0)
        self.sync()
        return ms

    def both(self, fn) -> tuple[float, float]:
        """(ms until fn returns on the host, ms until the device is idle again)."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        self.sync()
        return 1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t0)

    def graphed(self, fn, reps: int = 20) -> float:
        """ms of one fn as a captured CUDA graph replays it: fn captured reps times in one
        graph, timed by events (no launch gaps: what fn costs inside a decode graph). The
        wall clock of one call on a CPU-only machine."""
        if not self.cuda:
            return self.wall(fn)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up (Triton compiles, allocator pools) outside the capture
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        ms = self.device(g.replay) / reps
        del g
        return ms

    def device(self, fn) -> float:
        if not self.cuda:
            return self.wall(fn)
        self.sync()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)


def gpu_branch(h, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slots=None):
    pool = h.pools.of(layer)
    slots = pool.slots_for(layer, ids) if slots is None else slots
    return pool.forward(x, slots, weights, out_dtype=torch.float32)


def hot_cold(h, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    hot = (h.pools.of(layer).table_host[layer] >= 0).nonzero().flatten()
    cold = (h.host.compact[layer] >= 0).nonzero().flatten()
    return hot, cold


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = alpha + beta x, beta clipped at 0 (one distinct x: the mean, beta 0)."""
    if not points:
        return 0.0, 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    beta = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
    beta = max(beta, 0.0)
    return my - beta * mx, beta


def nnls(rows: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative least squares for a handful of columns: the best non-negative subset fit."""
    A, b = torch.tensor(rows, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)[:, None]
    best, best_err = [0.0] * A.shape[1], float((b**2).sum())
    for k in range(1, A.shape[1] + 1):
        for cols in itertools.combinations(range(A.shape[1]), k):
            sol = torch.linalg.lstsq(A[:, cols], b).solution.flatten()
            if (sol < 0).any():
                continue
            err = float(((A[:, cols] @ sol[:, None] - b) ** 2).sum())
            if err < best_err - 1e-15:
                best, best_err = [0.0] * A.shape[1], err
                for c, v in zip(cols, sol.tolist()):
                    best[c] = v
    return best


def _one_token_ids(hot, cold, r: int, K: int, gen) -> torch.Tensor | None:
    """[1, K] expert ids with r distinct cold experts and K - r hot ones (None if impossible)."""
    if r > cold.numel() or (r < K and hot.numel() == 0):
        return None
    c = cold[torch.randperm(cold.numel(), generator=gen)[:r]]
    if hot.numel() >= K - r:
        hh = hot[torch.randperm(hot.numel(), generator=gen)[:K - r]]
    else:
        hh = hot[torch.randint(hot.numel(), (K - r,), generator=gen)]
    ids = torch.cat([c, hh])
    return ids[torch.randperm(K, generator=gen)][None]


def measure_layer(h, layer: int, K: int, D: int, dtype, clock: Clock, s: CalibrateSettings, gen) -> dict:
    """G and C(r), r = 0..K, of one token in one layer."""
    hot, cold = hot_cold(h, layer)
    dev = h.device
    x = (torch.randn(1, D, generator=gen) * 0.5).to(dev, dtype)
    w = torch.full((1, K), 1.0 / K, dtype=torch.float32, device=dev)
    g_ids = _one_token_ids(hot, cold, 0, K, gen)
    if g_ids is None:  # no hot expert: the GPU computes zero slots only
        g_ids = cold[:K][None]
    g_ids = g_ids.to(dev)
    gpu_branch(h, layer, x, g_ids, w)  # warm-up
    G = statistics.median(clock.device(lambda: gpu_branch(h, layer, x, g_ids, w)) for _ in range(s.gpu_reps))
    G_graph = statistics.median(clock.graphed(lambda: gpu_branch(h, layer, x, g_ids, w)) for _ in range(3))
    samples: dict[int, list[float]] = {r: [] for r in range(K + 1)}
    for rep in range(s.reps + 1):
        for r in range(K + 1):
            ids = _one_token_ids(hot, cold, r, K, gen)
            if ids is None:
                continue
            topk = TopKOutput(ids.to(dev), w)
            ms = clock.host(lambda: h.split_path(layer, x, topk))
            if rep:  # the first round warms up
                samples[r].append(ms)
    C = [statistics.median(v) if v else None for r, v in sorted(samples.items())]
    return {"G_ms": G, "G_graph_ms": G_graph, "C_ms": C, "hot": int(hot.numel()), "cold": int(cold.numel())}


def fit_decode(layers: dict[int, dict]) -> dict:
    """gamma0 / alpha / beta per layer and global (pooled over layers)."""
    pooled = [(r, c) for d in layers.values() for r, c in enumerate(d["C_ms"]) if r >= 1 and c is not None]
    g_alpha, g_beta = fit_line(pooled)
    g0 = [d["C_ms"][0] for d in layers.values() if d["C_ms"][0] is not None]
    glob = {"gamma0_ms": statistics.median(g0) if g0 else 0.0, "alpha_ms": g_alpha, "beta_ms": g_beta,
            "G_ms": statistics.median(d["G_ms"] for d in layers.values()),
            "G_graph_ms": statistics.median(d["G_graph_ms"] for d in layers.values())}
    for d in layers.values():
        pts = [(r, c) for r, c in enumerate(d["C_ms"]) if r >= 1 and c is not None]
        if len(pts) >= 2:
            d["alpha_ms"], d["beta_ms"] = fit_line(pts)
        elif pts:
            d["alpha_ms"], d["beta_ms"] = pts[0][1] - g_beta * pts[0][0], g_beta
        else:
            d["alpha_ms"], d["beta_ms"] = g_alpha, g_beta
        d["gamma0_ms"] = d["C_ms"][0] if d["C_ms"][0] is not None else glob["gamma0_ms"]
    return glob


def measure_upload(h, layers: list[int], clock: Clock, reps: int = 3) -> tuple[float, int]:
    """GB/s of the upload path's copies of cold experts into flex slots; -> (GB/s, expert bytes)."""
    rates, sizes = [], []
    for layer in layers:
        pool = h.pools.of(layer)
        cold = (h.host.compact[layer] >= 0).nonzero().flatten().tolist()[:pool.num_slots - pool.flex_lo]
        if not cold:
            continue

        def copy() -> int:  # as HybridExperts.upload_path: the pool's own copy of each expert (biases too)
            return sum(pool.upload(pool.flex_lo + i, h.host, layer, e) for i, e in enumerate(cold))

        nbytes = copy()
        for _ in range(reps):
            rates.append(nbytes / (clock.wall(copy) * 1e-3) / 1e9)
            sizes.append(nbytes // len(cold))
    # expert bytes: the mean over the measured layers (a quantized model's formats differ by layer)
    eb = round(statistics.fmean(sizes)) if sizes else h.pools.groups[0].expert_bytes
    return (statistics.median(rates) if rates else 0.0), eb


def measure_host_read(cpus: Sequence[int], gib: float = 2.0, reps: int = 3) -> float:
    """Host-memory read bandwidth, GB/s: a torch sum over a buffer far larger than the caches,
    on one thread per CPU of `cpus` (BENCHMARK.md's bound divides cold bytes by this). The
    calling thread may be pinned to one core (the host thread's): torch's threads, started
    from it, would inherit that, so it takes `cpus` for the measurement."""
    buf = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(len(set(cpus)))
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        buf.sum()  # first touch and thread start-up
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
        os.sched_setaffinity(0, pinned)
    return round(buf.numel() * 2 / best / 1e9, 2)


def forced_r(r: int, hot: int, cold: int, K: int) -> int:
    """The cold routes a token can have in a layer with these many hot / cold experts, nearest r."""
    return min(max(r, K - hot), cold)


def measure_steps(runner, h, costs: dict[int, cm.LayerCost], clock: Clock, reps: int, gen,
                  rs: tuple[int, ...], graph=None) -> dict:
    """Decode steps with forced routing: r cold routes in every layer (fresh experts each step),
    r in rs, at a short context, and r = 0 at a long one too. dense = step(r=0) - sum_l layer(r_l);
    the other r check the additive model: step(r) against dense + sum_l max(C_l(r_l), G_l).
    With `graph` (the engine's GraphHybridExperts), the steps run as the engine decodes them:
    captured as CUDA graphs whose forced routing is a device buffer rewritten between
    replays, the cold routes served by the native worker through the handshake; see
    fit_graph_steps."""
    cfg = runner.config
    K, steps = cfg.num_experts_per_tok, reps + 2
    ids, model = {}, {r: 0.0 for r in rs}
    r_of: dict[int, dict[int, int]] = {r: {} for r in rs}  # cold routes per token forced in each layer
    for layer in cfg.moe_layers:
        hot, cold = hot_cold(h, layer)
        rows = []
        for r in rs:
            rl = forced_r(r, hot.numel(), cold.numel(), K)
            r_of[r][layer] = rl
            rows.append(torch.cat([_one_token_ids(hot, cold, rl, K, gen) for _ in range(steps)]))  # [steps, K]
            model[r] += costs[layer].layer(rl) if cold.numel() else costs[layer].G
        ids[layer] = torch.stack(rows).to(h.device)  # [len(rs), steps, K]
    at = {"r": 0, "i": 0}

    tokens = torch.randint(0, cfg.vocab_size, (max(32, steps),), generator=gen).tolist()
    long_start = max(64, runner.max_context * 3 // 4 - steps)
    has_long = long_start + steps < runner.max_context
    if graph is not None:
        measured, long_ms = _graph_steps(runner, graph, ids, rs, steps, tokens, long_start if has_long else None,
                                         clock)
        return fit_graph_steps(measured, long_ms, long_start, r_of, costs)

    def backend(layer, x, topk):
        return h(layer, x, TopKOutput(ids[layer][at["r"], at["i"]][None].expand(x.shape[0], K), topk.weights))

    def run(j: int, start: int) -> list[float]:
        at["r"] = j
        out = []
        for i in range(steps):
            at["i"] = i
            out.append(clock.wall(lambda: runner.forward([tokens[i]], start + i)))
        return out[2:]

    with runner.experts_swapped(backend):
        runner.forward(tokens[:32], 0)
        measured = {r: statistics.median(run(j, 32)) for j, r in enumerate(rs)}
        long_ms = statistics.median(run(0, long_start)) if has_long else None
    dense = max(0.0, measured[rs[0]] - model[rs[0]])
    slope = (long_ms - measured[rs[0]]) / (long_start - 32) * 1e3 if long_ms is not None else 0.0
    return {"dense_step_ms": dense, "dense_ms_per_1k_context": max(0.0, slope), "dense_context": 32,
            "forced_steps": {"r": list(rs), "measured_ms": [measured[r] for r in rs],
                             "model_ms": [dense + model[r] for r in rs],
                             "long_context": long_start, "long_r0_ms": long_ms}}


def _graph_steps(runner, graph, ids: dict, rs, steps: int, tokens: list[int], long_start: int | None,
                 clock: Clock) -> tuple[dict[int, float], float | None]:
    """Forced-routing decode steps replayed as CUDA graphs (one per cache window used): the
    routing of every layer is read from a device buffer that is rewritten between replays."""
    from ostinato.engine.graph import DecodeGraphs

    K = runner.config.num_experts_per_tok
    static = {l: v[0, 0].clone() for l, v in ids.items()}  # [K] per layer

    def backend(layer, x, topk):
        return graph(layer, x, TopKOutput(static[layer][None].expand(x.shape[0], K), topk.weights))

    def run(g, j: int, start: int) -> list[float]:
        out = []
        for i in range(steps):
            for l, v in ids.items():
                static[l].copy_(v[j, i])
            out.append(clock.wall(lambda: g.replay(tokens[i], start + i)))
        return out[2:]

    with runner.experts_swapped(backend):
        runner.forward(tokens[:32], 0)
        g = DecodeGraphs(runner)  # the hooks of runner.experts (the graph backend), our routing in the model
        starts = [32] + ([long_start] if long_start is not None else [])
        g.sizes = sorted({g.window_for(st + steps) for st in starts})
        g.capture()
        for j in range(len(rs)):  # every routing once unmeasured: the first replays of a fresh capture and the
            run(g, j, 32)  # workers' first pass over their experts ran slower (r=1 at 3.7x r=0 on the H200, s10)
        measured = {r: statistics.median(run(g, j, 32)) for j, r in enumerate(rs)}
        long_ms = statistics.median(run(g, 0, long_start)) if long_start is not None else None
        del g
    return measured, long_ms


def fit_graph_steps(measured: dict[int, float], long_ms: float | None, long_start: int,
                    r_of: dict[int, dict[int, int]], costs: dict[int, cm.LayerCost]) -> dict:
    """The decode-step constants of the graph path. In a captured step no host code runs per
    layer, so the host-side C(r) of measure_layer (Python, launches, a blocking wait) is not
    what a step pays: dense = step(r=0) - sum_l G_l (a layer without cold routes costs its GPU
    branch), and the CPU branch's alpha + beta r, as the native worker serves it through the
    handshake, is fitted to the steps forced to r >= 1 cold routes per layer (taking the CPU
    branch as the longer one there; model_ms against measured_ms shows how well that holds).
    r_of[r][l]: the cold routes per token forced in layer l for the step forced to r."""
    rs = sorted(measured)
    layers = list(costs)
    dense = max(0.0, measured[rs[0]] - sum(costs[l].G for l in layers))
    points = []
    for r in rs[1:]:
        with_cold = [l for l in layers if r_of[r][l] > 0]
        if with_cold:
            rest = measured[r] - dense - sum(costs[l].G for l in layers if r_of[r][l] == 0)
            points.append((sum(r_of[r][l] for l in with_cold) / len(with_cold), rest / len(with_cold)))
    alpha, beta = fit_line(points)
    model = {r: dense + sum(max(alpha + beta * r_of[r][l], costs[l].G) if r_of[r][l] else costs[l].G
                            for l in layers) for r in rs}
    slope = (long_ms - measured[rs[0]]) / (long_start - 32) * 1e3 if long_ms is not None else 0.0
    return {"dense_step_ms": dense, "dense_ms_per_1k_context": max(0.0, slope), "dense_context": 32,
            "decode_mode": "graph", "graph_fit": {"gamma0_ms": 0.0, "alpha_ms": alpha, "beta_ms": beta},
            "forced_steps": {"r": rs, "measured_ms": [measured[r] for r in rs],
                             "model_ms": [model[r] for r in rs], "long_context": long_start, "long_r0_ms": long_ms}}


def prompt_ids(tok, spec: str, n: int) -> list[int]:
    """At least n tokens of real prompts (session streams, in turn, repeated if short)."""
    from ostinato.bench.sessions import load_sessions
    from ostinato.planner.profile import session_stream

    ids: list[int] = []
    sessions = load_sessions(spec)
    if not sessions:
        return [1 + i % 1000 for i in range(n)]
    for s in itertools.cycle(sessions):
        ids += session_stream(s, tok, max_tokens=n).ids
        if len(ids) >= n:
            return ids[:n]
    return ids


def capture_routing(runner, ids: list[int], layers: list[int]) -> dict[int, tuple[torch.Tensor, TopKOutput]]:
    """One pass over ids; the MoE input and routing of the given layers."""
    seen = {}
    inner = runner.experts

    def backend(layer, x, topk):
        if layer in layers and layer not in seen:
            seen[layer] = (x.clone(), TopKOutput(topk.ids.clone(), topk.weights.clone()))
        return inner(layer, x, topk)

    with runner.experts_swapped(backend):
        runner.forward(ids, 0)
    return seen


def measure_passes(runner, h, tok, layers: list[int], clock: Clock, s: CalibrateSettings, sizes: list[int]) -> dict:
    """Split and upload path of n-token passes; their CPU and GPU halves; routes and distinct experts."""
    routing = capture_routing(runner, prompt_ids(tok, s.sessions, max(sizes)), layers)
    med = lambda f: statistics.median(f() for _ in range(s.pass_reps))  # noqa: E731
    points, detail = [], []
    curves = {k: [] for k in ("split_ms", "upload_ms", "cpu_ms", "cpu_alone_ms", "gpu_hot_ms", "gpu_all_ms",
                              "cold_routes", "distinct_cold")}
    for n in sizes:
        row = {k: [] for k in curves}
        for layer in layers:
            xa, ta = routing[layer]
            x, topk = xa[:n], TopKOutput(ta.ids[:n], ta.weights[:n])
            pool = h.pools.of(layer)
            table = pool.table[layer]
            cold_mask = table[topk.ids] < 0
            cold_ids = torch.unique(topk.ids[cold_mask]).cpu()
            row["cold_routes"].append(int(cold_mask.sum()))
            row["distinct_cold"].append(int(cold_ids.numel()))
            h.split_path(layer, x, topk)  # warm-up
            both = [clock.both(lambda: h.split_path(layer, x, topk)) for _ in range(s.pass_reps)]
            row["cpu_ms"].append(statistics.median(b[0] for b in both))  # the host's part: launch + CPU branch
            split_stats = h.cpu.last_stats()
            alone_ms, alone_stats = cpu_alone(h, layer, x, topk, clock, s.pass_reps)
            row["cpu_alone_ms"].append(alone_ms)
            detail.append({"n": n, "layer": layer, "split": split_stats, "alone": alone_stats, "alone_ms": alone_ms})
            row["split_ms"].append(statistics.median(b[1] for b in both))
            row["upload_ms"].append(med(lambda: clock.wall(lambda: h.upload_path(layer, x, topk))))
            row["gpu_hot_ms"].append(med(lambda: clock.device(lambda: gpu_branch(h, layer, x, topk.ids,
                                                                                 topk.weights))))
            # the flex slots now hold this pass's cold experts in upload_path's order
            lookup = table.clone()
            lookup[cold_ids.to(h.device)] = torch.arange(pool.flex_lo, pool.flex_lo + cold_ids.numel(),
                                                         dtype=torch.int32, device=h.device)
            slots = lookup[topk.ids]
            row["gpu_all_ms"].append(med(lambda: clock.device(lambda: gpu_branch(h, layer, x, topk.ids,
                                                                                 topk.weights, slots))))
            points.append((row["distinct_cold"][-1], row["cold_routes"][-1], row["cpu_ms"][-1]))
        for k, v in row.items():
            curves[k].append(statistics.fmean(v))
    np_, crossings = cm.one_switch(sizes, curves["split_ms"], curves["upload_ms"])
    return {"sizes": sizes, "layers": layers, **curves, "upload_threshold": np_, "crossings": crossings,
            "cpu_points": points, "cpu_detail": detail, "routing": routing}


def cpu_branch_call(h, layer: int, x: torch.Tensor, topk: TopKOutput):
    """A callable running the split path's CPU branch alone: the same cold routes from the same
    page-locked staging buffers, with nothing else running."""
    ids_h, w_h = topk.ids.cpu(), topk.weights.cpu()
    x_h = h.x_host[:x.shape[0]]
    x_h.copy_(x)
    cid = h.host.compact[layer][ids_h]
    cold = cid >= 0
    tok, eids, wts = cold.nonzero()[:, 0].to(torch.int32), cid[cold], w_h[cold]
    out = h.out_host[:x.shape[0]]

    def run():
        h.cpu.submit(layer, x_h, tok, eids, wts, out)
        h.cpu.wait()

    return run


def cpu_alone(h, layer: int, x: torch.Tensor, topk: TopKOutput, clock: Clock, reps: int) -> tuple[float, dict]:
    """cpu_branch_call timed (against split_path's host part, it shows what the GPU branch and
    the copies beside it cost the CPU) -> (median ms, native stats)."""
    run = cpu_branch_call(h, layer, x, topk)
    run()
    ms = statistics.median(clock.wall(run) for _ in range(reps))
    return ms, h.cpu.last_stats()


def measure_mixed(h, routing, passes: dict, mixed, clock: Clock, s: CalibrateSettings) -> list[float]:
    """The split path with uploads (HybridExperts.mixed) on the passes of measure_passes:
    per size, the mean over its layers of the median wall time (ms)."""
    before, h.mixed = h.mixed, mixed
    try:
        out = []
        for n in passes["sizes"]:
            per_layer = []
            for layer in passes["layers"]:
                xa, ta = routing[layer]
                x, topk = xa[:n], TopKOutput(ta.ids[:n], ta.weights[:n])
                h.split_path(layer, x, topk)  # warm-up
                per_layer.append(statistics.median(clock.wall(lambda: h.split_path(layer, x, topk))
                                                   for _ in range(s.pass_reps)))
            out.append(statistics.fmean(per_layer))
        return out
    finally:
        h.mixed = before


def fit_cpu_pass(points: list[tuple[int, int, float]], layers: dict[int, dict]) -> dict:
    """alpha + beta_expert * distinct + beta_route * routes over pass and one-token points."""
    rows, y = [], []
    for d, r, ms in points:
        if r > 0:
            rows.append([1.0, d, r])
            y.append(ms)
    for info in layers.values():
        for r, ms in enumerate(info["C_ms"]):
            if r >= 1 and ms is not None:
                rows.append([1.0, r, r])
                y.append(ms)
    a, be, br = nnls(rows, y) if rows else (0.0, 0.0, 0.0)
    return {"alpha_ms": a, "beta_expert_ms": be, "beta_route_ms": br}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({cpu_model()})"


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate(loaded, s: CalibrateSettings = CalibrateSettings(), progress: bool = True) -> dict:
    """Measure every constant of the cost model in this engine; -> the calibration dict."""
    from ostinato.layers.moe.graph_hybrid import GraphHybridExperts

    runner = loaded.runner
    graph = runner.experts if isinstance(runner.experts, GraphHybridExperts) and runner.graphs is not None else None
    h = graph.hybrid if graph is not None else runner.experts  # the branches are timed on the hybrid itself
    if not hasattr(h, "pools"):
        raise ValueError("calibrate needs the hybrid engine: load it with a residency")
    if h.on_cuda:
        from ostinato.engine.threads import claim_host_thread

        claim_host_thread(runner.threads)  # as the runner serves: the host thread on its own core
    clock = Clock(h.device)
    gen = torch.Generator().manual_seed(s.seed)
    t0 = time.perf_counter()
    mixed_before, h.mixed = h.mixed, None  # the plain paths are measured, then the split with uploads
    try:
        return _calibrate(loaded, s, progress, runner, graph, h, clock, gen, t0)
    finally:
        h.mixed = mixed_before


def _calibrate(loaded, s, progress, runner, graph, h, clock, gen, t0) -> dict:
    from tqdm import tqdm

    cfg = runner.config
    K, D = cfg.num_experts_per_tok, cfg.hidden_size
    with torch.inference_mode():
        layers = {l: measure_layer(h, l, K, D, runner.dtype, clock, s, gen)
                  for l in tqdm(cfg.moe_layers, desc="calibrate layers", disable=not progress)}
        glob = fit_decode(layers)
        g_key = "G_graph_ms" if graph is not None else "G_ms"  # the GPU branch as decode pays it
        costs = {l: cm.LayerCost(d[g_key], d["gamma0_ms"], d["alpha_ms"], d["beta_ms"], h.on_cuda)
                 for l, d in layers.items()}
        with_cold = [l for l in cfg.moe_layers if layers[l]["cold"] > 0]
        gbps, eb = measure_upload(h, with_cold[:: max(1, len(with_cold) // 4)][:4], clock)
        read_gbps = measure_host_read(set(h.cpu.cpus) | set(runner.threads.host))  # the workers and the caller
        rs = tuple(sorted({0, 1, 2, K // 2, K}))
        step = measure_steps(runner, h, costs, clock, s.step_reps, gen, rs, graph=graph)
        if not handshake_ok(step, glob):  # measured once more before refusing: a transient, or a misconfiguration
            again = measure_steps(runner, h, costs, clock, s.step_reps, gen, rs, graph=graph)
            step = {**again, "first_forced_steps": step["forced_steps"]}
        check_handshake(step, glob, runner.threads)
        limit = min(runner.settings.prefill_chunk, h.x_host.shape[0], runner.max_context - 1)
        sizes = sorted({n for n in s.sizes if n <= limit})
        pick = [with_cold[round(i * (len(with_cold) - 1) / max(1, s.pass_layers - 1))]
                for i in range(min(s.pass_layers, len(with_cold)))]
        pick = sorted(set(pick))
        passes = measure_passes(runner, h, loaded.tokenizer, pick, clock, s, sizes) if sizes and pick else {}
    cpu_pass = fit_cpu_pass(passes.pop("cpu_points", []), layers)
    routing = passes.pop("routing", None)
    mixed = MixedPass.from_calibration({"cpu_pass": cpu_pass, "upload_gbps": gbps, "expert_bytes": eb},
                                       measured=False)
    if passes and h.on_cuda and mixed is not None:  # with a PCIe link beside the CPU: split with uploads
        with torch.inference_mode():
            passes["mixed_ms"] = measure_mixed(h, routing, passes, mixed, clock, s)
    np_ = passes.get("upload_threshold")
    if passes and np_ is None:
        np_ = max(sizes) + 1  # upload never cheaper up to the largest pass the runner makes
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {
        "version": 1, "device": device_name(h.device), "cpu": cpu_model(), "date": now, "torch": torch.__version__,
        "dtype": str(runner.dtype).removeprefix("torch."), "cpu_threads": h.cpu.num_threads,
        "threads": {**runner.threads.as_dict(), "cpu_workers": list(h.cpu.cpus)},
        "cpu_backend": h.cpu.backend, "hot_experts": h.pools.num_hot, "units": "ms, GB/s, bytes",
        "overlapped": h.on_cuda,
        "global": glob,
        "layers": {str(l): d for l, d in layers.items()},
        "upload_gbps": gbps, "expert_bytes": eb, "host_read_gbps": read_gbps,
        **step,
        "cpu_pass": cpu_pass,
        "passes": passes,
        "upload_threshold": np_,
        "upload_threshold_crossings": passes.get("crossings", 0),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def handshake_ok(step: dict, glob: dict) -> bool:
    """False when a graph calibration's CPU branch costs far more per layer than the handshake can
    (a starved poller); True off the graph path."""
    fit = step.get("graph_fit")
    if not fit:
        return True
    alpha, host = fit["alpha_ms"], glob["alpha_ms"]
    return not (alpha > STARVED_ALPHA_MS or (host > 0 and alpha > STARVED_ALPHA_RATIO * host))


def check_handshake(step: dict, glob: dict, threads) -> None:
    """A graph calibration that fails handshake_ok (measured twice) is a misconfiguration, not a
    constant to plan on: refuse it, saying why."""
    if not handshake_ok(step, glob):
        alpha, host = step["graph_fit"]["alpha_ms"], glob["alpha_ms"]
        fmt = lambda fs: ", ".join(f"r={r}: {m:.2f} ms" for r, m in zip(fs["r"], fs["measured_ms"]))  # noqa: E731
        steps = fmt(step["forced_steps"])
        if "first_forced_steps" in step:
            steps += f"; measured before: {fmt(step['first_forced_steps'])}"
        raise ConfigError(
            f"the CPU branch inside the decode graph costs alpha {alpha:.3f} ms per layer (host-driven "
            f"{host:.3f} ms; forced steps {steps}): the graph poller is starved of its core, so this "
            f"calibration is not saved. The layout was:\n{threads.describe()}\nLeave --cpu-threads out (the "
            "default gives the poller and the host thread cores of their own), or lower it, and check that "
            "nothing else runs busy threads on these CPUs")


def model_checks(cal: dict, counts, hot: dict[int, list[int]], cfg) -> dict:
    """What the calibrated model predicts for this residency and profile: the decode step
    (at a context of half the longest request), cold routes per token and layer, and Np (on
    all layers, and on the measured layers and sizes, to set beside the measured Np)."""
    K = cfg.num_experts_per_tok
    costs = cm.layer_costs(cal, cfg.moe_layers)
    context = counts.max_tokens / 2
    pred = cm.predict_decode_step(counts.decode, counts.tokens["decode"], hot, costs, K, cm.dense_ms(cal, context))
    out = {"decode_step_ms": pred.total_ms, "decode_moe_ms": pred.moe_ms, "context": context,
           "cold_routes_per_token_layer": pred.cold_routes_per_layer}
    if cm.read_gbps(cal) and cal.get("expert_bytes"):
        out["decode_bound_ms"] = cm.decode_bound(pred, costs, cal["expert_bytes"], cm.read_gbps(cal))
    passes = cal.get("passes") or {}
    if passes.get("sizes"):
        pc = cm.PassCosts.from_calibration(cal)
        probs = {l: cm.route_probs(counts.prefill[l], counts.tokens["prefill"], K) for l in cfg.moe_layers}
        sizes = passes["sizes"]
        grid = list(range(16, max(sizes) + 1, 16))
        out["upload_threshold"], out["upload_threshold_crossings"], _ = cm.model_threshold(probs, hot, pc, grid)
        sub = {l: probs[l] for l in passes["layers"]}
        np_s, _, curve = cm.model_threshold(sub, hot, pc, sizes)
        out["upload_threshold_on_sizes"] = np_s
        out["split_ms"] = [c[1] for c in curve]
        out["upload_ms"] = [c[2] for c in curve]
    return out
