"""The prefill model: n-token passes of a few layers, with the routing of real prompts.

  passes   HybridExperts.split_path and .upload_path on n-token passes (n in --sizes); the
           host's part of the split path and the GPU branches apart, and the CPU branch
           alone, to fit the prefill model (fit_cpu_pass); Np = the one-switch rule on the
           measured curves. On CUDA, then the split path with uploads (hybrid.py's MixedPass,
           from the fitted CPU pass and the upload bandwidth) on the same passes.

Legend: n tokens of a measured pass.
"""
from __future__ import annotations

import itertools
import statistics

import torch

from ostinato.sessions.read import load_sessions
from ostinato.layers.moe.backend import CallableBackend
from ostinato.layers.moe.types import TopKOutput
from ostinato.planner import cost_model as cm
from ostinato.planner.measure.timing import Clock, gpu_branch, nnls
from ostinato.planner.profile import session_stream


def prompt_ids(tok, spec: str, n: int) -> list[int]:
    """At least n tokens of real prompts (session streams, in turn, repeated if short)."""
    ids: list[int] = []
    sessions = load_sessions(spec)
    if not sessions:
        return [1 + i % 1000 for i in range(n)]
    for s in itertools.cycle(sessions):
        ids += session_stream(s, tok, max_tokens=n).ids
        if len(ids) >= n:
            return ids[:n]
    return ids


def fresh(h):
    """h, its flex slots forgotten: a layer's pass timed again and again copies its uploads each time, as
    the engine's passes do, whose other layers stage theirs in between (ExpertPool.forget_staged)."""
    h.forget_staged()
    return h


def capture_routing(runner, ids: list[int], layers: list[int]) -> dict[int, tuple[torch.Tensor, TopKOutput]]:
    """One pass over ids; the MoE input and routing of the given layers."""
    seen = {}
    inner = runner.experts

    def backend(layer, x, topk):
        if layer in layers and layer not in seen:
            seen[layer] = (x.clone(), TopKOutput(topk.ids.clone(), topk.weights.clone()))
        return inner(layer, x, topk)

    with runner.experts_swapped(CallableBackend(backend)):
        runner.forward(ids, 0)
    return seen


def measure_passes(runner, h, tok, layers: list[int], clock: Clock, sizes: list[int], sessions: str,
                   reps: int) -> dict:
    """Split and upload path of n-token passes on the routing of the prompts of `sessions`
    (medians of reps); their CPU and GPU halves; routes and distinct experts."""
    routing = capture_routing(runner, prompt_ids(tok, sessions, max(sizes)), layers)
    med = lambda f: statistics.median(f() for _ in range(reps))  # noqa: E731
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
            both = [clock.both(lambda: fresh(h).split_path(layer, x, topk)) for _ in range(reps)]
            row["cpu_ms"].append(statistics.median(b[0] for b in both))  # the host's part: launch + CPU branch
            split_stats = h.cpu.last_stats()
            alone_ms, alone_stats = cpu_alone(h, layer, x, topk, clock, reps)
            row["cpu_alone_ms"].append(alone_ms)
            detail.append({"n": n, "layer": layer, "split": split_stats, "alone": alone_stats, "alone_ms": alone_ms})
            row["split_ms"].append(statistics.median(b[1] for b in both))
            row["upload_ms"].append(med(lambda: clock.wall(lambda: fresh(h).upload_path(layer, x, topk))))
            row["gpu_hot_ms"].append(med(lambda: clock.device(lambda: gpu_branch(h, layer, x, topk.ids,
                                                                                 topk.weights))))
            slots = all_staged_slots(pool, layer, cold_ids, topk.ids)
            row["gpu_all_ms"].append(med(lambda: clock.device(lambda: gpu_branch(h, layer, x, topk.ids,
                                                                                 topk.weights, slots))))
            points.append((row["distinct_cold"][-1], row["cold_routes"][-1], row["cpu_ms"][-1]))
        for k, v in row.items():
            curves[k].append(statistics.fmean(v))
    np_, crossings = cm.one_switch(sizes, curves["split_ms"], curves["upload_ms"])
    return {"sizes": sizes, "layers": layers, **curves, "upload_threshold": np_, "crossings": crossings,
            "cpu_points": points, "cpu_detail": detail, "routing": routing}


def all_staged_slots(pool, layer: int, cold_ids: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The slots of a pass whose cold experts `cold_ids` sit in the pool's flex slots, as many as those
    hold (the first of them); the others at their zero slots, as the kernels take cold routes (a slot
    < 0 is no slot: the prefill kernels' alignment reads it as one more distinct expert and
    overruns its buffer, a device-side assert on DeepSeek-V3's 31 flex slots of 256 experts)."""
    lookup = pool.table[layer].clone()
    staged = cold_ids[:pool.num_slots - pool.flex_lo].to(lookup.device)
    lookup[staged] = torch.arange(pool.flex_lo, pool.flex_lo + staged.numel(), dtype=torch.int32,
                                  device=lookup.device)
    return pool.slots_in(lookup, ids)


def cpu_alone(h, layer: int, x: torch.Tensor, topk: TopKOutput, clock: Clock, reps: int) -> tuple[float, dict]:
    """HybridExperts.cpu_branch timed (against split_path's host part, it shows what the GPU
    branch and the copies beside it cost the CPU) -> (median ms, native stats)."""
    run = h.cpu_branch(layer, x, topk)
    run()
    ms = statistics.median(clock.wall(run) for _ in range(reps))
    return ms, h.cpu.last_stats()


def measure_mixed(h, routing, passes: dict, mixed, clock: Clock, reps: int) -> dict:
    """The split path with uploads (HybridExperts.mixed) on the passes of measure_passes, timed in
    pairs with the plain split path on the same layer and pass, alternately, so that the two see
    the same machine (a host's memory bandwidth drifts by 10-15% between the minutes of a
    calibration, as much as what the uploads save on short passes). Per size: the mean over its
    layers of each path's median wall time (ms) of reps, and on how many of the layers the split
    with uploads was the faster -> {"mixed_ms", "split_paired_ms", "mixed_wins", "paired_layers"}."""
    before = h.mixed
    out = {"mixed_ms": [], "split_paired_ms": [], "mixed_wins": [], "paired_layers": len(passes["layers"])}
    try:
        for n in passes["sizes"]:
            with_up, plain = [], []
            for layer in passes["layers"]:
                xa, ta = routing[layer]
                x, topk = xa[:n], TopKOutput(ta.ids[:n], ta.weights[:n])
                times = ([], [])  # plain, with uploads
                for r in range(reps + 1):  # the first pair warms both paths up
                    for i in (0, 1) if r % 2 == 0 else (1, 0):
                        h.mixed = mixed if i else None
                        t = clock.wall(lambda: fresh(h).split_path(layer, x, topk))
                        if r:
                            times[i].append(t)
                plain.append(statistics.median(times[0]))
                with_up.append(statistics.median(times[1]))
            out["mixed_ms"].append(statistics.fmean(with_up))
            out["split_paired_ms"].append(statistics.fmean(plain))
            out["mixed_wins"].append(sum(a < b for a, b in zip(with_up, plain)))
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

