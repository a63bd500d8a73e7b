"""The plan that `ostinato plan` and `ostinato bench` both make: a development profile and a
budget -> the size of the expert pool -> a Residency holding the most-routed experts that fit
(planner/fill.py). One place for it, so a bench measures the plan a user would serve.

A pool is sized one of three ways, first match:
* `expert_budget`: bytes for expert-sized slots;
* `hot_fraction`: that share of all experts resident, its pool those experts plus the K zero
  slots and the flex slots the fill needs (checked against `gpu_memory` when one is given);
* `gpu_memory`: the capacity test (planner/capacity.py): every slot the cap leaves after the
  dense weights, the KV cache, the activations and the margin.

Pure functions of the config, the counts and the settings. `formats` (each MoE layer's GGUF
block formats, loader.build.expert_formats) makes every byte count a quantized expert's real
size, one pool per format (planner/capacity.py); without it experts cost the compute dtype's.

Legend: L MoE layers, E experts per layer, K top-k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.config import ConfigError, ModelConfig
from ostinato.engine.residency import Residency, model_fingerprint
from ostinato.engine.sizes import expert_bytes, expert_sizes
from ostinato.planner.capacity import Capacity, CapacitySettings, max_hot_bytes, plan_capacity, pool_groups
from ostinato.planner.fill import cold_routes, fill


@dataclass(frozen=True)
class PoolSize:
    pool_slots: int  # expert-sized slots: hot + K zero + flex (+ what the cap leaves over)
    hot: int  # the experts Ostinato keeps resident in them
    sized_by: str
    expert_bytes: int
    capacity: Capacity | None = None  # the capacity test, when a cap sized or checked the pool

    def to_json(self, total_experts: int) -> dict:
        out = {"expert_bytes": self.expert_bytes, "total_experts": total_experts, "pool_slots": self.pool_slots,
               "hot": self.hot, "sized_by": self.sized_by, "fraction": round(self.hot / total_experts, 4)}
        if self.capacity is not None:
            out["capacity"] = self.capacity.to_json()
        return out


def size_pool(cfg: ModelConfig, counts: dict[int, torch.Tensor], dtype: torch.dtype, *,
              gpu_memory: int | None = None, hot_fraction: float | None = None, expert_budget: int | None = None,
              kv_tokens: int = 0, capacity: CapacitySettings = CapacitySettings(),
              formats: dict | None = None) -> PoolSize:
    """The pool for `counts` (development routes per MoE layer, [E] each) under one of the
    three sizings (module docstring); ConfigError when none is given or the pool cannot hold
    the K zero slots and the flex slots. expert_bytes: one expert (the mean over the layers
    where formats differ), the unit of pool_slots."""
    K, E = cfg.num_experts_per_tok, cfg.num_experts
    total = len(cfg.moe_layers) * E
    sizes = {l: v for l, v in expert_sizes(cfg, dtype, formats).items() if l in counts}
    eb = round(sum(b for _, b in sizes.values()) / len(sizes)) if sizes else expert_bytes(cfg, dtype)
    slots_of = lambda s: sum(g["hot"] + g["zero"] + g["flex"] for g in pool_groups(counts, s, K, E, sizes).values())  # noqa: E731
    if hot_fraction is not None and not 0.0 <= hot_fraction <= 1.0:
        raise ConfigError(f"--hot-fraction must be in [0, 1], got {hot_fraction}")
    cap = None
    if expert_budget is not None:
        pool, how = int(expert_budget // eb), "--expert-budget"
        hot = max_hot_bytes(counts, int(expert_budget), K, E, sizes)
    elif hot_fraction is not None:
        hot = min(total, round(hot_fraction * total))
        if gpu_memory is not None:  # the fraction must fit the cap
            cap = plan_capacity(cfg, counts, gpu_memory, kv_tokens, dtype, capacity, hot, formats=formats)
        pool, how = slots_of(hot), f"hot fraction {hot_fraction}"
    elif gpu_memory is not None:
        cap = plan_capacity(cfg, counts, gpu_memory, kv_tokens, dtype, capacity, formats=formats)
        pool, how, hot = int((cap.budget - cap.fixed) // cap.expert_bytes), "capacity test on --gpu-memory", cap.hot_slots
    else:
        raise ConfigError("give --gpu-memory (size the pool by the capacity test), --hot-fraction or --expert-budget")
    if hot < 0:
        raise ConfigError(f"a budget of {pool} expert slots cannot hold Ostinato's {K} zero slots and its flex "
                          "slots: give a larger budget")
    return PoolSize(pool, hot, how, eb, cap)


def plan_residency(source, counts: dict[int, torch.Tensor], size: PoolSize, *, devices: dict | None = None,
                   gpu_memory: int | None = None, profile: dict | None = None, notes: dict | None = None) -> Residency:
    """The residency of a single-device plan: the `size.hot` most-routed experts (fill), made for
    `gpu_memory` (default: the cap of its capacity test, if any)."""
    cfg = source.config
    if gpu_memory is None and size.capacity is not None:
        gpu_memory = size.capacity.budget
    return Residency(model_fingerprint(source), cfg.num_experts, fill(counts, size.hot), devices=devices or {},
                     gpu_memory=gpu_memory, profile=profile or {},
                     capacity=size.capacity.to_json() if size.capacity else {}, notes=notes or {})


def route_report(prof, hot: dict[int, list[int]], num_layers: int) -> dict:
    """A profile (RouteCounts) under a residency set: the share of its routes on the GPU, of its decode
    routes, and the expected cold routes per decode token and MoE layer (sum of the cold experts' p_e)."""
    cold, total = cold_routes(prof.total("all"), hot)
    cold_d, total_d = cold_routes(prof.decode, hot)
    share, share_d = 1 - cold / max(total, 1), 1 - cold_d / max(total_d, 1)
    per_token = cold_d / max(1, prof.tokens["decode"]) / num_layers
    return {"hot_share": round(share, 4), "decode_hot_share": round(share_d, 4),
            "cold_routes_per_token_layer": round(per_token, 4)}
