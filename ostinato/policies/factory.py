"""Policy name + settings -> an experts backend, under the one budget every policy shares.

    backend = make_policy("layers", source, runner_settings, PolicySettings(expert_slots=...))
    loaded = load_engine(model, runner_settings, experts_factory=policy_factory("layers", settings))

`use_policy` swaps the backend of a loaded engine (bench loads the dense model once and
replays every policy on it); the KV cache is dropped so each policy starts alike.
"""
from __future__ import annotations

import gc
from pathlib import Path

import torch

from ostinato.config import ConfigError
from ostinato.engine.gpu_memory import allocator_account, apply_memory_cap
from ostinato.engine.placement import PlacementSettings, build_hybrid, flex_of, placed_residency, resolve_np
from ostinato.engine.residency import Residency
from ostinato.engine.routes import RouteCounts
from ostinato.engine.experts import ModelExperts, hybrid_from_parts, pools_bytes
from ostinato.policies.caches import DecayingCache, ExpertCache
from ostinato.policies.settings import FLEX_STEPS, OSTINATO_STEPS, PolicySettings, check_policy
from ostinato.policies.static import BUILDERS, ktransformers_flex

# policy -> build(spec, budget bytes, settings, development counts): each an executor (HybridExperts);
# the static placements decode as one CUDA graph per GPU, the caches (an admission on it) as graph segments
BUILD = {**BUILDERS, "expert-cache": ExpertCache.build, "decaying-cache": DecayingCache.build}
CACHES = ("expert-cache", "decaying-cache")


def load_profile(profile) -> RouteCounts | None:
    if profile is None or isinstance(profile, RouteCounts):
        return profile
    if not Path(profile).is_file():
        raise ConfigError(f"--profile {profile}: no such file (write one with `ostinato profile`)")
    return RouteCounts.load(profile)


def load_residency(residency) -> Residency | None:
    if residency is None or isinstance(residency, Residency):
        return residency
    return Residency.load(residency)


def residency_bytes(spec: ModelExperts, residency: Residency) -> int:
    """Bytes of a residency's pools (per format group: hot, K zero and the group's flex slots as
    engine/placement.py allocates them: flex_of)."""
    return pools_bytes(spec, residency.hot, flex_of(residency, spec.num_experts, spec.formats))


def budget_bytes(spec: ModelExperts, settings: PolicySettings) -> int:
    """The budget in bytes, what every policy's pools must fit: given, or slots of the mean expert's
    bytes, or (so that a baseline runs under the same budget as a plan) the residency's pools."""
    if settings.budget_bytes is not None:
        return int(settings.budget_bytes)
    if settings.expert_slots is not None:
        return settings.expert_slots * spec.expert_bytes
    residency = load_residency(settings.residency)
    if residency is not None:
        return residency_bytes(spec, residency)
    raise ConfigError("no expert budget: give --expert-budget (bytes for the expert pool) or the --residency "
                      "whose pool the policies share")


def build_policy(name: str, spec: ModelExperts, settings: PolicySettings):
    """A policy over a model described by `spec` (no weight-source checks)."""
    check_policy(name)
    if name in OSTINATO_STEPS:
        place = PlacementSettings(upload_threshold=settings.upload_threshold)
        residency = placed_residency(place, _ostinato_residency(spec, settings, name))
        np_ = resolve_np(place, residency)
        upload = OSTINATO_STEPS[name][0]
        return hybrid_from_parts(spec, residency.hot, np_ if upload else None, settings.cpu_backend,
                                 flex=flex_of(residency, spec.num_experts, spec.formats))
    settings = settings.with_(residency=load_residency(settings.residency))
    if name == "ktransformers" and settings.residency is not None:  # the fill by routes (its frequency strategy);
        settings = settings.with_(residency=settings.residency.frequency_plan())
        kt = settings.residency
        _check_budget(spec, settings, kt, pools_bytes(spec, kt.hot, ktransformers_flex(spec, kt)))
    return BUILD[name](spec, budget_bytes(spec, settings), settings, load_profile(settings.profile))


def make_policy(name: str, source, runner_settings, settings: PolicySettings = PolicySettings()):
    """The experts backend of policy `name` for a model's weight source, under settings.gpu_memory."""
    check_policy(name)
    spec = ModelExperts.from_source(source, runner_settings, graphs=name not in CACHES, experts=settings.experts)
    if name in OSTINATO_STEPS:
        residency = _ostinato_residency(spec, settings, name)
        upload, mixed, borrow = OSTINATO_STEPS[name]
        place = PlacementSettings(gpu_memory=settings.gpu_memory, upload_threshold=settings.upload_threshold,
                                  cpu_backend=settings.cpu_backend, mixed=mixed, borrow=borrow,
                                  experts=settings.experts)
        h = build_hybrid(source, residency, place, spec.device, spec.dtype, spec.max_tokens,
                         runner_settings.thread_layout())
        if not upload:
            h.upload_threshold = None
        return h
    apply_memory_cap(spec.device, settings.gpu_memory)
    try:
        return build_policy(name, spec, settings)
    except torch.OutOfMemoryError as e:
        raise ConfigError(f"policy {name}: its expert slots do not fit the GPU memory cap ({allocator_account(e)}); "
                          "give a smaller expert budget or a larger --gpu-memory") from None


def policy_factory(name: str, settings: PolicySettings = PolicySettings()):
    """An experts factory for ostinato.load.load_engine(..., experts_factory=...)."""
    check_policy(name)
    return lambda source, runner_settings: make_policy(name, source, runner_settings, settings)


def use_policy(loaded, backend) -> None:
    """Put `backend` into a loaded engine in place of its current experts (closed and freed
    first, so the two never hold memory together, and its decode graphs dropped); the
    runner captures decode graphs for the new one when its settings ask for them and the
    backend allows it; the session slot starts empty."""
    if loaded.runner.experts is not backend:
        release(loaded)
    loaded.runner.set_experts(backend)
    loaded.engine.reset()


def release(loaded) -> None:
    """Close the engine's experts backend, drop its decode graphs, free its memory."""
    runner = loaded.runner
    old = runner.experts
    runner.set_experts(None)
    if old is not None:
        old.close()
    # the backend's reference cycles (hybrid <-> borrowing <-> graph backend) are collected only
    # once nothing here names it: on the H200 the next policy's pool failed to fit beside it
    del old
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _ostinato_residency(spec: ModelExperts, settings: PolicySettings, name: str) -> Residency:
    """The plan an Ostinato step runs (FLEX_STEPS: the plan with the upload path), checked against the budget."""
    residency = load_residency(settings.residency)
    if residency is None:
        raise ConfigError(f"policy {name} needs a residency file (--residency, from `ostinato plan`)")
    if name in FLEX_STEPS:
        residency = residency.upload_plan()
    _check_budget(spec, settings, residency, residency_bytes(spec, residency))
    return residency


def _check_budget(spec: ModelExperts, settings: PolicySettings, residency: Residency, need: int) -> None:
    """`need`: the bytes of the pools the policy builds on the residency (its flex slots by its rule)."""
    if settings.expert_slots is None and settings.budget_bytes is None:
        return
    budget = budget_bytes(spec, settings.with_(residency=None))
    if need > budget:
        raise ConfigError(f"the residency needs {need / 2**20:.1f} MiB of expert pool ({residency.hot_count} hot "
                          f"experts, {spec.top_k} zero slots per format group, the rest flex) but the budget is "
                          f"{budget / 2**20:.1f} MiB: plan for this budget")
