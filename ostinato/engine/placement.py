"""Builds the hybrid placement from a residency file, under a GPU memory cap: on one device
(build_hybrid), or a pool per device of a split model (build_split_hybrid; engine/devices.py
runs it).

Order matters: the cap is set first, then the expert pool and its flex slots are
allocated before the dense model, the KV cache or any activation, so a prefill never
competes with them; the cold experts are loaded once into page-locked host memory.
The flex slots are what the plan's capacity test counted: each format group's most cold
experts of a layer, at most the residency's `max_flex` (pool.bounded_flex).
A plan whose upload path did not pay for its flex slots (Residency.upload_path, decided by the
planner from its calibration) gets none, no Np and no split with uploads: every pass takes the
split path, and nothing is uploaded.

Experts of a GGUF file stay in its block formats (`experts="native"`, the default) in the
pools and in host memory, one pool per format (layers/moe/pool.py); `experts="bf16"`
dequantizes them at load, as for a checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.config import ConfigError
from ostinato.engine.devices import SplitExperts, device_scope, gpus_in_order, in_order, physical, resolve_layer_devices
from ostinato.engine.experts import ModelExperts, expert_loader, host_copies, hybrid_from_parts, stored_experts
from ostinato.engine.gpu_memory import apply_memory_cap
from ostinato.engine.residency import Residency
from ostinato.threads import ThreadLayout, on_workers
from ostinato.layers.moe.borrow import Borrowing
from ostinato.layers.moe.cpu_experts import CpuExperts
from ostinato.layers.moe.hybrid import HybridExperts, MixedPass
from ostinato.layers.moe.pool import ExpertPools, bounded_flex
from ostinato.loader.build import check_mode, expert_formats, load_jobs, weight_formats


@dataclass(frozen=True)
class PlacementSettings:
    residency: str | None = None
    gpu_memory: int | None = None  # bytes; the engine never allocates past it
    # Np; default: the residency's calibrated one, else 512; none where the plan dropped the upload path
    # (given, it asks for the plan with the upload path: placed_residency)
    upload_threshold: int | None = None
    cpu_backend: str = "auto"
    # lend the flex slots to cold experts during decode (DESIGN.md "Borrowed memory"): off by default,
    # it decoded 6% slower than without on the held-out sessions (results/2026-12-01-h200-s6/README.md)
    borrow: bool = False
    borrow_wait_copies: bool = False  # switch borrowed experts in at the boundary their copy starts (tests)
    mixed: bool = True  # split passes upload their most-routed cold experts (needs a calibration: hybrid.py)
    # "native": a GGUF file's experts (and on a GPU its dense linear weights) stay in its block formats; "bf16":
    # everything dequantized at load
    experts: str = "native"

    def __post_init__(self):
        check_mode(self.experts)


def expert_math(cfg) -> dict:
    """What the model's experts compute beyond their weights, as pools and host copies take it:
    the activation and whether they carry biases (gpt-oss)."""
    return {"act": cfg.expert_act, "bias": cfg.expert_bias}


DEFAULT_UPLOAD_THRESHOLD = 512  # used only until `ostinato calibrate` has measured Np


def placed_residency(place: PlacementSettings, residency: Residency) -> Residency:
    """The plan the engine builds: the residency as planned, or the plan with the upload path it
    was made from (Residency.upload_plan) when the settings use its flex slots: borrowed memory,
    or an Np given."""
    if place.borrow or place.upload_threshold:
        return residency.upload_plan()
    return residency


def flex_of(residency: Residency, num_experts: int, formats, hot: dict[int, list[int]] | None = None) -> dict | int:
    """The flex slots to allocate per format group (ExpertPools.build, pools_bytes) for `hot`
    (default: the plan's): none for a plan without the upload path, else each group's most cold
    experts of a layer, at most the plan's bound (pool.bounded_flex, Residency.max_flex)."""
    if not residency.upload_path:
        return 0
    return bounded_flex(residency.hot if hot is None else hot, num_experts, formats, residency.max_flex)


def build_hybrid(source, residency: Residency, place: PlacementSettings, device: torch.device,
                 dtype: torch.dtype, max_tokens: int, threads: ThreadLayout) -> HybridExperts:
    """The plan on one device, built as every placement is (engine/experts.py hybrid_from_parts);
    threads: the process's thread layout (its CPU pool's workers)."""
    residency = placed_residency(place, residency)
    residency.check(source)
    apply_memory_cap(device, place.gpu_memory)
    spec = ModelExperts.of(source, device, dtype, max_tokens, threads, place.experts)
    try:
        hybrid = hybrid_from_parts(spec, residency.hot, resolve_np(place, residency), place.cpu_backend,
                                   flex=flex_of(residency, spec.num_experts, spec.formats))
    except torch.OutOfMemoryError:
        raise ConfigError(f"the expert pool ({residency.hot_count} hot experts and their flex slots) does "
                          "not fit the GPU memory cap: plan with a smaller --gpu-memory or --hot-fraction") from None
    return configure(hybrid, place, residency)


def resolve_np(place: PlacementSettings, residency: Residency) -> int | None:
    """Np: None for a plan without the upload path (it has no flex slots to upload into), else
    the setting, else the residency's calibrated one, else the default."""
    residency = placed_residency(place, residency)
    if not residency.upload_path:
        return None
    return int(place.upload_threshold or residency.calibration.get("upload_threshold") or DEFAULT_UPLOAD_THRESHOLD)


def configure(hybrid: HybridExperts, place: PlacementSettings, residency: Residency) -> HybridExperts:
    """The placement's options on a built HybridExperts: borrowed memory, split with uploads."""
    if place.borrow and any(p.num_slots > p.flex_lo for p in hybrid.pools.groups):
        hybrid.borrow = Borrowing(hybrid, wait_copies=place.borrow_wait_copies)
    return apply_calibration(hybrid, place, residency)


def apply_calibration(hybrid: HybridExperts, place: PlacementSettings, residency: Residency) -> HybridExperts:
    """What the residency's calibration decides for passes of many tokens: Np, and the split with
    uploads; neither for a plan without the upload path (no flex slots to upload into). Passes
    only (a decode step is one token), so a loaded engine takes it in place."""
    residency = placed_residency(place, residency)
    hybrid.upload_threshold = resolve_np(place, residency)
    # a CPU-only machine has no second link to balance
    mixed = place.mixed and hybrid.on_cuda and residency.upload_path
    hybrid.mixed = MixedPass.from_calibration(residency.calibration) if mixed else None
    hybrid.stage_passes = place.mixed and hybrid.on_cuda  # a rule of its own, measured apart (staging.py)
    # the costs of the split with uploads at any size, for the staging rule "balance"
    hybrid.stage_costs = (MixedPass.from_calibration(residency.calibration, measured=False)
                          if hybrid.stage_passes and residency.calibration else None)
    return hybrid


def hybrid_factory(place: PlacementSettings, residency: Residency | None = None):
    """An experts factory for load_engine (None when no residency is given); `residency` is
    the plan already read (or made in memory), if the caller has it."""
    if residency is None and not place.residency:
        return None
    residency = residency or Residency.load(place.residency)

    def make(source, runner_settings):
        cfg = source.config
        dtype = runner_settings.torch_dtype(cfg.torch_dtype)
        kv_tokens = runner_settings.context(cfg)
        layer_devices = resolve_layer_devices(cfg, runner_settings.device_names(), residency, kv_tokens, dtype,
                                              weight_formats(source, place.experts))
        threads = runner_settings.thread_layout(layer_devices)
        if layer_devices is not None:  # MoE layers split across devices: a pool on each
            return build_split_hybrid(source, residency, place, layer_devices, dtype, runner_settings.prefill_chunk,
                                      threads)
        device = runner_settings.torch_device()
        return build_hybrid(source, residency, place, device, dtype, runner_settings.prefill_chunk, threads)

    return make


def build_split_hybrid(source, residency, place, layer_devices: list[str], dtype: torch.dtype,
                       max_tokens: int, threads) -> SplitExperts:
    """One ExpertPool + HybridExperts per device (the hot experts of its layers), one HostExperts
    for all (the cold experts of every layer), and a CPU pool per worker group of the thread
    layout: one for every GPU, or one per NUMA node where the GPUs sit on different nodes."""
    cfg = source.config
    residency = placed_residency(place, residency)
    residency.check(source)
    F, D, E = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
    hot = {l: residency.hot.get(l, []) for l in cfg.moe_layers}
    cold = {l: sorted(set(range(E)) - set(v)) for l, v in hot.items()}
    formats = expert_formats(source, place.experts)
    pools: dict[str, ExpertPools] = {}
    for name in in_order(layer_devices):
        layers = [l for l in cfg.moe_layers if layer_devices[l] == name]
        dev = physical(name)
        apply_memory_cap(dev, place.gpu_memory)  # per device
        if not layers:
            continue
        try:
            mine = {l: hot[l] for l in layers}
            pools[name] = ExpertPools.build(mine, cfg.num_hidden_layers, E, cfg.num_experts_per_tok,
                                            flex_of(residency, E, formats, mine), (2 * F, D), (D, F), dev, dtype,
                                            formats, **expert_math(cfg))
        except torch.OutOfMemoryError:
            raise ConfigError(f"the expert pool of {name} does not fit its GPU memory cap: plan with a smaller "
                              "--gpu-memory or --hot-fraction") from None
    store = stored_experts(source, formats, dtype)
    host = host_copies(store, cold, E, (2 * F, D), (D, F), dtype, formats, **expert_math(cfg))

    def fill(layer: int) -> None:
        pool = pools[layer_devices[layer]]
        experts = expert_loader(source, formats, pool.device, dtype, store)(layer)
        pool.fill_layer(layer, experts)
        if store is None:
            host.fill_layer(layer, experts)

    on_workers(fill, cfg.moe_layers, threads, load_jobs(source, physical(layer_devices[cfg.moe_layers[0]])))
    gpu_of = {n: i for i, n in enumerate(gpus_in_order(layer_devices))}
    group = {name: threads.group_of(gpu_of.get(name, 0)) for name in pools}
    cpus = {}
    for g in dict.fromkeys(group.values()):
        mine = {l: w for l, w in host.layers.items() if group[layer_devices[l]] is g}
        cpus[g] = CpuExperts(mine, backend=place.cpu_backend, cpus=g.cpus)
    np_ = resolve_np(place, residency)
    backends = {}
    for name, pool in pools.items():
        with device_scope(pool.device):
            layers = [l for l in cfg.moe_layers if layer_devices[l] == name]
            backends[name] = configure(HybridExperts(pool, host, cpus[group[name]], np_, max_tokens, layers=layers),
                                       place, residency)
    return SplitExperts(backends, layer_devices)
