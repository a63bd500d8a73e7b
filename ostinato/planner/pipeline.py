"""The plan that `ostinato plan` and `ostinato bench` both make: a development profile and a
budget -> the size of the expert pool -> a Residency holding the most-routed experts that fit
(planner/fill.py). One place for it, so a bench measures the plan a user would serve.

A pool is sized one of three ways, first match:
* `expert_budget`: bytes for expert-sized slots;
* `hot_fraction`: that share of all experts resident, its pool those experts plus the K zero
  slots and the flex slots the fill needs (checked against `gpu_memory` when one is given);
* `gpu_memory`: the capacity test (planner/capacity.py): every slot the cap leaves after the
  dense weights, the KV cache, the activations and the margin.

Once the engine has calibrated the plan, `plan_upload_path` fills it again by the time each expert
saves rather than by its routes (`refill_by_time`: a decode route costs the CPU 31x a prefill
route), then decides whether its upload path (the upload path proper and the split with uploads)
earns the flex slots it needs; where it does not, the plan spends their bytes on hot experts and
has neither (every place that calibrates a plan calls it: bench, `ostinato calibrate`, serve's own
planning, and `plan --from-served`, which carries a calibration over).

The flex slots of each format group are bounded (capacity.flex_bound: `max_flex`, else a share
of the pool's bytes: the expert budget, or what the cap leaves); a hot fraction without a cap has
no pool's bytes to take a share of, and is bounded only by an explicit `max_flex`. The bound
goes into the plan (Residency.max_flex), so that the engine allocates what the test counted.

Pure functions of the config, the counts and the settings. `formats` (the GGUF block formats the
GPU keeps: each MoE layer's experts' and the dense linear weights', loader.build.weight_formats)
makes every byte count a quantized weight's real size, one pool per expert format
(planner/capacity.py); without it everything costs the compute dtype's.

Legend: L MoE layers, E experts per layer, K top-k.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ostinato.config import ConfigError, ModelConfig
from ostinato.engine.residency import Residency, measured, model_fingerprint
from ostinato.engine.sizes import expert_bytes, expert_sizes
from ostinato.layers.moe.hybrid import MixedPass, window_text
from ostinato.loader.build import WeightFormats
from ostinato.planner import cost_model as cm
from ostinato.planner.capacity import (Capacity, CapacitySettings, flex_bound, grow_without_flex, hot_groups,
                                       max_hot_bytes, plan_capacity, pool_groups)
from ostinato.planner.fill import cold_routes, fill, fill_with_floor


@dataclass(frozen=True)
class PoolSize:
    pool_slots: int  # expert-sized slots: hot + K zero + flex (+ what the cap leaves over)
    hot: int  # the experts Ostinato keeps resident in them
    sized_by: str
    expert_bytes: int
    capacity: Capacity | None = None  # the capacity test, when a cap sized or checked the pool
    max_flex: int | None = None  # the bound on each format group's flex slots (None: unbounded)

    def to_json(self, total_experts: int) -> dict:
        out = {"expert_bytes": self.expert_bytes, "total_experts": total_experts, "pool_slots": self.pool_slots,
               "hot": self.hot, "sized_by": self.sized_by, "fraction": round(self.hot / total_experts, 4),
               "max_flex": self.max_flex}
        if self.capacity is not None:
            out["capacity"] = self.capacity.to_json()
        return out


def size_pool(cfg: ModelConfig, counts: dict[int, torch.Tensor], dtype: torch.dtype, *,
              gpu_memory: int | None = None, hot_fraction: float | None = None, expert_budget: int | None = None,
              kv_tokens: int = 0, capacity: CapacitySettings = CapacitySettings(),
              formats: WeightFormats = WeightFormats()) -> PoolSize:
    """The pool for `counts` (development routes per MoE layer, [E] each) under one of the
    three sizings (module docstring); ConfigError when none is given or the pool cannot hold
    the K zero slots and the flex slots. expert_bytes: one expert (the mean over the layers
    where formats differ), the unit of pool_slots."""
    K, E = cfg.num_experts_per_tok, cfg.num_experts
    total = len(cfg.moe_layers) * E
    sizes = {l: v for l, v in expert_sizes(cfg, dtype, formats.experts).items() if l in counts}
    eb = round(sum(b for _, b in sizes.values()) / len(sizes)) if sizes else expert_bytes(cfg, dtype)
    slots_of = lambda s, m: sum(g["hot"] + g["zero"] + g["flex"]  # noqa: E731
                                for g in pool_groups(counts, s, K, E, sizes, m).values())
    if hot_fraction is not None and not 0.0 <= hot_fraction <= 1.0:
        raise ConfigError(f"--hot-fraction must be in [0, 1], got {hot_fraction}")
    cap = None
    if expert_budget is not None:
        bound = flex_bound(capacity, int(expert_budget), sizes)
        pool, how = int(expert_budget // eb), "--expert-budget"
        hot = max_hot_bytes(counts, int(expert_budget), K, E, sizes, bound)
    elif hot_fraction is not None:
        hot = min(total, round(hot_fraction * total))
        bound = flex_bound(capacity, None, sizes)
        if gpu_memory is not None:  # the fraction must fit the cap
            cap = plan_capacity(cfg, counts, gpu_memory, kv_tokens, dtype, capacity, hot, formats=formats)
            bound = cap.max_flex
        pool, how = slots_of(hot, bound), f"hot fraction {hot_fraction}"
    elif gpu_memory is not None:
        cap = plan_capacity(cfg, counts, gpu_memory, kv_tokens, dtype, capacity, formats=formats)
        pool, hot = int((cap.budget - cap.fixed) // cap.expert_bytes), cap.hot_slots
        how = "capacity test on --gpu-memory"
        bound = cap.max_flex
    else:
        raise ConfigError("give --gpu-memory (size the pool by the capacity test), --hot-fraction or --expert-budget")
    if hot < 0:
        raise ConfigError(f"a budget of {pool} expert slots cannot hold Ostinato's {K} zero slots and its flex "
                          "slots: give a larger budget")
    return PoolSize(pool, hot, how, eb, cap, bound)


def plan_residency(source, counts: dict[int, torch.Tensor], size: PoolSize, *, devices: dict | None = None,
                   gpu_memory: int | None = None, profile: dict | None = None, notes: dict | None = None) -> Residency:
    """The residency of a single-device plan: the `size.hot` most-routed experts (fill), made for
    `gpu_memory` (default: the cap of its capacity test, if any)."""
    cfg = source.config
    if gpu_memory is None and size.capacity is not None:
        gpu_memory = size.capacity.budget
    return Residency(model_fingerprint(source), cfg.num_experts, fill(counts, size.hot), devices=devices or {},
                     gpu_memory=gpu_memory, profile=profile or {},
                     capacity=size.capacity.to_json() if size.capacity else {}, notes=notes or {},
                     max_flex=size.max_flex)


def route_report(prof, hot: dict[int, list[int]], num_layers: int) -> dict:
    """A profile (RouteCounts) under a residency set: the share of its routes on the GPU, of its decode
    routes, and the expected cold routes per decode token and MoE layer (sum of the cold experts' p_e)."""
    cold, total = cold_routes(prof.total("all"), hot)
    cold_d, total_d = cold_routes(prof.decode, hot)
    share, share_d = 1 - cold / max(total, 1), 1 - cold_d / max(total_d, 1)
    per_token = cold_d / max(1, prof.tokens["decode"]) / num_layers
    return {"hot_share": round(share, 4), "decode_hot_share": round(share_d, 4),
            "cold_routes_per_token_layer": round(per_token, 4)}


def refill_by_time(res: Residency, values: dict[int, torch.Tensor], sizes: dict[int, tuple[str, int]],
                   prof, cal: dict, top_k: int) -> Residency:
    """The plan with each format group's hot experts chosen again by `values` (cost_model.expert_values:
    the ms each expert saves over the development sessions), as many in each group as before, and
    where the group's flex slots are its most cold experts of a layer (below the plan's bound), no
    layer with more cold experts than that: so its pools keep their bytes. calibration["fill"]
    records the experts moved ("in", "out": what Residency.frequency_plan undoes) and the decode
    step the model predicts for the development sessions under both fills."""
    E = res.num_experts
    before = hot_groups(res.hot, top_k, E, sizes, max_flex=res.max_flex)
    hot: dict[int, list[int]] = {}
    for name, g in before.items():
        layers = [l for l in values if sizes[l][0] == name]
        floor = E - g["flex"] if res.max_flex is None or g["flex"] < res.max_flex else 0
        hot |= fill_with_floor({l: values[l] for l in layers}, sum(len(res.hot.get(l, [])) for l in layers), floor)
    moved_in = {str(l): sorted(set(hot[l]) - set(res.hot.get(l, []))) for l in sorted(hot)}
    moved_out = {str(l): sorted(set(res.hot.get(l, [])) - set(hot[l])) for l in sorted(hot)}
    note = {"by": "time saved", "moved": sum(map(len, moved_in.values())),
            "in": {l: v for l, v in moved_in.items() if v}, "out": {l: v for l, v in moved_out.items() if v}}
    layers = sorted(prof.decode)
    costs, laws = cm.layer_costs(cal, layers), cm.route_laws(prof.decode, prof.tokens["decode"], top_k)
    for name, h in (("routes", res.hot), ("time", hot)):
        step = cm.predict_decode_step(prof.decode, prof.tokens["decode"], h, costs, top_k, laws=laws)
        note.setdefault("decode_moe_ms", {})[name] = round(step.moe_ms, 4)
        note.setdefault("cold_routes_per_token_layer", {})[name] = round(step.cold_routes_per_layer, 4)
    return dataclasses.replace(res, hot={**res.hot, **hot}, calibration={**res.calibration, "fill": note})


def fill_text(f: dict | None) -> str:
    """calibration["fill"] as a report says it."""
    if not f:
        return "by routes"
    d, r = f["decode_moe_ms"], f["cold_routes_per_token_layer"]
    return (f"by time saved: {f['moved']} experts moved from the fill by routes; over the development sessions the "
            f"model predicts {r['time']:.3f} cold routes per token-layer (by routes {r['routes']:.3f}) and "
            f"{d['time']:.3f} ms of MoE layers per decode step (by routes {d['routes']:.3f})")


def plan_upload_path(residency: Residency, cal: dict, prof, counts: dict[int, torch.Tensor],
                     sizes: dict[int, tuple[str, int]], top_k: int, prefill_chunk: int, *, limit: int | None = None,
                     borrow: bool = False) -> Residency:
    """The plan filled again by time saved (refill_by_time, where the calibration and the profile
    allow: cost_model.expert_values; a plan of several GPUs keeps its fill),
    then whether it keeps its upload path, once the calibration has measured Np and the
    paths: the flex slots it needs could hold hot experts instead (the next ones in the fill order),
    and on a workload whose long passes are few the cold routes those experts would take off the
    CPU save more than the flex slots do. Decided on the development sessions (`prof`, a RouteCounts
    with their prompt sizes; `counts`: the routes the plan was filled from) by
    cost_model.upload_path_value: the gain of the two paths that use the flex slots, each on the
    passes it takes (the upload path from Np; the split with uploads over the sizes the
    calibration measured it to pay at, MixedPass.from_calibration), against the cost of the hot
    experts the slots displace:

    * kept where gain > cost, and where borrowed memory (`borrow`) lends the slots to cold experts;
      also where it cannot be weighed (a plan of several GPUs, a profile without prompt sizes, a
      calibration without the decode constants);
    * dropped otherwise: the plan then keeps the most hot experts whose pools fit `limit` bytes
      (default: the pools the plan was allowed, by its capacity test, else its own pools) with K
      zero slots and no flex slot (grow_without_flex), and neither path (engine/placement.py).

    Pure: -> the residency with calibration["upload_path"] recording the decision and its numbers
    ("on", "why", the gain of each path and the cost in ms over the development sessions; when
    dropped, the experts added and the capacity of the plan with the upload path, so
    Residency.upload_plan restores it). `residency` may hold earlier decisions: they are made
    again from its plan by routes with the upload path (Residency.frequency_plan). `prof` may be
    a learned profile (planner/served.py learned_profile), with the passes it counted
    (cost_model.profile_passes)."""
    res = residency.frequency_plan()
    cal = measured(cal)
    limit = pool_limit(res, top_k, sizes) if limit is None else limit  # the pools the plan by routes was allowed
    passes = cm.profile_passes(prof, prefill_chunk) if prof is not None else None
    values = None
    if len(res.devices) <= 1 and passes is not None:
        values = cm.expert_values(cal, prof, passes, top_k)
    if values is not None:
        res = refill_by_time(dataclasses.replace(res, calibration=cal), values, sizes, prof, cal, top_k)
        # the experts a plan without the upload path adds are valued as it runs its passes: all split
        cal, counts = res.calibration, cm.expert_values({**cal, "upload_threshold": None}, prof, passes, top_k)

    def decided(on: bool, why: str, plan: dict | None = None, **kw) -> Residency:
        """res with the decision recorded; plan: the fields of the plan without the upload path."""
        up = {"on": on, "why": why, **kw}
        return dataclasses.replace(res, **(plan or {}), calibration={**cal, "upload_path": up})

    if borrow:
        return decided(True, "borrowed memory lends the flex slots to cold experts")
    if len(res.devices) > 1:
        return decided(True, "not weighed: a plan of several GPUs")
    if passes is None:
        return decided(True, "not weighed: the development profile has no prompt sizes (profile again)")
    if not cal.get("global"):
        return decided(True, "not weighed: the calibration has no decode constants")
    E = res.num_experts
    bigger = grow_without_flex(counts, res.hot, limit, top_k, E, sizes)
    v = cm.upload_path_value(cal, prof, passes, res.hot, bigger, top_k, MixedPass.from_calibration(cal))
    before = hot_groups(res.hot, top_k, E, sizes, max_flex=res.max_flex)
    ms = {k: round(v[k], 3) + 0.0 for k in ("gain_ms", "gain_upload_ms", "gain_mixed_ms", "cost_ms",
                                             "cost_decode_ms", "cost_prefill_ms")}  # + 0.0: no -0.0
    numbers = {**ms, **{k: v[k] for k in ("np", "mixed_from", "mixed_to", "passes", "passes_at_np", "passes_mixed",
                                          "largest_pass", "decode_tokens")},
               "flex_slots": sum(g["flex"] for g in before.values()), "hot_with_flex": res.hot_count,
               "hot_without_flex": sum(map(len, bigger.values())),
               "cold_routes_per_token_layer": [round(x, 4) for x in v["cold_routes_per_token_layer"]]}
    if v["gain_ms"] > v["cost_ms"]:
        return decided(True, "it pays", **numbers)
    added = {str(l): sorted(set(bigger[l]) - set(res.hot.get(l, []))) for l in sorted(bigger)}
    capacity = res.capacity
    if capacity.get("groups") is not None:  # the capacity test's breakdown, as this plan spends the pool
        after = hot_groups(bigger, top_k, E, sizes, max_flex=0)
        pool, n = sum(g["bytes"] for g in after.values()), numbers["hot_without_flex"]
        capacity = {**capacity, "hot_slots": n, "max_hot_slots": n, "flex_slots": 0, "groups": after,
                    "pool_bytes": pool, "unused": capacity.get("unused", 0) + capacity.get("pool_bytes", pool) - pool}
    return decided(False, "the upload path did not pay", {"hot": bigger, "capacity": capacity}, **numbers,
                   added={l: ids for l, ids in added.items() if ids},
                   capacity={k: res.capacity[k] for k in CAPACITY_KEYS if k in res.capacity})


CAPACITY_KEYS = ("hot_slots", "max_hot_slots", "flex_slots", "groups", "pool_bytes", "unused")  # what a drop changes


def pool_limit(res: Residency, top_k: int, sizes: dict[int, tuple[str, int]]) -> int:
    """The bytes a plan's pools may take: what its capacity test left for them when the test sized
    it (the cap's: pool and unused bytes), else its own pools (a hot fraction's, with flex slots)."""
    cap = res.capacity
    if cap.get("pool_bytes") is not None and cap.get("hot_slots") == cap.get("max_hot_slots"):
        return int(cap["pool_bytes"] + cap.get("unused", 0))
    groups = hot_groups(res.hot, top_k, res.num_experts, sizes, max_flex=res.max_flex)
    return sum(g["bytes"] for g in groups.values())


def upload_path_text(up: dict | None) -> str:
    """The decision (calibration["upload_path"]) as a report says it: the gain of each path that
    uses the flex slots and the cost of the hot experts they displace."""
    if not up:
        return "not decided"
    if "gain_ms" not in up:
        return f"kept ({up['why']})"
    mixed = "split with uploads never measured a gain"
    if up["mixed_from"] is not None:
        sizes = window_text(up["mixed_from"], up.get("mixed_to"))
        mixed = (f"split with uploads {up['gain_mixed_ms']:.1f} ms on {up['passes_mixed']} passes "
                 f"{'of ' if up.get('mixed_to') is not None else ''}{sizes} tokens")
    nums = (f"gain {up['gain_ms']:.1f} ms (upload path {up['gain_upload_ms']:.1f} ms on {up['passes_at_np']} passes "
            f"at or above Np {up['np']}, {mixed}; {up['passes']} passes in all), cost {up['cost_ms']:.1f} ms over the "
            f"development sessions: {up['flex_slots']} flex slots against "
            f"{up['hot_without_flex'] - up['hot_with_flex']} more hot experts")
    if up["on"]:
        return f"kept: it pays ({nums})"
    return f"none: {up['why']} ({nums})"
