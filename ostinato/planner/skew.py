"""How skewed and how stable routing is: the share of held-out routes that the experts
most routed in development sessions receive (the figure a residency set lives on), its
spread over layers, how much consecutive tokens share experts, and how it differs by the
class of the token (synth/weights.py's TOKEN_CLASSES).

Counts per (layer, expert) cannot show persistence, so `trace_sessions` runs the sessions
as `profile_sessions` does (the same chunks, the same counts) with a wrapper that also sees
each pass's top-k ids, and keeps per-token statistics (RouteStats) as they go.

Legend: L MoE layers, E experts per layer, T tokens of a pass, K top-k, C token classes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.engine.routes import RouteCounts
from ostinato.planner.run_profile import profile_sessions
from ostinato.synth.weights import TOKEN_CLASSES, token_classes


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


def median(values) -> float:
    v = sorted(values)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2 if v else 0.0


@dataclass
class RouteStats:
    """Per-token routing statistics of a set of sessions, per MoE layer."""

    overlap: dict[int, float]  # sum over consecutive token pairs of |experts(t) & experts(t+1)|
    inclusion: dict[int, torch.Tensor]  # [E] tokens whose top-k holds each expert
    by_class: dict[int, torch.Tensor]  # [C, E] routes of the tokens of each class
    pairs: int = 0  # consecutive token pairs (within a session)
    tokens: int = 0

    @classmethod
    def zeros(cls, layers: list[int], num_experts: int, device="cpu") -> "RouteStats":
        C = len(TOKEN_CLASSES)
        return cls({l: 0.0 for l in layers},
                   {l: torch.zeros(num_experts, dtype=torch.float64, device=device) for l in layers},
                   {l: torch.zeros(C, num_experts, dtype=torch.float64, device=device) for l in layers})

    def persistence(self) -> dict[int, tuple[float, float]]:
        """{layer: (mean experts shared by consecutive tokens, the same for independent draws)}.

        Independent top-k sets with the same marginals share sum_e p_e^2 experts on average
        (p_e: the share of tokens whose set holds e), whatever the shape of the marginals."""
        out = {}
        for l, inc in self.inclusion.items():
            p = inc / max(self.tokens, 1)
            out[l] = (self.overlap[l] / max(self.pairs, 1), float((p * p).sum()))
        return out

    def class_divergence(self) -> dict[int, float]:
        """{layer: total-variation distance between each class's expert distribution and the
        layer's, averaged over the routes}: 0 when routing ignores the token's class."""
        out = {}
        for l, c in self.by_class.items():
            total = c.sum(0)
            n = c.sum(1, keepdim=True)
            have = n.squeeze(1) > 0
            tv = 0.5 * (c[have] / n[have] - total / total.sum()).abs().sum(1)
            out[l] = float((tv * n[have].squeeze(1)).sum() / n.sum()) if have.any() else 0.0
        return out

    def class_shares(self, mask: dict[int, torch.Tensor]) -> dict[str, tuple[float, int]]:
        """{class: (share of its routes on the experts of `mask`, its routes)}."""
        out = {}
        for i, name in enumerate(TOKEN_CLASSES):
            hit = sum(float(self.by_class[l][i][m.to(self.by_class[l].device)].sum()) for l, m in mask.items())
            tot = sum(float(self.by_class[l][i].sum()) for l in mask)
            if tot:
                out[name] = (hit / tot, int(tot))
        return out

    def cpu(self) -> "RouteStats":
        return RouteStats(dict(self.overlap), {l: t.cpu() for l, t in self.inclusion.items()},
                          {l: t.cpu() for l, t in self.by_class.items()}, self.pairs, self.tokens)


class RouteTrace:
    """Wraps an experts backend; keeps the top-k ids of the current pass, per layer."""

    def __init__(self, inner):
        self.inner = inner
        self.ids: dict[int, torch.Tensor] = {}  # layer -> [T, K]

    def __call__(self, layer: int, x: torch.Tensor, topk) -> torch.Tensor:
        self.ids[layer] = topk.ids
        return self.inner(layer, x, topk)

    def many(self, layer: int, xs: list[torch.Tensor], topks: list) -> list[torch.Tensor]:
        """The chunks of one pass: their ids together are the pass's."""
        self.ids[layer] = torch.cat([t.ids for t in topks])
        return self.inner.many(layer, xs, topks)


def _add_pass(stats: RouteStats, ids: dict[int, torch.Tensor], prev: dict[int, torch.Tensor],
              cls: torch.Tensor, num_experts: int) -> dict[int, torch.Tensor]:
    """Fold one pass into `stats`; `prev` holds the session's last token's set [1, E] per layer
    (empty at a session's start). Returns this pass's last sets."""
    last = {}
    known = cls >= 0
    for l, k_ids in ids.items():
        sets = torch.zeros(k_ids.shape[0], num_experts, dtype=torch.float64, device=k_ids.device)
        sets.scatter_(1, k_ids, 1.0)  # [T, E]
        chain = torch.cat([prev[l], sets]) if l in prev else sets
        stats.overlap[l] += float((chain[1:] * chain[:-1]).sum())
        stats.inclusion[l] += sets.sum(0)
        stats.by_class[l].index_add_(0, cls[known], sets[known])
        last[l] = sets[-1:]
    first = next(iter(ids.values()))
    stats.tokens += first.shape[0]
    stats.pairs += first.shape[0] - (0 if prev else 1)
    return last


def trace_sessions(loaded, sessions, progress: bool = True, desc: str = "trace") -> tuple[RouteCounts, RouteStats]:
    """`profile_sessions`' counts and, from the same passes, the per-token RouteStats."""
    runner, cfg = loaded.runner, loaded.runner.config
    classes = token_classes(loaded.tokenizer.tokenizer, cfg.vocab_size).to(runner.device)
    stats = RouteStats.zeros(cfg.moe_layers, cfg.num_experts, device=runner.device)
    trace = None
    prev: dict[int, torch.Tensor] = {}

    def wrap(backend):
        nonlocal trace
        trace = RouteTrace(backend)
        return trace

    def on_pass(ids: list[int], start: int) -> None:
        nonlocal prev
        cls = classes[torch.tensor(ids, device=runner.device)]
        prev = _add_pass(stats, trace.ids, {} if start == 0 else prev, cls, cfg.num_experts)
        trace.ids = {}

    counts = profile_sessions(loaded, sessions, progress, desc, wrap=wrap, on_pass=on_pass)
    return counts, stats.cpu()


def spread_report(per_layer: dict[int, float]) -> dict:
    """A per-layer share's spread: min / median / max and the means by thirds of the depth."""
    v = per_layer.values()
    return {"min_layer": round(min(v), 4), "median_layer": round(median(v), 4), "max_layer": round(max(v), 4),
            "layer_ranges": [[a, b, round(s, 4)] for a, b, s in layer_ranges(per_layer)],
            "per_layer": {str(l): round(s, 4) for l, s in sorted(per_layer.items())}}


def persistence_report(stats: RouteStats, top_k: int) -> dict:
    """Consecutive tokens' shared experts, as fractions of top-k, against independent draws."""
    per = stats.persistence()
    got = {l: o / top_k for l, (o, _) in per.items()}
    indep = {l: e / top_k for l, (_, e) in per.items()}
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    return {"overlap": round(mean(got), 4), "independent": round(mean(indep), 4),
            "excess": round(mean(got) - mean(indep), 4), "overlap_spread": spread_report(got),
            "excess_per_layer": {str(l): round(got[l] - indep[l], 4) for l in sorted(got)}}


def content_report(stats: RouteStats, mask: dict[int, torch.Tensor]) -> dict:
    """Hot share by token class (on the experts of `mask`) and how far each class's routing
    is from the layer's (total variation, route-weighted)."""
    tv = stats.class_divergence()
    return {"class_divergence": round(sum(tv.values()) / len(tv), 4),
            "share_by_class": {c: {"share": round(s, 4), "routes": n} for c, (s, n) in stats.class_shares(mask).items()}}
