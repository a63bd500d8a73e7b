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
* `fixed-per-layer` (KTransformers' placement, per-layer frequency): n = (budget slots - K) //
  MoE layers experts of every layer are resident, each layer's n most routed in the development
  profile; the CPU computes the others in every pass (no upload path, no staging slots).
* `fixed-uniform` (KTransformers' default `uniform`, chosen without a profile): the same n
  expert ids, 0 to n-1, resident in every layer; the CPU computes the others in every pass.
* `layers` (llama.cpp's automatic fit, `--n-cpu-moe N`): whole MoE layers resident until the
  budget is full: all of them if they fit with the K zero slots, else n = (budget slots - K - E
  staging slots) // E of them, the last n (llama.cpp keeps the experts of the *first* N layers
  on the CPU and offloads the last layers first). A host layer computes its routed experts on
  the CPU in passes below the offload threshold; a pass of at least the threshold copies each
  expert it uses in that layer once into the staging slots and computes the layer on the GPU
  (llama.cpp's op-offload rule; its default threshold is 32).
* `ktransformers`: KTransformers at its best. Its `frequency` strategy takes the experts most
  routed over all layers (kt-kernel's generate_gpu_experts_masks), the set of Ostinato's
  cross-layer fill, so it runs Ostinato's residency by its own rules: the CPU computes the cold
  routes in every pass below its prefill threshold (`--kt-gpu-prefill-token-threshold`, the
  offload threshold here); at or above it, each layer uploads all its cold experts, not only
  those the pass uses, and computes the layer on the GPU. It isolates Ostinato's execution
  paths from its placement.

Slots a rule cannot use (the remainder of a division by layers) stay unused.

Legend: E experts per layer, L MoE layers, K top-k.
"""
from __future__ import annotations

import torch

from ostinato.config import ConfigError
from ostinato.layers.moe.hybrid import HybridExperts
from ostinato.policies.base import ModelExperts, usable_slots
from ostinato.policies.ostinato import hybrid_from_parts


def cpu_policy(spec: ModelExperts, slots: int, settings, counts=None) -> HybridExperts:
    return hybrid_from_parts(spec, {}, None, settings.cpu_backend, flex=0)


def gpu_policy(spec: ModelExperts, slots: int, settings, counts=None) -> HybridExperts:
    if spec.total_experts + spec.top_k > slots and not settings.allow_over_budget:
        gib = spec.total_experts * spec.expert_bytes / 2**30
        raise ConfigError(f"policy gpu: all {spec.total_experts} experts ({gib:.2f} GiB) do not fit the "
                          f"budget of {slots} expert slots ({slots * spec.expert_bytes / 2**30:.2f} GiB); "
                          "give a larger --gpu-memory or compare against another policy")
    every = {l: list(range(spec.num_experts)) for l in spec.moe_layers}
    return hybrid_from_parts(spec, every, None, settings.cpu_backend, flex=0)


def per_layer_top(counts: dict[int, torch.Tensor], layers: list[int], n: int) -> dict[int, list[int]]:
    """Each layer's n most-routed experts (ties: lower id first)."""
    out = {}
    for l in layers:
        order = torch.argsort(-counts[l].to(torch.float64), stable=True)
        out[l] = sorted(order[:n].tolist())
    return out


def per_layer_count(spec: ModelExperts, slots: int, name: str) -> int:
    """n of a fixed-per-layer placement: the budget less the K zero slots, split over the layers."""
    return min(spec.num_experts, usable_slots(spec, slots, 0, name) // max(1, len(spec.moe_layers)))


def fixed_per_layer_policy(spec: ModelExperts, slots: int, settings, counts=None) -> HybridExperts:
    if counts is None:
        raise ConfigError("policy fixed-per-layer ranks each layer's experts by a development profile: "
                          "pass --profile (from `ostinato profile`)")
    resident = per_layer_top(counts.total("all"), spec.moe_layers, per_layer_count(spec, slots, "fixed-per-layer"))
    return hybrid_from_parts(spec, resident, None, settings.cpu_backend, flex=0)


def fixed_uniform_policy(spec: ModelExperts, slots: int, settings, counts=None) -> HybridExperts:
    n = per_layer_count(spec, slots, "fixed-uniform")
    return hybrid_from_parts(spec, {l: list(range(n)) for l in spec.moe_layers}, None, settings.cpu_backend, flex=0)


def layers_policy(spec: ModelExperts, slots: int, settings, counts=None) -> HybridExperts:
    L, E = len(spec.moe_layers), spec.num_experts
    n = usable_slots(spec, slots, 0, "layers") // E
    if n < L:  # the host layers need one layer of staging for passes at or above the threshold
        n = usable_slots(spec, slots, E, "layers") // E
    n = min(n, L)
    every = list(range(E))
    resident = {l: every for l in spec.moe_layers[L - n:]}
    return hybrid_from_parts(spec, resident, settings.offload_threshold, settings.cpu_backend,
                             flex=E if n < L else 0)


def ktransformers_policy(spec: ModelExperts, slots: int, settings, counts=None) -> HybridExperts:
    residency = settings.residency  # read by the factory
    if residency is None:
        raise ConfigError("policy ktransformers runs Ostinato's residency by KTransformers' rules: give the "
                          "--residency (from `ostinato plan`)")
    return hybrid_from_parts(spec, residency.hot, settings.offload_threshold, settings.cpu_backend,
                             upload_all=True)


BUILDERS = {"cpu": cpu_policy, "gpu": gpu_policy, "fixed-per-layer": fixed_per_layer_policy,
            "fixed-uniform": fixed_uniform_policy, "layers": layers_policy, "ktransformers": ktransformers_policy}
