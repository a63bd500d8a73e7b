"""`ostinato bench`: profile, plan, calibrate, then replay held-out sessions for Ostinato and
every baseline policy in one process, plus the length sweep, and write the report.

One run, one machine, one budget (BENCHMARK.md): the dense model is loaded once; each
policy's experts backend is built in turn under the same expert budget, swapped into the
engine (the previous one closed and freed first), warmed up, tuned on development sessions
where it has a threshold, and replayed on the held-out sessions. The experts are loaded once
too: the profiling placement's page-locked host copies of every expert are kept, and every
policy's host copies are views of them and its pools fill from them (engine/experts.py
keep_host_experts; each policy had loaded them again, 167 s of a 175 s build for
DeepSeek-V3-shaped). Steps:

1. split the sessions by task into development and held-out (sessions/read.py);
2. profile development sessions (and held-out ones, for the skew figure, its spread over the
   layers and the persistence of experts across tokens) with the `layers` policy uploading
   every pass (threshold 1, no resident layer), which fits any budget;
3. the budget in expert-sized pool slots, the same for every policy, and 4. the plan: the
   most-routed experts that fit it with Ostinato's zero and flex slots, exactly as `ostinato
   plan` makes it (planner/pipeline.py: --expert-budget bytes, or the pool of a --hot-fraction
   residency, or the capacity test on --gpu-memory; 0.4 of all experts without any), saved as
   residency.json; Np calibrated in the engine by planner/calibrate.py (or --upload-threshold), then
   the plan filled again by the time each expert saves and the planner's decision whether the upload
   path pays for its flex slots over the development sessions (planner/pipeline.py plan_upload_path):
   where it does not, Ostinato's plan spends their bytes on hot experts and has no Np (the ablation's
   upload and borrow steps still run the plan with the upload path, in the same budget; the
   ktransformers baseline runs the fill by routes with it, Residency.frequency_plan);
5. per policy: build, warm up, tune the offload threshold over OFFLOAD_THRESHOLDS (policies/settings.py) on
   development sessions (lowest total request time), replay held-out (the host's read bandwidth measured with
   the policy's CPU pool just before and after it), run the sweep;
6. report.md, results.json, PNG plots in --out; one JSON line last on stdout.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ostinato.bench.metrics import TurnResult, summarize, sweep_summary
from ostinato.bench.replay import InProcessTarget, TurnRequest, replay_sessions, session_requests
from ostinato.bench.report import environment, finish_result, host_counter_delta, host_counters
from ostinato.config import ConfigError
from ostinato.engine.experts import keep_host_experts, release_host_experts
from ostinato.engine.gpu_memory import memory_figures
from ostinato.engine.placement import DEFAULT_UPLOAD_THRESHOLD, PlacementSettings
from ostinato.engine.residency import Residency, measured
from ostinato.engine.routes import RouteCounts
from ostinato.engine.runner import RunnerSettings
from ostinato.engine.sizes import expert_sizes
from ostinato.kernels.triton import compiles as triton_compiles
from ostinato.load import capacity_under, load_engine, warm_up
from ostinato.loader.build import expert_formats, weight_formats
from ostinato.planner.calibrate import CalibrateSettings, calibrate, model_checks
from ostinato.planner.capacity import CapacitySettings, hot_groups, pool_groups
from ostinato.planner.measure.transfers import host_read_gbps, read_buffer
from ostinato.planner.pipeline import fill_text, plan_residency, plan_upload_path, size_pool, upload_path_text
from ostinato.planner.profile import session_stream
from ostinato.planner.run_profile import profile_sessions
from ostinato.planner.skew import hot_share, persistence_report, spread_report, trace_sessions
from ostinato.policies.factory import make_policy, policy_factory, release, use_policy
from ostinato.policies.settings import OFFLOAD_THRESHOLDS, OSTINATO_STEPS, POLICIES, PolicySettings, TUNED
from ostinato.sessions.read import load_sessions, split_sessions, spread

DEFAULT_HOT_FRACTION = 0.4  # used only when nothing else sizes the budget (the paper's GPU held ~40%)


@dataclass
class BenchSettings:
    model: str
    runner: RunnerSettings = field(default_factory=RunnerSettings)
    sessions: str = "embedded"
    policies: tuple[str, ...] = POLICIES
    gpu_memory: int | None = None  # the device cap, bytes
    expert_budget: int | None = None  # bytes for expert slots (overrides sizing from the cap)
    hot_fraction: float | None = None  # budget as a share of all experts (when no bytes are given)
    attention_scores: float | None = None  # capacity test: share of a pass's scores materialised (None: the model's)
    margin: dict = field(default_factory=dict)  # capacity test: CapacitySettings' margin fields given (model_args)
    max_sessions: int | None = None  # per side (development, held-out), spread over the sources
    max_turns: int | None = None  # per session
    max_output: int | None = None  # forced output tokens per turn (None: the whole recorded output)
    profiles: tuple[str, str] | None = None  # saved (development, held-out) profiles instead of profiling
    tune: bool = True
    tune_sessions: int = 3
    tune_max_turns: int | None = None  # per tuning session (default: max_turns)
    thresholds: tuple[int, ...] = OFFLOAD_THRESHOLDS
    sweep_sizes: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    sweep_output: int = 128
    sweep_prefixes: int = 8
    sweep_prefix_tokens: int = 1024
    upload_threshold: int | None = None  # Np for Ostinato (default: calibrated, else the engine's)
    calibration_from: str | None = None  # a residency file calibrated on this machine: its constants and Np
    calibrate: bool = True
    calibration: object = None  # planner.calibrate.CalibrateSettings (None: its defaults)
    cpu_backend: str = "auto"
    upper_bound: bool = False  # run `gpu` even when all experts exceed the budget (logical memory only)
    experts: str = "native"  # every policy alike: a GGUF file's experts in its block formats, or "bf16"
    out: Path = Path("ostinato-bench")
    host_read_gib: float = 1.0  # the buffer of the host-read probe around each policy's replay
    merge: bool = False  # add these policies to the results.json already in `out` (same model, budget, split)
    # the held-out sessions in this many slices, every policy built and replayed on each slice in turn,
    # the order reversed every other round (ABBA): a host's drift over the run falls on every policy alike
    rounds: int = 1
    progress: bool = True
    log: object = None  # where progress lines go: None for sys.stderr (at the time), False for nowhere


def _log(bs: BenchSettings):
    return None if bs.log is False else (bs.log or sys.stderr)


def _say(bs: BenchSettings, msg: str) -> None:
    if _log(bs) is not None:
        print(msg, file=_log(bs), flush=True)


def select_sessions(spec: str, max_sessions: int | None):
    """(development, held-out) sessions, each spread down to max_sessions."""

    dev, held = split_sessions(load_sessions(spec))
    if max_sessions:
        dev, held = spread(dev, max_sessions), spread(held, max_sessions)
    if not dev or not held:
        raise ConfigError(f"--sessions {spec}: need sessions of at least two tasks per source to split into "
                          f"development and held-out (got {len(dev)} and {len(held)})")
    return dev, held


def pool_size(loaded, bs: BenchSettings, counts):
    """The budget (the same for every policy) and the experts Ostinato keeps resident in it, sized
    as `ostinato plan` sizes it (planner/pipeline.py), in the experts' real bytes (each layer's
    GGUF block formats unless bs.experts is "bf16"): --expert-budget bytes; else --hot-fraction;
    else the capacity test on --gpu-memory; else the default fraction. Returns (PoolSize, the
    budget's JSON entry: slots of the mean expert, `bytes` every policy's pools must fit, and the
    format groups of Ostinato's plan)."""
    cfg = loaded.runner.config
    f = bs.hot_fraction
    if f is None and bs.expert_budget is None and bs.gpu_memory is None:
        f = DEFAULT_HOT_FRACTION
    formats = weight_formats(loaded.source, bs.experts)
    total = counts.total("all")
    size = size_pool(cfg, total, loaded.runner.dtype, gpu_memory=bs.gpu_memory, hot_fraction=f,
                     expert_budget=bs.expert_budget, kv_tokens=loaded.engine.max_context,
                     capacity=CapacitySettings(**bs.margin, prefill_chunk=bs.runner.prefill_chunk,
                                               attention_score_share=bs.attention_scores,
                                               pass_graph_rows=bs.runner.pass_graphs), formats=formats)
    K, E = cfg.num_experts_per_tok, cfg.num_experts
    sizes = {l: v for l, v in expert_sizes(cfg, loaded.runner.dtype, formats.experts).items() if l in total}
    groups = pool_groups(total, size.hot, K, E, sizes, size.max_flex)
    if bs.expert_budget is not None:
        nbytes = int(bs.expert_budget)
    elif f is None:  # the capacity test: every byte the cap leaves after the fixed parts
        nbytes = size.capacity.budget - size.capacity.fixed
    else:  # the pools of the fraction's plan
        nbytes = sum(g["bytes"] for g in groups.values())
    every = sum(g["expert_bytes"] * (g["layers"] * E + K) for g in groups.values())
    budget = {**size.to_json(len(cfg.moe_layers) * E), "cap": bs.gpu_memory, "bytes": nbytes,
              "experts": bs.experts, "groups": groups, "all_experts_bytes": every}
    return size, budget


def calibrate_np(loaded, bs: BenchSettings, base: PolicySettings, counts) -> dict:
    """Np: --upload-threshold; else measured by the planner's calibration in this engine, on
    Ostinato's own placement (so its constants land in the residency); else the default."""
    if bs.upload_threshold:
        return {"value": bs.upload_threshold, "how": "--upload-threshold"}
    if bs.calibration_from:  # measured earlier in this engine on this machine (`ostinato calibrate`)

        cal = measured(Residency.load(bs.calibration_from).calibration)  # its plan's decisions are made again here
        if not cal.get("upload_threshold") or not cal.get("layers"):  # a failed calibration leaves only the Np
            raise ConfigError(f"--calibration {bs.calibration_from}: the file holds no calibration, only the Np "
                              "a policy ran with: leave --calibration out to calibrate here, or run `ostinato calibrate`")
        return {"value": int(cal["upload_threshold"]), "how": f"calibrated ({bs.calibration_from})", "calibration": cal,
                "predicted": model_checks(cal, counts, base.residency.hot, loaded.runner.config)}
    if not bs.calibrate:
        return {"value": DEFAULT_UPLOAD_THRESHOLD, "how": "default (not calibrated)"}

    release(loaded)
    backend = make_policy("ostinato", loaded.source, bs.runner, base.with_(upload_threshold=DEFAULT_UPLOAD_THRESHOLD))
    use_policy(loaded, backend)  # the engine as it serves: decode steps replayed as graphs where it captures them
    runner = loaded.runner
    try:
        cal = calibrate(loaded, bs.calibration or CalibrateSettings(), progress=bs.progress)
    except Exception as e:  # noqa: BLE001 - a failed calibration leaves the default Np, said in the report
        return {"value": DEFAULT_UPLOAD_THRESHOLD, "how": f"default (calibration failed: {type(e).__name__}: {e})"}
    finally:
        release(loaded)
    np_ = cal.get("upload_threshold") or DEFAULT_UPLOAD_THRESHOLD
    try:
        checks = model_checks(cal, counts, base.residency.hot, runner.config)
    except Exception as e:  # noqa: BLE001 - the prediction is a report line, not a requirement
        checks = {"error": f"{type(e).__name__}: {e}"}
    return {"value": int(np_), "how": "calibrated", "calibration": cal, "predicted": checks}


def sweep_requests(tok, dev, bs: BenchSettings, max_context: int) -> list[tuple[TurnRequest, list[TurnRequest]]]:
    """(prefix request, measured requests) per fixed development prefix: after the prefix,
    `size` new tokens from other development text, then `sweep_output` forced tokens."""
    streams = [session_stream(s, tok).ids for s in dev]
    filler = [t for st in streams for t in st]
    if not filler:
        return []
    out = []
    for i, s in enumerate(spread(streams, bs.sweep_prefixes)):
        prefix = s[:bs.sweep_prefix_tokens]
        warm = TurnRequest(f"prefix{i}", 0, "sweep", prompt_ids=prefix, forced_ids=filler[:1])
        reqs = []
        for j, size in enumerate(bs.sweep_sizes):
            if len(prefix) + size + bs.sweep_output > max_context:
                continue
            off = (7919 * (i * len(bs.sweep_sizes) + j + 1)) % len(filler)
            new = [filler[(off + k) % len(filler)] for k in range(size)]
            forced = [filler[(off + size + k) % len(filler)] for k in range(bs.sweep_output)]
            reqs.append(TurnRequest(f"prefix{i}", size, "sweep", prompt_ids=prefix + new, forced_ids=forced))
        out.append((warm, reqs))
    return out


def run_sweep(target, plan) -> list[TurnResult]:
    results = []
    for warm, reqs in plan:
        target.run(warm)
        results += [target.run(r) for r in reqs]
    return results


def tune_threshold(loaded, backend, name, sessions, thresholds, max_turns, log=None,
                   max_output=None) -> dict[int, float]:
    """Total request time of the development tuning sessions for each offload threshold."""
    target = InProcessTarget(loaded)
    totals = {}
    for thr in thresholds:
        backend.offload_threshold = thr
        loaded.engine.reset()
        rs = replay_sessions(target, sessions, tokenizer=loaded.tokenizer, max_turns=max_turns, max_output=max_output)
        totals[thr] = round(sum(r.request_s or 0.0 for r in rs), 4)
        if log is not None:
            print(f"  tune {name}: offload threshold {thr}: {totals[thr]:.3f} s", file=log, flush=True)
    return totals


@dataclass
class Prepared:
    """What every policy's replay shares: the engine, the split, the budget and the plan."""
    loaded: object
    dev: list
    held: list
    budget: dict
    skew: dict
    np_info: dict
    base: PolicySettings  # the settings every policy is built with
    load_s: float  # the model's load, every expert on the host (most of it: the experts' copies)
    host_store: bool  # those copies kept for every policy (engine/experts.py keep_host_experts)
    route_counts: list[str]  # the development and held-out counts' digests (RouteCounts.digest)


def prepare(bs: BenchSettings, t_start: float) -> Prepared:
    """Steps 1-4: split, profile, budget and skew, plan and calibrate."""

    dev, held = select_sessions(bs.sessions, bs.max_sessions)
    if not 1 <= bs.rounds <= len(held):  # before the model loads
        raise ConfigError(f"--rounds {bs.rounds}: give 1 to {len(held)} (the held-out sessions are cut into that "
                          "many slices)")
    _say(bs, f"sessions: {len(dev)} development, {len(held)} held-out ({bs.sessions})")
    probe = PolicySettings(gpu_memory=bs.gpu_memory, offload_threshold=1,
                           cpu_backend=bs.cpu_backend, experts=bs.experts)
    t_load = time.perf_counter()
    loaded = load_engine(bs.model, bs.runner, PlacementSettings(experts=bs.experts),  # the formats every policy keeps
                         experts_factory=_probe_factory(probe, lambda m: _say(bs, m)))
    load_s = round(time.perf_counter() - t_load, 2)
    _say(bs, f"[{time.perf_counter() - t_start:.0f} s] model {bs.model} loaded")
    probe_backend = loaded.runner.experts.unwrapped if loaded.runner.experts is not None else None
    host_store = keep_host_experts(loaded.source, getattr(probe_backend, "host", None))
    if host_store:
        _say(bs, "host copies: the profiling placement's page-locked copies of every expert are kept; every policy's "
                 "host copies are views of them and its pools fill from them (no load from the model per policy)")
    if bs.profiles:  # made by `ostinato skew --save-profiles` or an earlier bench on this model
        counts, held_counts = (RouteCounts.load(p, loaded.source.config) for p in bs.profiles)
        held_stats = None  # per-token statistics are not saved with the counts: no persistence figure
        _say(bs, f"profiles: {counts.sessions} development and {held_counts.sessions} held-out sessions from "
                 f"{', '.join(bs.profiles)}")
    else:
        counts = profile_sessions(loaded, dev, progress=bs.progress, desc="profile dev")
        # the same passes and counts as profile_sessions, plus each token's experts (persistence)
        held_counts, held_stats = trace_sessions(loaded, held, progress=bs.progress, desc="profile held-out")
    counts.save(bs.out / "profile-dev.json")
    held_counts.save(bs.out / "profile-held-out.json")
    size, budget = pool_size(loaded, bs, counts)
    fmts = ", ".join(f"{name} x{g['layers']} layers" for name, g in budget["groups"].items())
    _say(bs, f"budget: {budget['bytes'] / 2**30:.2f} GiB ({budget['pool_slots']} mean expert slots; {fmts}), "
             f"sized by {budget['sized_by']}: Ostinato keeps "
             f"{budget['hot']} of {budget['total_experts']} experts resident ({100 * budget['fraction']:.1f}%)")

    residency = plan_residency(loaded.source, counts.total("all"), size, gpu_memory=bs.gpu_memory,
                               profile={"path": str(bs.out / "profile-dev.json"), "sessions": counts.sessions},
                               notes={"pool_slots": size.pool_slots, "budget": size.sized_by})
    base = PolicySettings(expert_slots=budget["pool_slots"], budget_bytes=budget["bytes"], gpu_memory=bs.gpu_memory,
                          profile=counts, residency=residency, cpu_backend=bs.cpu_backend,
                          allow_over_budget=bs.upper_bound, experts=bs.experts)
    np_info = calibrate_np(loaded, bs, base, counts)
    residency.calibration = {**np_info.get("calibration", {}), "upload_threshold": np_info["value"]}
    if np_info.get("calibration"):  # whether the upload path pays for its flex slots, decided before any policy runs
        residency, np_info = decide_upload_path(loaded, bs, residency, counts, budget, np_info)
    residency.save(bs.out / "residency.json")
    skew = routing_figures(counts, held_counts, budget["fraction"], held_stats,
                           loaded.runner.config.num_experts_per_tok)
    _say(bs, f"skew: the top {100 * budget['fraction']:.1f}% of experts by development routes receive "
             f"{100 * skew['held_out_all_share']:.1f}% of held-out routes")
    _say(bs, f"[{time.perf_counter() - t_start:.0f} s] plan: {residency.hot_count} hot experts -> "
             f"{bs.out / 'residency.json'}; fill {fill_text(residency.calibration.get('fill'))}; "
             f"Np = {np_info['value']} ({np_info['how']})")
    return Prepared(loaded, dev, held, budget, skew, np_info,
                    base.with_(residency=residency, upload_threshold=np_info["value"]), load_s, host_store,
                    [counts.digest(), held_counts.digest()])


def decide_upload_path(loaded, bs: BenchSettings, residency: Residency, counts, budget: dict, np_info: dict):
    """The planner's decision on the upload path (planner/pipeline.py plan_upload_path) for the
    calibrated plan, in the budget's bytes: -> (the plan Ostinato runs, np_info with the decision).
    Where the path is dropped, the plan keeps more experts resident and has no Np: the budget's
    entry for Ostinato's plan (hot, fraction, groups) and the model's predictions follow it."""
    cfg = loaded.runner.config
    K, E = cfg.num_experts_per_tok, cfg.num_experts
    sizes = expert_sizes(cfg, loaded.runner.dtype, expert_formats(loaded.source, bs.experts))
    residency = plan_upload_path(residency, residency.calibration, counts, counts.total("all"), sizes, K,
                                 bs.runner.prefill_chunk, limit=budget["bytes"])
    up, fill = residency.calibration["upload_path"], residency.calibration.get("fill")
    np_info = {**np_info, "upload_path": {k: v for k, v in up.items() if k not in ("added", "capacity")},
               "fill": {k: v for k, v in (fill or {}).items() if k not in ("in", "out")}}
    try:  # the model's figures for the plan Ostinato runs (filled again by time saved, maybe grown)
        np_info["predicted"] = model_checks(residency.calibration, counts, residency.hot, cfg)
    except Exception as e:  # noqa: BLE001 - the prediction is a report line, not a requirement
        np_info["predicted"] = {"error": f"{type(e).__name__}: {e}"}
    if residency.upload_path:
        return residency, {**np_info, "how": f"{np_info['how']}; upload path {upload_path_text(up)}"}
    total = len(cfg.moe_layers) * E
    budget.update(hot=residency.hot_count, fraction=round(residency.hot_count / total, 4),
                  groups=hot_groups(residency.hot, K, E, sizes, max_flex=0))
    return residency, {**np_info, "value": None, "how": upload_path_text(up), "measured": np_info["value"]}


def routing_figures(counts, held_counts, fraction: float, held_stats, top_k: int) -> dict:
    """BENCHMARK.md's routing figures of a run: the share of held-out routes on the top `fraction`
    of experts by development routes (all, decode, prefill), its spread over the MoE layers, and,
    given the held-out sessions' per-token statistics (planner/skew.RouteStats), the share of
    top-k experts consecutive tokens keep against independent draws (persistence; held_stats None:
    not measured, as with saved profiles)."""
    out = {"top_fraction": fraction}
    for phase in ("all", "decode", "prefill"):
        share, per_layer = hot_share(counts.total("all"), held_counts.total(phase), fraction)
        out[f"held_out_{phase}_share"] = round(share, 4)
        if phase == "all":
            spread = spread_report(per_layer)
            out["layers"] = {k: spread[k] for k in ("min_layer", "median_layer", "max_layer", "layer_ranges")}
    if held_stats is not None and held_stats.pairs:
        p = persistence_report(held_stats, top_k)
        out["persistence"] = {k: p[k] for k in ("overlap", "independent", "excess")}
    return out


def run_bench(bs: BenchSettings) -> dict:
    """The whole benchmark; returns the result document (also written to bs.out)."""

    t_start = time.perf_counter()
    bs.out = Path(bs.out)
    bs.out.mkdir(parents=True, exist_ok=True)
    p = prepare(bs, t_start)
    loaded, np_ = p.loaded, p.np_info["value"]
    tune_set = _fitting(p.dev, loaded, bs.tune_sessions)
    if bs.tune and not tune_set:
        _say(bs, "no development session's first turn fits the context: offload thresholds stay untuned")
    sweep_plan = sweep_requests(loaded.tokenizer, p.dev, bs, loaded.engine.max_context)
    base = {
        "kind": "ostinato.bench", **environment(loaded, bs), "load_s": p.load_s, "host_store": p.host_store,
        "budget": p.budget,
        "split": {"sessions": bs.sessions, "development": len(p.dev), "held_out": len(p.held),
                  "max_turns": bs.max_turns, "max_output": bs.max_output,
                  "profiles": list(bs.profiles) if bs.profiles else None, "route_counts": p.route_counts},
        "skew": p.skew, "np": {**{k: v for k, v in p.np_info.items() if k != "calibration"},
                               "calibration": _calibration_summary(p.np_info.get("calibration"))},
    }
    policies, turns, merged = _earlier(bs, base) if bs.merge else ({}, {}, [])

    def write(with_plots: bool) -> dict:  # after every policy: a run cut short keeps what it measured
        extra = {"merged_from": merged} if merged else {}
        return finish_result({**base, **extra, "policies": dict(policies),
                              "elapsed_s": round(time.perf_counter() - t_start, 1)}, dict(turns), bs.out, with_plots)

    rounds: dict[str, list[dict]] = {}  # each policy's entries so far, one per round
    for r in range(bs.rounds):
        part = p.held[r::bs.rounds]
        last = r == bs.rounds - 1
        for name in bs.policies if r % 2 == 0 else bs.policies[::-1]:
            if policies.get(name, {}).get("skipped"):
                continue
            t_build = time.perf_counter()  # building the policy's placement (pool fill) and its graphs
            release(loaded)  # the previous backend's memory is free before the next one is built
            held = None  # what the engine holds before this policy's build: the same for every policy, else a leak
            if loaded.runner.device.type == "cuda":  # the allocator peak of this policy alone
                torch.cuda.reset_peak_memory_stats(loaded.runner.device)
                held = round(torch.cuda.memory_allocated(loaded.runner.device) / 2**20)
            try:
                backend = make_policy(name, loaded.source, bs.runner, p.base)
            except ConfigError as e:
                policies[name] = {"skipped": str(e), "held_before_build_mib": held}
                _say(bs, f"{name}: skipped: {e}" + (f" ({held} MiB allocated before its build)"
                                                     if held is not None else ""))
                continue
            t_made = time.perf_counter()
            use_policy(loaded, backend)  # its decode graphs captured
            t_used = time.perf_counter()
            warm_up(loaded)
            t_end = time.perf_counter()
            tuned = (rounds.get(name) or [{}])[0].get("tuning")  # round 0 tunes, the later rounds take its choice
            entry = _run_policy(loaded, backend, name, bs, part, tune_set if not tuned else None,
                                sweep_plan if last else [], np_, tuned["chosen"] if tuned else None)
            entry["over_budget"] = name == "gpu" and p.budget["bytes"] < p.budget["all_experts_bytes"]
            entry["wall_s"]["build"] = round(t_end - t_build, 1)
            # where a build's time goes (session 15: Ostinato's took 80 s, KTransformers' rules on the same pool 31 s)
            entry["build_parts_s"] = {"placement": round(t_made - t_build, 1), "graphs": round(t_used - t_made, 1),
                                      "warm_up": round(t_end - t_used, 1)}
            if held is not None:
                entry["held_before_build_mib"] = held
            rounds.setdefault(name, []).append(entry)
            policies[name], turns[name] = combine_rounds(rounds[name], len(loaded.runner.config.moe_layers), np_)
            s = policies[name]["summary"]
            read = entry.get("host_read_gbps")
            _say(bs, f"[{time.perf_counter() - t_start:.0f} s] {name}"
                     + (f" (round {r + 1} of {bs.rounds}, {len(part)} sessions)" if bs.rounds > 1 else "")
                     + f": TTFT after tool {s['ttft_ms']['median']['tool']} ms, TPOT {s['tpot_ms']['median']} ms, "
                     f"total {s['request_s']['total']} s (wall: "
                     + ", ".join(f"{k} {v} s" for k, v in entry["wall_s"].items()) + ")"
                     + (f"; host read {read['before']} -> {read['after']} GB/s ({read['probe']})" if read else ""))
            backend = None  # nothing but the engine may hold it: release() must free its pool for the next
            write(with_plots=False)
    release(loaded)
    release_host_experts(loaded.source)
    return write(with_plots=True)


# what two runs must share for --merge to set their policies side by side: the machine (GPU and CPU models,
# cores, torch) and the thread layout too, or a baseline from an H200 would meet Ostinato from an H100
MERGE_KEYS = ("model", "dtype", "max_context", "cap", "budget", "split", "hardware", "threads")


def _earlier(bs: BenchSettings, base: dict) -> tuple[dict, dict, list]:
    """The policies and turns of the results.json already in bs.out, if its run measured the
    same thing (MERGE_KEYS, and Np unless this run measures Ostinato again: no baseline uses
    Np); -> (policies, turns, [where they came from])."""
    import json

    path = bs.out / "results.json"
    if not path.is_file():
        return {}, {}, []
    prev = json.loads(path.read_text())
    differ = [k for k in MERGE_KEYS if not _same_for_merge(prev, base, k)]
    if (prev.get("np") or {}).get("value") != base["np"]["value"] and "ostinato" not in bs.policies:
        differ.append("Np")
    if differ:
        raise ConfigError(f"--merge: {path} was measured with other {', '.join(differ)}: use another --out")
    src = [*prev.get("merged_from", []), {"commit": prev.get("commit"), "date": prev.get("date"),
                                          "policies": [n for n in prev["policies"] if n not in bs.policies]}]
    return ({n: e for n, e in prev["policies"].items() if n not in bs.policies},
            {n: t for n, t in prev.get("turns", {}).items() if n not in bs.policies}, src)


def _same_for_merge(prev: dict, base: dict, key: str) -> bool:
    """Whether two runs' `key` agree for --merge. Splits that both name their route counts (digests) agree
    whether a run profiled them or read the files an earlier run saved; an older split without them
    agrees only by the profiles' paths."""
    a, b = prev.get(key), base.get(key)
    if key == "split" and isinstance(a, dict) and isinstance(b, dict):
        drop = "profiles" if a.get("route_counts") and b.get("route_counts") else "route_counts"
        a, b = ({k: v for k, v in s.items() if k != drop} for s in (a, b))
    return a == b


def _calibration_summary(cal: dict | None) -> dict | None:
    """The calibration's machine-wide figures (upload bandwidth, fitted constants, dense step);
    the per-layer and per-pass tables stay in residency.json."""
    if not cal:
        return None
    return {k: v for k, v in cal.items() if k not in ("layers", "passes")}


def _fitting(sessions, loaded, n: int) -> list:
    """Up to n sessions whose first turn fits the engine's context (tuning replays them)."""
    out = []
    for s in sessions:
        req = session_requests(type(s)(s.id, s.task, s.source, s.tools, s.turns[:1]), loaded.tokenizer)[0]
        if len(req.prompt_ids) + len(req.forced_ids) <= loaded.engine.max_context:
            out.append(s)
        if len(out) >= n:
            break
    return out


def probe_policy(cfg, sizes: dict[int, tuple[str, int]], room: int | None) -> tuple[str, int]:
    """The profiling backend's policy and expert budget: `layers` with no resident layer (its K zero slots and
    one layer staged whole, E slots, in every format group), where those fit `room` (the bytes the cap leaves
    the experts; None: no cap); else `cpu` (K zero slots), as where DeepSeek-V3's 22.5 GB bf16 layers meet a
    24 GiB cap (session 49: the staging took the cap, and the load ran out of GPU memory). Either computes
    every expert of every pass exactly, so the routes are the model's."""
    per_expert = sum(dict(sizes.values()).values())  # one expert of each format group
    staged = per_expert * (cfg.num_experts_per_tok + cfg.num_experts)
    if room is None or staged <= room:
        return "layers", staged
    return "cpu", per_expert * cfg.num_experts_per_tok


def _probe_factory(probe: PolicySettings, say=None):
    """The profiling backend (probe_policy), with an offload threshold of 1: every pass stages its layers'
    experts on the GPU, or, where they do not fit the cap, the CPU computes them."""
    def make(source, runner_settings):
        cfg = source.config
        dtype = runner_settings.torch_dtype(cfg.torch_dtype)
        sizes = expert_sizes(cfg, dtype, expert_formats(source, probe.experts))
        room = None
        if probe.gpu_memory is not None and runner_settings.torch_device().type == "cuda":
            room = probe.gpu_memory - capacity_under(source, runner_settings, probe.gpu_memory, probe.experts).fixed
        name, budget = probe_policy(cfg, sizes, room)
        if name != "layers" and say is not None:
            say(f"profiling on the CPU: a layer staged whole ({probe_policy(cfg, sizes, None)[1] / 2**30:.1f} GiB "
                f"with the zero slots) does not fit the {room / 2**30:.1f} GiB the cap leaves the experts")
        return policy_factory(name, probe.with_(budget_bytes=budget))(source, runner_settings)
    return make


def _run_policy(loaded, backend, name, bs: BenchSettings, held, tune_set, sweep_plan, np_,
                threshold: int | None = None) -> dict:
    """Tune (where the policy has a threshold and tune_set is given; else `threshold`, an earlier
    round's choice, if any), replay the held-out sessions `held`, run the sweep. The entry keeps
    the TurnResults in "_results" and "_sweep" (combine_rounds makes its summary and turns)."""
    entry: dict = {"resident_experts": backend.resident_experts(), "decode_graph": loaded.runner.graphs is not None}
    cpu = backend.cpu
    if cpu is not None:  # the pool's workers (a host-driven baseline's host thread is its last worker)
        entry["cpu_workers"] = list(cpu.cpus)
        # "torch": the native kernels did not build or run here, and the report says so (session 50: a build that
        # failed on the GPU machine alone fell back without a word)
        entry["cpu_backend"] = cpu.backend + (f" ({cpu.fallback_reason})" if cpu.fallback_reason else "")
    if bs.tune and name in TUNED and tune_set:
        turns = bs.tune_max_turns or bs.max_turns
        totals = tune_threshold(loaded, backend, name, tune_set, bs.thresholds, turns, _log(bs), bs.max_output)
        best = min(totals, key=totals.get)
        backend.offload_threshold = best
        entry["tuning"] = {"offload_threshold": totals, "chosen": best}
    elif threshold is not None:
        backend.offload_threshold = threshold
    if name not in OSTINATO_STEPS and backend.offload_threshold is not None:
        entry["offload_threshold"] = backend.offload_threshold
    if name in OSTINATO_STEPS:
        hybrid = backend.unwrapped  # a HybridExperts (the decode graph's wrapper hands its passes to it)
        entry["upload_threshold"] = hybrid.upload_threshold
        entry["split_uploads"] = hybrid.mixed is not None  # Np unused where it applies (layers/moe/hybrid.py)
        if hybrid.mixed is not None:
            entry["split_uploads_from"] = hybrid.mixed.min_tokens
            entry["split_uploads_to"] = hybrid.mixed.max_tokens
        entry["borrowing"] = hybrid.borrow is not None
        staging = getattr(backend, "staging", None)  # captured passes' (layers/moe/staging.py)
        if staging is not None and staging.prefetches:  # what the pools took of OSTINATO_PREFETCH (a third of
            entry["prefetch_taken"] = sorted(set(staging.prefetch.values()))  # their flex slots at most)
    if cpu is not None:  # the host's read bandwidth with the policy's own pool, just before and after its replay:
        # it drifts by 15-20% between runs of a shared VM, as much as policies differ by (report.py warns
        # where two compared replays ran at bandwidths that differ); one buffer for both, freed after
        buf = read_buffer(bs.host_read_gib)
        cpus = set(cpu.cpus) | set(loaded.runner.threads.host)  # the workers and the caller, as calibrate takes
        read_before = host_read_gbps(cpu, cpus, buf=buf)
    loaded.engine.reset()
    before = loaded.runner.placement_stats()
    counters = host_counters()
    t0 = time.perf_counter()
    results = _replay_with_progress(loaded, held, bs, name)
    t1 = time.perf_counter()
    entry["host_counters"] = host_counter_delta(counters, host_counters())  # what else the host did meanwhile
    if cpu is not None:
        read_after = host_read_gbps(cpu, cpus, buf=buf)
        entry["host_read_gbps"] = {"before": read_before["gbps"], "after": read_after["gbps"],
                                   "probe": read_after["probe"]}
        del buf
    after = loaded.runner.placement_stats()
    segments = segment_costs(before, after)
    if segments:
        entry["graph_segments"] = segments
    compiled = int(after.get("triton_compiles", 0) - before.get("triton_compiles", 0))
    if compiled:  # which kernels, with their specialisations: a turn that met one paid for it
        entry["triton_compiled"] = [list(c) for c in triton_compiles.recent[-compiled:]]
    t2 = time.perf_counter()
    sweep = run_sweep(InProcessTarget(loaded), sweep_plan)
    entry["wall_s"] = {"replay": round(t1 - t0, 1), "sweep": round(time.perf_counter() - t2, 1)}
    memory = memory_figures(loaded.runner.device)  # beside the cap, as nvidia-smi counts it
    if memory is not None:
        entry["gpu_memory"] = memory
    entry["_results"], entry["_sweep"] = results, sweep
    return entry


def combine_rounds(entries: list[dict], moe_layers: int, np_) -> tuple[dict, list[dict]]:
    """One policy's entry from its rounds' (_run_policy's, in order) -> (entry, its turns as JSON):
    the summary over every round's turns, the sweep of the round that ran it, wall times and build
    parts summed, and the host read probe as the mean of the rounds' (each round's in `rounds`); the host's
    counters (host_counters) per round, in `by_round`."""
    results = [r for e in entries for r in e["_results"]]
    sweep = [r for e in entries for r in e["_sweep"]]
    out = {k: v for k, v in entries[-1].items() if k not in ("_results", "_sweep")}
    out.update({k: v for k, v in entries[0].items() if k in ("tuning", "offload_threshold")})
    compiled = [c for e in entries for c in e.get("triton_compiled", [])]
    if compiled:
        out["triton_compiled"] = compiled
    for key in ("wall_s", "build_parts_s"):
        if all(key in e for e in entries):
            out[key] = {k: round(sum(e[key][k] for e in entries), 1) for k in entries[0][key]}
    reads = [e["host_read_gbps"] for e in entries if e.get("host_read_gbps")]
    if len(entries) > 1:
        out["rounds"] = len(entries)
        out["by_round"] = []  # each round's own medians and total: the spread a reader weighs the ratios by
        for e in entries:
            r = summarize(e["_results"], moe_layers)
            out["by_round"].append({"sessions": r["sessions"], "ttft_tool_ms": r["ttft_ms"]["median"]["tool"],
                                    "tpot_ms": r["tpot_ms"]["median"], "total_s": r["request_s"]["total"],
                                    "host_read_gbps": e.get("host_read_gbps"),
                                    "host_counters": e.get("host_counters")})
        out.pop("host_counters", None)  # the last round's alone: each round's is in by_round
        if reads:
            mean = lambda k: round(sum(r[k] for r in reads) / len(reads), 2)  # noqa: E731
            out["host_read_gbps"] = {"before": mean("before"), "after": mean("after"), "probe": reads[-1]["probe"],
                                     "rounds": [[r["before"], r["after"]] for r in reads]}
    out["summary"] = summarize(results, moe_layers)
    out["sweep"] = sweep_summary(sweep, np_)
    return out, [r.to_json() for r in results + sweep]


def segment_costs(before: dict, after: dict) -> dict | None:
    """A cache's decode steps replayed as graph segments (layers/moe/segmented.py): what a cut cost
    over the held-out replay, on the timed steps: the GPU's wait from the end of one segment to
    the next one's inputs, over all cuts and over the cuts with no upload or CPU work (the sync
    alone). None for a backend that does not cut its steps."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("segment_cuts", "segment_gap_ms", "sync_cuts", "sync_gap_ms")}
    if not d["segment_cuts"]:
        return None
    return {"timed_cuts": int(d["segment_cuts"]), "gap_ms_per_cut": round(d["segment_gap_ms"] / d["segment_cuts"], 4),
            "sync_cuts": int(d["sync_cuts"]),
            "sync_ms_per_cut": round(d["sync_gap_ms"] / d["sync_cuts"], 4) if d["sync_cuts"] else None}


def _replay_with_progress(loaded, sessions, bs: BenchSettings, name: str) -> list[TurnResult]:
    from tqdm import tqdm

    n = sum(len(s.turns[:bs.max_turns]) for s in sessions)
    with tqdm(total=n, desc=f"replay {name}", unit="turn", disable=not bs.progress, leave=False) as bar:
        return replay_sessions(InProcessTarget(loaded), sessions, tokenizer=loaded.tokenizer, max_turns=bs.max_turns,
                               max_output=bs.max_output, on_turn=lambda r: bar.update(1))


def with_(bs: BenchSettings, **kw) -> BenchSettings:
    return replace(bs, **kw)
