"""`ostinato serve MODEL --gpu-memory CAP` without a residency file: the plan for this model, cap
and machine comes from the plan cache, or is made now and kept there.

A plan is cached under `$OSTINATO_CACHE` (default `~/.cache/ostinato`), in `plans/NAME-HASH/`,
keyed by what it depends on (`plan_key`): the model's fingerprint (shapes and router weights),
the cap, the KV context, the GPU and the CPU of this machine and the CPU workers, the compute
dtype and the experts' format. The folder holds `key.json`, `profile.json` (the development
routes), `residency.json` (the plan, calibrated) and `residency.served.json` once the server has
routed requests with it (planner/served.py).

Making a plan, in one engine (the dense part loads once):
1. the engine loads in hybrid with nothing resident: the dense weights, the KV cache and an
   empty expert pool under the cap; never every expert on the GPU;
2. profiling: the sessions' token streams run through it as prefill passes (long ones take the
   upload path) and their routes are counted; with `replan` and served routes, the learned
   counts are used instead (planner/served.py);
3. planning: the capacity test on the cap, then the most-routed experts that fit
   (planner/pipeline.py), as `ostinato plan` does;
4. the planned pool replaces the empty one in the loaded engine;
5. calibrating: the cost model's constants and Np, measured in that engine (planner/calibrate.py);
   then whether the upload path pays for its flex slots over the development sessions
   (planner/pipeline.py plan_upload_path): if not, the pool is built again with more hot experts
   and no flex slots;
6. the plan goes into the cache, and the engine serves.

Every phase is reported to `progress(phase, done, of)` (serve's /health) and timed into the
plan's notes. `serve`'s parser loads this module for its cache key, so the phases import the
engine inside their functions (jobs/plan.py says why).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ostinato.config import ConfigError, cache_root
from ostinato.planner.calibrate import CalibrateSettings, cpu_model, device_name
from ostinato.planner.served import file_lock, write_atomic

log = logging.getLogger("ostinato")

PLAN_VERSION = 2  # a change in how plans are made invalidates the cached ones (2: the upload path decided)
DEFAULT_SESSIONS = "embedded:8"


@dataclass(frozen=True)
class AutoPlan:
    sessions: str = DEFAULT_SESSIONS  # what to profile on: a session spec (sessions/read.py)
    replan: bool = False  # make a new plan even if one is cached (from the served routes, if any)
    calibrate: CalibrateSettings = CalibrateSettings()
    cache: Path | None = None  # default: cache_root()


def plan_key(source, settings, place, sessions: str = DEFAULT_SESSIONS) -> dict:
    """What a plan depends on (module docstring); `sessions`: the spec it profiles (a file or folder
    by its resolved path)."""
    from ostinato.engine.residency import model_fingerprint

    cfg, device = source.config, settings.torch_device()
    gpu = {"name": device_name(device)}
    if device.type == "cuda":
        gpu["memory"] = torch.cuda.get_device_properties(device).total_memory
    threads = settings.thread_layout()
    return {"version": PLAN_VERSION, "model": model_fingerprint(source), "gpu_memory": place.gpu_memory,
            "kv_tokens": settings.context(cfg), "gpu": gpu, "cpu": cpu_model(), "cpu_workers": len(threads.workers),
            "dtype": str(settings.torch_dtype(cfg.torch_dtype)).removeprefix("torch."), "experts": place.experts,
            "sessions": sessions if sessions.startswith("embedded") else str(Path(sessions).expanduser().resolve())}


def plan_dir(model: str, key: dict, root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(model).rstrip("/")).name or str(model)).strip("-") or "model"
    return (root or cache_root()) / "plans" / f"{name[:48]}-{digest}"


def _noop(phase: str, done: int | None = None, of: int | None = None) -> None:
    pass


def load_planned(model: str, settings, place, auto: AutoPlan = AutoPlan(), progress=_noop):
    """The engine for `model` under `place.gpu_memory` with no residency given: every expert on the
    GPU when they all fit under the cap, else the cached plan, else a plan made now (module
    docstring). -> a Loaded whose `residency` and `placement.residency` name the plan used."""
    from ostinato.load import all_resident_fit, load_engine
    from ostinato.sources import open_source

    if place.residency or place.gpu_memory is None:
        raise ValueError("load_planned plans for a cap, without a residency")
    if len(settings.device_names()) > 1:
        raise ConfigError("serving several GPUs without a residency is not planned for you yet: plan with "
                          "`ostinato plan --devices ... --gpu-memory ...`, then give --residency")
    source = open_source(model)
    if all_resident_fit(source, settings, place.gpu_memory):
        log.info("every expert fits under the GPU memory cap: no plan needed")
        progress("loading weights")  # nothing to learn for: no route tally
        return load_engine(model, dataclasses.replace(settings, count_routes=False), place, announce=False)
    key = plan_key(source, settings, place, auto.sessions)
    folder = plan_dir(model, key, auto.cache)
    path = folder / "residency.json"
    if not (path.is_file() and not auto.replan):
        folder.mkdir(parents=True, exist_ok=True)
        with file_lock(path):  # a second server of the same key waits, then loads the first one's plan
            if not path.is_file() or auto.replan:
                write_atomic(folder / "key.json", json.dumps(key, indent=1) + "\n")
                return _make_plan(model, source, settings, place, auto, folder, progress)
    log.info("plan from the cache: %s", path)
    progress("loading weights")
    return load_engine(model, settings, dataclasses.replace(place, residency=str(path)), announce=False)


def load_cold(model: str, source, settings, place, path: Path):
    """The engine with no expert resident: the dense part, the KV cache and an empty pool (its zero
    and flex slots) under the cap, every expert in host memory; the plan it runs is written to
    `path`. Profiling runs on it, so that it never needs every expert on the GPU."""
    from ostinato.load import load_engine
    from ostinato.loader.build import weight_formats
    from ostinato.planner.pipeline import plan_residency, size_pool

    cfg = source.config
    zeros = {l: torch.zeros(cfg.num_experts) for l in cfg.moe_layers}
    size = size_pool(cfg, zeros, settings.torch_dtype(cfg.torch_dtype), gpu_memory=place.gpu_memory, hot_fraction=0.0,
                     kv_tokens=settings.context(cfg), formats=weight_formats(source, place.experts))
    plan_residency(source, zeros, size, notes={"planned_by": "the profile's engine: no expert resident"}).save(path)
    return load_engine(model, settings, dataclasses.replace(place, residency=str(path)), announce=False)


def _make_plan(model, source, settings, place, auto: AutoPlan, folder: Path, progress):
    from ostinato.sessions.read import load_sessions
    from ostinato.engine.placement import apply_calibration, hybrid_factory
    from ostinato.engine.routes import RouteCounts
    from ostinato.loader.build import weight_formats
    from ostinato.planner.calibrate import calibrate, model_checks
    from ostinato.engine.sizes import expert_sizes
    from ostinato.planner.pipeline import (fill_text, plan_residency, plan_upload_path, route_report, size_pool,
                                          upload_path_text)
    from ostinato.planner.run_profile import profile_sessions
    from ostinato.planner.served import ServedRoutes, learned_profile, served_path
    from ostinato.policies.factory import release, use_policy

    cfg = source.config
    dtype = settings.torch_dtype(cfg.torch_dtype)
    kv, cap = settings.context(cfg), place.gpu_memory
    formats = weight_formats(source, place.experts)
    path, times = folder / "residency.json", {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        times[name] = round(now - clock, 2)
        clock = now

    progress("loading weights")
    cold = folder / f"cold-{os.getpid()}.json"
    loaded = load_cold(model, source, settings, place, cold)
    cold.unlink()
    lap("load")

    served = ServedRoutes(served_path(path))
    dev_path = folder / "profile.json"
    dev = RouteCounts.load(dev_path) if dev_path.is_file() else None
    prof = dev  # the routes the plan is made and decided from
    if auto.replan and served.counts is not None:
        prof, how = learned_profile(dev, served, settings.prefill_chunk), f"{served.served_tokens} served tokens"
        counts = prof.total("all")
        log.info("planning again from the routes of %d served tokens (the development profile weighs %.3f now)",
                 served.served_tokens, served.dev_weight())
    else:
        sessions = load_sessions(auto.sessions)
        if not sessions:
            raise ConfigError(f"--sessions {auto.sessions}: no sessions to plan on")
        progress("profiling", 0, len(sessions))
        dev = profile_sessions(loaded, sessions, desc="profiling", on_session=lambda i, n: progress("profiling", i, n))
        write_atomic(dev_path, json.dumps(dev.to_json()) + "\n")
        prof, counts, how = dev, dev.total("all"), f"{dev.sessions} sessions ({auto.sessions})"
        lap("profile")

    progress("planning")
    size = size_pool(cfg, counts, dtype, gpu_memory=cap, kv_tokens=kv, formats=formats)
    profile = {"path": str(dev_path), "sessions": dev.sessions if dev else 0, "tokens": dev.tokens if dev else {},
               "max_tokens": dev.max_tokens if dev else 0, "counts": how}
    res = plan_residency(source, counts, size, profile=profile, notes={"planned_by": "serve"})
    final = dataclasses.replace(place, residency=str(path))
    release(loaded)  # the empty pool goes before the planned one is allocated
    use_policy(loaded, hybrid_factory(final, res)(source, loaded.runner.settings))
    lap("plan")

    progress("calibrating")
    cal = calibrate(loaded, auto.calibrate)
    res.calibration = cal
    if dev is not None:  # filled again by time saved, and whether the upload path pays for its flex slots, on
        # the routes it was planned from (served ones with the passes they came in: served.py learned_profile);
        # the pool is built again for the plan that comes of it
        built = res
        res = plan_upload_path(res, cal, prof, counts, expert_sizes(cfg, dtype, formats.experts), cfg.num_experts_per_tok,
                               settings.prefill_chunk, borrow=place.borrow)
        log.info("fill %s; upload path %s", fill_text(res.calibration.get("fill")),
                 upload_path_text(res.calibration["upload_path"]))
        res.calibration["model"] = {"profile": str(dev_path), **model_checks(res.calibration, dev, res.hot, cfg)}
        res.notes["report"] = {"development": route_report(dev, res.hot, len(cfg.moe_layers))}
        if res.hot != built.hot or res.upload_path != built.upload_path:
            release(loaded)
            use_policy(loaded, hybrid_factory(final, res)(source, loaded.runner.settings))
    apply_calibration(loaded.runner.experts.unwrapped, final, res)
    loaded.engine.reset()
    lap("calibrate")
    res.notes["phases_s"] = times
    write_atomic(path, json.dumps(res.to_json(), indent=1) + "\n")  # a second server never reads half a plan
    loaded.residency, loaded.placement = res, final
    log.info("planned %d of %d experts resident for %s under the cap (%s), in %s s -> %s", res.hot_count,
             len(cfg.moe_layers) * cfg.num_experts, model, how,
             " + ".join(f"{k} {v}" for k, v in times.items()), path)
    return loaded
