"""Baselines whose resident experts never change: placements over the one executor.

Each is a residency (which experts sit in the pool) and a rule for passes by size, run by
HybridExperts exactly as Ostinato is (layers/moe/hybrid.py): the resident experts on the GPU
in every pass, a decode step captured as one CUDA graph per GPU with the CPU branch behind the
mapped-memory handshake (layers/moe/graph_hybrid.py), the split path below the policy's upload
threshold and the upload path at or above it. None borrows memory or uploads part of a split
pass: those are Ostinato's. Rules, as DESIGN.md ("Baselines, inside the same engine and
kernels") defines them:

* `cpu`: nothing resident; every routed expert is computed on the CPU in every pass.
* `gpu`: every expert resident, when all of them (and the K zero slots) fit the budget (the
  upper bound); else a ConfigError.
* `fixed-per-layer` (KTransformers' placement, per-layer frequency): the largest n whose pools
  (n experts of every layer, K zero slots per format group) fit the budget's bytes, n = (budget
  slots - K) // MoE layers for a float model; each layer's n most routed in the development
  profile are resident; the CPU computes the others in every pass (no upload path, no staging
  slots).
* `fixed-uniform` (KTransformers' default `uniform`, chosen without a profile): the same n
  expert ids, 0 to n-1, resident in every layer; the CPU computes the others in every pass.
* `layers` (llama.cpp's automatic fit, `--n-cpu-moe N`): whole MoE layers resident until the
  budget's bytes are used: all of them if they fit with the K zero slots, else the most that fit
  with E staging slots in every format group that keeps a host layer (for a float model n =
  (budget slots - K - E) // E), the last n (llama.cpp keeps the experts of the *first* N layers
  on the CPU and offloads the last layers first). A host layer computes its routed experts on
  the CPU in passes below the offload threshold; a pass of at least the threshold copies each
  expert it uses in that layer once into the staging slots and computes the layer on the GPU
  (llama.cpp's op-offload rule; its default threshold is 32). Where not even E staging slots fit
  (DeepSeek-V3's bf16 layers under 24 GiB), no layer is resident and the staging is
  engine/experts.py baseline_staging's, which such a pass fills in waves.
* `ktransformers`: KTransformers at its best. Its `frequency` strategy takes the experts most
  routed over all layers (kt-kernel's generate_gpu_experts_masks), the set of Ostinato's
  cross-layer fill by routes (Residency.frequency_plan: Ostinato fills again by time saved once
  calibrated), and runs it by its own rules: the CPU computes the cold
  routes in every pass below its prefill threshold (`--kt-gpu-prefill-token-threshold`, the
  offload threshold here); at or above it, each layer uploads all its cold experts, not only
  those the pass uses, and computes the layer on the GPU. It isolates Ostinato's execution
  paths and its fill by time from the cross-layer fill. Its staging holds a layer's cold experts whole, at most
  the plan's bound on flex slots (Residency.max_flex, planner/capacity.py), and a layer with more cold experts
  uploads them in waves (DeepSeek-V3's 256-expert layers under 24 GiB); its fill may leave some layer more cold
  experts than Ostinato's does, and its pool is then the larger of the two.

The budget is bytes (engine/experts.py): each format group's slots cost its expert bytes, so on
a Q4_K_M file a Q6_K-down layer costs more than a Q4_K one. Bytes a rule cannot use (the
remainder of a division by layers) stay unused.

Legend: E experts per layer, L MoE layers, K top-k.
"""
from __future__ import annotations

import torch

from ostinato.config import ConfigError
from ostinato.engine.experts import ModelExperts, baseline_staging, check_fits, hybrid_from_parts, pools_bytes
from ostinato.layers.moe.hybrid import HybridExperts
from ostinato.layers.moe.pool import bounded_flex


def cpu_policy(spec: ModelExperts, budget: int, settings, counts=None) -> HybridExperts:
    return hybrid_from_parts(spec, {}, None, settings.cpu_backend, flex=0)


def gpu_policy(spec: ModelExperts, budget: int, settings, counts=None) -> HybridExperts:
    """budget: bytes for the expert pools (as every builder here)."""
    every = {l: list(range(spec.num_experts)) for l in spec.moe_layers}
    need = pools_bytes(spec, every, 0)
    if need > budget and not settings.allow_over_budget:
        raise ConfigError(f"policy gpu: all {spec.total_experts} experts ({need / 2**30:.2f} GiB with the zero "
                          f"slots) do not fit the budget of {budget / 2**30:.2f} GiB; give a larger --gpu-memory "
                          "or compare against another policy")
    return hybrid_from_parts(spec, every, None, settings.cpu_backend, flex=0)


def per_layer_top(counts: dict[int, torch.Tensor], layers: list[int], n: int) -> dict[int, list[int]]:
    """Each layer's n most-routed experts (ties: lower id first)."""
    out = {}
    for l in layers:
        order = torch.argsort(-counts[l].to(torch.float64), stable=True)
        out[l] = sorted(order[:n].tolist())
    return out


def per_layer_count(spec: ModelExperts, budget: int, name: str) -> int:
    """n of a fixed-per-layer placement: the largest n with n experts of every layer and each group's
    K zero slots within `budget` bytes (pools_bytes is linear in n: one division)."""
    zero = pools_bytes(spec, {}, 0)  # the K zero slots of every group
    check_fits(spec, zero, budget, name, "the zero slots alone")
    per_n = sum(spec.expert_size(l) for l in spec.moe_layers)  # one more expert in every layer
    return min(spec.num_experts, (budget - zero) // max(1, per_n))


def fixed_per_layer_policy(spec: ModelExperts, budget: int, settings, counts=None) -> HybridExperts:
    if counts is None:
        raise ConfigError("policy fixed-per-layer ranks each layer's experts by a development profile: "
                          "pass --profile (from `ostinato profile`)")
    resident = per_layer_top(counts.total("all"), spec.moe_layers, per_layer_count(spec, budget, "fixed-per-layer"))
    return hybrid_from_parts(spec, resident, None, settings.cpu_backend, flex=0)


def fixed_uniform_policy(spec: ModelExperts, budget: int, settings, counts=None) -> HybridExperts:
    n = per_layer_count(spec, budget, "fixed-uniform")
    return hybrid_from_parts(spec, {l: list(range(n)) for l in spec.moe_layers}, None, settings.cpu_backend, flex=0)


def layers_resident(spec: ModelExperts, budget: int) -> tuple[dict[int, list[int]], int | None]:
    """(resident, flex): the last n MoE layers whole, n the most whose pools fit `budget` bytes: each
    group's K zero slots, and one layer of staging (E slots) in a group that keeps a host layer, for
    passes at or above the threshold (flex None: the group's most cold experts of a layer, E or 0);
    where not even n = 0 fits, no layer and baseline_staging's slots."""
    L, every = len(spec.moe_layers), list(range(spec.num_experts))
    for n in range(L, -1, -1):
        resident = {l: every for l in spec.moe_layers[L - n:]}
        if pools_bytes(spec, resident, None) <= budget:
            return resident, None
    flex = baseline_staging(spec, budget)
    check_fits(spec, pools_bytes(spec, {}, flex), budget, "layers", "its zero slots")
    return {}, flex


def layers_policy(spec: ModelExperts, budget: int, settings, counts=None) -> HybridExperts:
    resident, flex = layers_resident(spec, budget)
    return hybrid_from_parts(spec, resident, settings.offload_threshold, settings.cpu_backend, flex=flex)


def ktransformers_policy(spec: ModelExperts, budget: int, settings, counts=None) -> HybridExperts:
    residency = settings.residency  # read by the factory
    if residency is None:
        raise ConfigError("policy ktransformers runs Ostinato's residency by KTransformers' rules: give the "
                          "--residency (from `ostinato plan`)")
    return hybrid_from_parts(spec, residency.hot, settings.offload_threshold, settings.cpu_backend,
                             flex=ktransformers_flex(spec, residency), upload_all=True)


def ktransformers_flex(spec: ModelExperts, residency) -> dict:
    """ktransformers' staging slots per format group: its fill's most cold experts of a layer, at most the
    plan's bound (pool.bounded_flex; None: unbounded)."""
    return bounded_flex(residency.hot, spec.num_experts, spec.formats, residency.max_flex)


BUILDERS = {"cpu": cpu_policy, "gpu": gpu_policy, "fixed-per-layer": fixed_per_layer_policy,
            "fixed-uniform": fixed_uniform_policy, "layers": layers_policy, "ktransformers": ktransformers_policy}
