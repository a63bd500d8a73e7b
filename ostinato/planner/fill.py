"""Fill: the pure function from routing counts and a slot budget to a residency set.

Keeping the experts with the most routes minimises the expected number of cold routes
for any budget (each slot removes its expert's share of routes from the CPU; the sum
of the chosen counts is largest when the largest counts are chosen). Ranking is across
all layers of a GPU, so a layer gets as many slots as its routing earns.

Legend: L MoE layers, E experts per layer.
"""
from __future__ import annotations

import torch


def fill(counts: dict[int, torch.Tensor], slots: int) -> dict[int, list[int]]:
    """The `slots` most-routed (layer, expert) pairs; ties broken by (layer, expert) order."""
    layers = sorted(counts)
    if not layers:
        return {}
    E = counts[layers[0]].numel()
    slots = max(0, min(slots, len(layers) * E))
    flat = torch.stack([counts[l].to(torch.float64) for l in layers]).flatten()  # [L * E]
    order = torch.argsort(-flat, stable=True)[:slots]
    hot: dict[int, list[int]] = {l: [] for l in layers}
    for i in order.tolist():
        hot[layers[i // E]].append(i % E)
    return {l: sorted(v) for l, v in hot.items()}


def fill_more(counts: dict[int, torch.Tensor], hot: dict[int, list[int]], extra: int) -> dict[int, list[int]]:
    """`hot` and the `extra` most-routed (layer, expert) pairs outside it: the next ones in the fill
    order (fill(counts, s + extra) when hot is fill(counts, s)), whatever counts `hot` came from."""
    ranked = {}
    for l, c in counts.items():
        c = c.to(torch.float64).clone()
        c[hot.get(l, [])] = float("inf")  # resident first
        ranked[l] = c
    return fill(ranked, sum(len(hot.get(l, [])) for l in counts) + extra)


def fill_with_floor(counts: dict[int, torch.Tensor], slots: int, floor: int) -> dict[int, list[int]]:
    """fill(counts, slots) with every layer keeping at least its `floor` most-routed experts (a
    plan whose flex slots hold a layer's cold experts whole keeps its bytes only if no layer gets
    more cold experts than it had; slots >= floor x layers)."""
    ranked = {}
    for l, c in counts.items():
        c = c.to(torch.float64).clone()
        c[torch.argsort(-c, stable=True)[:floor]] = float("inf")
        ranked[l] = c
    return fill(ranked, slots)


def fill_per_device(counts: dict[int, torch.Tensor], devices: dict[str, list[int]],
                    slots: dict[str, int]) -> dict[int, list[int]]:
    """Each device's slots go to the most-routed experts of its own layers (one pool per GPU)."""
    hot: dict[int, list[int]] = {}
    for device, layers in devices.items():
        hot |= fill({l: counts[l] for l in layers if l in counts}, slots.get(device, 0))
    return hot


def cold_routes(counts: dict[int, torch.Tensor], hot: dict[int, list[int]]) -> tuple[float, float]:
    """(routes to non-resident experts, all routes) of a profile under a residency set."""
    total = cold = 0.0
    for l, c in counts.items():
        c = c.to(torch.float64)
        mask = torch.ones_like(c, dtype=torch.bool)
        mask[hot.get(l, [])] = False
        cold += float(c[mask].sum())
        total += float(c.sum())
    return cold, total
