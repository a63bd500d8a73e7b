"""How skewed and how stable routing is: the share of held-out routes that the experts
most routed in development sessions receive (the figure a residency set lives on).

Legend: L MoE layers, E experts per layer.
"""
from __future__ import annotations

import torch


def top_experts(dev: dict[int, torch.Tensor], fraction: float) -> dict[int, torch.Tensor]:
    """The most-routed (layer, expert) pairs across all layers: a bool mask [E] per layer."""
    layers = sorted(dev)
    counts = torch.stack([dev[l].double() for l in layers])  # [L, E]
    n = round(fraction * counts.numel())
    chosen = torch.zeros(counts.numel(), dtype=torch.bool)
    # stable order: count descending, then (layer, expert) ascending
    order = torch.argsort(-counts.flatten(), stable=True)
    chosen[order[:n]] = True
    chosen = chosen.view_as(counts)
    return {l: chosen[i] for i, l in enumerate(layers)}


def hot_share(dev: dict[int, torch.Tensor], held: dict[int, torch.Tensor], fraction: float):
    """-> (share of all held-out routes on the chosen experts, {layer: share in that layer})."""
    mask = top_experts(dev, fraction)
    per_layer = {}
    hit = total = 0
    for l, m in mask.items():
        h = held[l].double()
        hit_l, total_l = float(h[m].sum()), float(h.sum())
        per_layer[l] = hit_l / total_l if total_l else 0.0
        hit, total = hit + hit_l, total + total_l
    return (hit / total if total else 0.0), per_layer


def layer_ranges(per_layer: dict[int, float], parts: int = 3) -> list[tuple[int, int, float]]:
    """Mean share over consecutive layer ranges: [(first, last, share)]."""
    layers = sorted(per_layer)
    size = max(1, -(-len(layers) // parts))
    out = []
    for i in range(0, len(layers), size):
        chunk = layers[i:i + size]
        out.append((chunk[0], chunk[-1], sum(per_layer[l] for l in chunk) / len(chunk)))
    return out
