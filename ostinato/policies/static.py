"""Baselines whose resident experts never change: cpu, gpu, fixed-per-layer, layers.

Rules, as DESIGN.md ("Baselines, inside the same engine and kernels") defines them:

* `cpu`: every routed expert of every layer is computed on the CPU, in every pass; the
  GPU holds no expert (the lower bound of placement).
* `gpu`: every expert of every layer is resident; every pass runs on the GPU. Only when
  all experts (and the K zero slots) fit the budget (the upper bound); else a ConfigError.
* `fixed-per-layer` (KTransformers' default): n = (budget slots - K) // MoE layers experts
  of every layer are resident, each layer's n most-routed in the development profile
  (prefill and decode routes together); the other experts are computed on the CPU in
  every pass, whatever its size (no upload path, so no staging slots). Slots left over
  by the division stay unused.
* `layers` (llama.cpp's automatic fit, `--n-cpu-moe N`): whole MoE layers are resident
  until the budget is full: all of them if they fit with the K zero slots, else
  n = (budget slots - K - E staging slots) // E of them; like llama.cpp, which keeps the
  experts of the *first* N layers on the CPU (`--n-cpu-moe`) and offloads the last layers
  first (`-ngl`), the resident layers are the last n. A host layer computes all its
  routed experts on the CPU in passes below the offload threshold; a pass of at least the
  threshold copies each expert it uses in that layer once from page-locked host memory
  into the staging slots and computes the layer on the GPU (llama.cpp's op-offload rule,
  which copies only the used experts of a MUL_MAT_ID; default threshold 32). Slots left
  over by the division stay unused (llama.cpp's fit places whole layers).

Legend: E experts per layer, L MoE layers, T tokens of a pass.
"""
from __future__ import annotations

import torch

from ostinato.config import ConfigError
from ostinato.policies.base import ModelExperts, PassPlan, SlotExperts, build_parts, usable_slots


class CpuPolicy(SlotExperts):
    name = "cpu"

    @classmethod
    def build(cls, spec: ModelExperts, slots: int, settings, counts=None) -> "CpuPolicy":
        every = {l: list(range(spec.num_experts)) for l in spec.moe_layers}
        pool, host, cpu = build_parts(spec, {}, every, 0, settings.cpu_backend)
        return cls(spec, pool, host, cpu)

    def __init__(self, spec, pool, host, cpu):
        super().__init__(spec, pool, host, cpu)
        self._plan = self.all_cpu_plan()

    def static_plan(self, layer: int, T: int) -> PassPlan:
        return self._plan


class _FixedResidency(SlotExperts):
    """A placement that never changes: one plan per layer, computed once."""

    def __init__(self, spec, pool, host, cpu):
        super().__init__(spec, pool, host, cpu)
        self._plans = {l: self.resident_plan(l) for l in spec.moe_layers}

    def static_plan(self, layer: int, T: int) -> PassPlan:
        return self._plans[layer]


class GpuPolicy(_FixedResidency):
    name = "gpu"

    @classmethod
    def build(cls, spec: ModelExperts, slots: int, settings, counts=None) -> "GpuPolicy":
        if spec.total_experts + spec.top_k > slots and not settings.allow_over_budget:
            gib = spec.total_experts * spec.expert_bytes / 2**30
            raise ConfigError(f"policy gpu: all {spec.total_experts} experts ({gib:.2f} GiB) do not fit the "
                              f"budget of {slots} expert slots ({slots * spec.expert_bytes / 2**30:.2f} GiB); "
                              "give a larger --gpu-memory or compare against another policy")
        every = {l: list(range(spec.num_experts)) for l in spec.moe_layers}
        pool, host, cpu = build_parts(spec, every, {}, 0, settings.cpu_backend)
        return cls(spec, pool, host, cpu)



def per_layer_top(counts: dict[int, torch.Tensor], layers: list[int], n: int) -> dict[int, list[int]]:
    """Each layer's n most-routed experts (ties: lower id first)."""
    out = {}
    for l in layers:
        order = torch.argsort(-counts[l].to(torch.float64), stable=True)
        out[l] = sorted(order[:n].tolist())
    return out


class FixedPerLayerPolicy(_FixedResidency):
    name = "fixed-per-layer"

    @classmethod
    def build(cls, spec: ModelExperts, slots: int, settings, counts=None) -> "FixedPerLayerPolicy":
        if counts is None:
            raise ConfigError("policy fixed-per-layer ranks each layer's experts by a development profile: "
                              "pass --profile (from `ostinato profile`)")
        n = min(spec.num_experts, usable_slots(spec, slots, 0, cls.name) // max(1, len(spec.moe_layers)))
        resident = per_layer_top(counts.total("all"), spec.moe_layers, n)
        rest = {l: sorted(set(range(spec.num_experts)) - set(v)) for l, v in resident.items()}
        pool, host, cpu = build_parts(spec, resident, rest, 0, settings.cpu_backend)
        return cls(spec, pool, host, cpu)



class LayersPolicy(SlotExperts):
    name = "layers"

    @classmethod
    def build(cls, spec: ModelExperts, slots: int, settings, counts=None) -> "LayersPolicy":
        L, E = len(spec.moe_layers), spec.num_experts
        n = usable_slots(spec, slots, 0, cls.name) // E
        if n < L:  # the host layers need one layer of staging for passes at or above the threshold
            n = usable_slots(spec, slots, E, cls.name) // E
        n = min(n, L)
        gpu_layers = spec.moe_layers[len(spec.moe_layers) - n:]
        every = list(range(spec.num_experts))
        resident = {l: every for l in gpu_layers}
        on_host = {l: every for l in spec.moe_layers if l not in resident}
        staging = spec.num_experts if on_host else 0
        pool, host, cpu = build_parts(spec, resident, on_host, staging, settings.cpu_backend)
        return cls(spec, pool, host, cpu, settings.offload_threshold)

    def __init__(self, spec, pool, host, cpu, offload_threshold: int):
        super().__init__(spec, pool, host, cpu)
        self.offload_threshold = offload_threshold
        self.gpu_layers = [l for l in spec.moe_layers if l not in host.layers]
        self._resident = {l: self.resident_plan(l) for l in self.gpu_layers}
        self._cpu = self.all_cpu_plan()

    def static_plan(self, layer: int, T: int) -> PassPlan | None:
        if layer in self._resident:
            return self._resident[layer]
        return self._cpu if T < self.offload_threshold else None

    def plan(self, layer: int, T: int, ids: torch.Tensor) -> PassPlan:
        return self.staging_plan(ids)  # T >= threshold in a host layer
