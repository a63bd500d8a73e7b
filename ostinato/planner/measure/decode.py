"""The decode model: one token's layer, and whole decode steps with forced routing.

  G_l      the GPU branch of one token in layer l: pool.slots_for + pool.forward
           over K hot slots (CUDA events; wall clock on a CPU-only machine), median;
  C_l(r)   the host's time in HybridExperts.split_path for one token with r = 0..K cold routes:
           the GPU branch launched, routing and activations to the host, compact lookup,
           CpuExperts submit/wait on the page-locked cold experts, the partial result queued
           back (the GPU branch runs on meanwhile); median over repetitions that pick
           different cold experts, so the CPU caches do not flatter it; gamma0 = C(0) (the
           handshake and bookkeeping of a layer without cold routes), alpha + beta r fitted
           over r >= 1;
  dense    a decode step with every route forced onto hot experts, minus
           sum_l max(gamma0_l, G_l): attention, norms, routers, head and launches (at a
           short and a long context: its growth per 1k tokens of context); decode steps
           forced to r = 1, 2, K/2, K cold routes per layer check the additive model (an
           engine that decodes as CUDA graphs replays these steps as graphs: dense and the
           CPU branch's alpha, beta as the native worker serves it are fitted from them).

Legend: K top-k, D hidden, r cold routes.
"""
from __future__ import annotations

import statistics

import torch

from ostinato.engine.graph import DecodeGraphs
from ostinato.layers.moe.backend import CallableBackend
from ostinato.layers.moe.types import TopKOutput
from ostinato.planner import cost_model as cm
from ostinato.planner.measure.timing import Clock, fit_line, gpu_branch


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


def measure_layer(h, layer: int, K: int, D: int, dtype, clock: Clock, gen, reps: int, gpu_reps: int) -> dict:
    """G (median of gpu_reps) and C(r), r = 0..K (median of reps for each), of one token in one layer."""
    hot, cold = h.hot_experts(layer), h.cold_experts(layer)
    dev = h.device
    x = (torch.randn(1, D, generator=gen) * 0.5).to(dev, dtype)
    w = torch.full((1, K), 1.0 / K, dtype=torch.float32, device=dev)
    g_ids = _one_token_ids(hot, cold, 0, K, gen)
    if g_ids is None:  # no hot expert: the GPU computes zero slots only
        g_ids = cold[:K][None]
    g_ids = g_ids.to(dev)
    gpu_branch(h, layer, x, g_ids, w)  # warm-up
    G = statistics.median(clock.device(lambda: gpu_branch(h, layer, x, g_ids, w)) for _ in range(gpu_reps))
    G_graph = statistics.median(clock.graphed(lambda: gpu_branch(h, layer, x, g_ids, w)) for _ in range(3))
    samples: dict[int, list[float]] = {r: [] for r in range(K + 1)}
    for rep in range(reps + 1):
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
        hot, cold = h.hot_experts(layer), h.cold_experts(layer)
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

    with runner.experts_swapped(CallableBackend(backend)):
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

    with runner.experts_swapped(CallableBackend(backend)):
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

