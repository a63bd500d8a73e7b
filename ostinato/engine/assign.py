"""Layers -> GPUs of one host: contiguous layer ranges balanced by memory (DESIGN.md: one
expert pool per GPU, shared by the MoE layers placed on it). The planner stores the ranges in
the residency file; the engine assigns them itself when several devices run without one.

The rule. A decoder layer i costs w_i = its dense weights + its KV cache (the planned
tokens) + all E of its experts: what keeping the layer wholly resident would take. The
embedding is an extra on the first device, the final norm and lm_head (its own copy when
the embeddings are tied) an extra on the last. Device d gets the next contiguous range
of layers; the cut after it is the layer boundary whose prefix load (first extra + the
w_i before it) lies nearest to cap_0 + ... + cap_d over the sum of the caps, times the
total load; every device gets at least one layer. So each device's load is
proportional to its cap, each can keep about the same share of its layers' experts
resident, and ranges keep the activations' hops between devices at n - 1 per pass.
Then each device runs its own capacity test (planner/capacity.py `device_capacity`: its
dense weights, its layers' KV cache, the activations of the largest pass, the margin) and its
slots go to the most-routed experts of its own layers (planner/fill.py `fill_per_device`).

Everything here is a pure function of the config and the settings; the bytes are those of
engine/sizes.py.

Legend: L decoder layers, E experts per layer, K top-k.
"""
from __future__ import annotations

import torch

from ostinato.config import ModelConfig
from ostinato.engine.sizes import dense_parts, expert_sizes, kv_bytes
from ostinato.loader.build import WeightFormats


def assign_layers(costs: list[int], caps: list[int], first_extra: int = 0, last_extra: int = 0) -> list[list[int]]:
    """Contiguous ranges of layer indices, one per cap, each load proportional to its cap."""
    n, L = len(caps), len(costs)
    if n < 1 or L < n:
        raise ValueError(f"cannot spread {L} layers over {n} devices (each needs at least one layer)")
    prefix = [first_extra]
    for w in costs:
        prefix.append(prefix[-1] + w)
    total = prefix[-1] + last_extra
    cuts, share = [0], 0.0
    for d in range(n - 1):
        share += caps[d] / sum(caps)
        target = share * total
        lo, hi = cuts[-1] + 1, L - (n - 1 - d)
        cuts.append(min(range(lo, hi + 1), key=lambda c: abs(prefix[c] - target)))
    cuts.append(L)
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]


def assign_devices(cfg: ModelConfig, devices: list[str], kv_tokens: int, dtype: torch.dtype,
                   caps: list[int] | None = None, formats: WeightFormats = WeightFormats()) -> dict[str, list[int]]:
    """device -> its decoder layers, by the rule above (equal caps when none are given); formats:
    the block formats the GPUs keep (their real bytes), as plan_capacity takes them."""
    layers, embed, head = dense_parts(cfg, dtype, formats.dense)
    kv_layer = kv_bytes(cfg, max(kv_tokens, 0), dtype, layers=1)
    sizes = expert_sizes(cfg, dtype, formats.experts)
    costs = [w + kv_layer + (cfg.num_experts * sizes[i][1] if i in sizes else 0) for i, w in enumerate(layers)]
    ranges = assign_layers(costs, caps or [1] * len(devices), embed, head)
    return dict(zip(devices, ranges))


def layer_map(devices: dict[str, list[int]], num_layers: int) -> list[str]:
    """{device: [layers]} -> each decoder layer's device (a layer not listed goes with the one
    before it, leading ones with the first device)."""
    owner = {l: d for d, layers in devices.items() for l in layers}
    out, current = [], next(iter(devices))
    for i in range(num_layers):
        current = owner.get(i, current)
        out.append(current)
    return out

