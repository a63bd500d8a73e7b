"""Routes counted per (phase, layer, expert): `RouteCounts`, the record every profile and served
tally keeps (`ostinato profile` writes one, planner/profile.py; a server keeps its own beside its
plan, planner/served.py), and `RouteTally`, the engine's counter of the routes it runs.

`RouteTally` counts every routed (layer, expert) of the passes the engine runs, on the device, by
phase (a one-token pass is decode). The runner puts it around the experts backend the model calls
(engine/runner.py), so captured decode graphs count too: one index_add of K ids per MoE layer and
step, no host sync.

Legend: E experts per layer, K top-k.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ostinato.config import ConfigError
from ostinato.layers.moe.types import TopKOutput


@dataclass
class RouteCounts:
    """counts[phase][layer] = routes per expert, phase in {'prefill', 'decode'}."""

    prefill: dict[int, torch.Tensor]
    decode: dict[int, torch.Tensor]
    tokens: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    sessions: int = 0
    max_tokens: int = 0  # the longest session stream (= longest request: prompt + output), in tokens
    # the new prompt tokens of every turn, in order: the sizes of the prefill passes a replay of these
    # sessions makes before the runner's chunking (the planner weighs passes by them: planner/pipeline.py
    # plan_upload_path); None where not recorded (a served tally, an older profile)
    prompts: list[int] | None = None
    # the prefill passes run, by size (after the runner's chunking), where they were counted rather than
    # made from prompts: a served tally's, decayed with its routes (planner/served.py); None elsewhere
    passes: dict[int, float] | None = None

    @classmethod
    def zeros(cls, layers: list[int], num_experts: int, device="cpu") -> "RouteCounts":
        z = lambda: {l: torch.zeros(num_experts, dtype=torch.int64, device=device) for l in layers}  # noqa: E731
        return cls(z(), z())

    def total(self, phase: str = "all") -> dict[int, torch.Tensor]:
        if phase == "all":
            return {l: self.prefill[l] + self.decode[l] for l in self.prefill}
        return getattr(self, phase)

    def to_json(self) -> dict:
        out = {"version": 1, "sessions": self.sessions, "tokens": self.tokens, "max_tokens": self.max_tokens,
               "prefill": {str(l): c.tolist() for l, c in self.prefill.items()},
               "decode": {str(l): c.tolist() for l, c in self.decode.items()}}
        if self.prompts is not None:
            out["prompts"] = list(self.prompts)
        if self.passes is not None:
            out["passes"] = {str(n): k for n, k in sorted(self.passes.items())}
        return out

    @classmethod
    def from_json(cls, d: dict) -> "RouteCounts":
        t = lambda m: {int(l): torch.tensor(c, dtype=torch.int64) for l, c in m.items()}  # noqa: E731
        passes = {int(n): k for n, k in d["passes"].items()} if d.get("passes") is not None else None
        return cls(t(d["prefill"]), t(d["decode"]), dict(d["tokens"]), d.get("sessions", 0), d.get("max_tokens", 0),
                   d.get("prompts"), passes)

    def layer_top_shares(self, fraction: float, phase: str = "all") -> dict[int, float]:
        """Per layer: the share of its routes on its own top `fraction` of experts (skew figure)."""
        out = {}
        for l, c in self.total(phase).items():
            c = torch.sort(c.double(), descending=True).values
            n = max(1, round(fraction * c.numel()))
            out[l] = float(c[:n].sum() / c.sum()) if c.sum() > 0 else 0.0
        return out

    def digest(self) -> str:
        """What identifies these counts wherever they were read from: the same before a save and after a load."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()) + "\n")

    @classmethod
    def load(cls, path: Path, config=None) -> "RouteCounts":
        """config: the model's (ModelConfig); counts of another model's MoE layers or experts are refused."""
        counts = cls.from_json(json.loads(Path(path).read_text()))
        if config is not None:
            counts.check_model(config, str(path))
        return counts

    def check_model(self, config, where: str) -> None:
        """ConfigError unless these are counts of the model's MoE layers and experts (a bench given another
        model's saved profiles would plan on them)."""
        sizes = {int(c.numel()) for c in (*self.prefill.values(), *self.decode.values())}
        if sorted(self.prefill) != sorted(config.moe_layers) or sizes != {config.num_experts}:
            raise ConfigError(f"{where}: route counts of {len(self.prefill)} MoE layers of {sorted(sizes)} experts, "
                              f"not this model's {len(config.moe_layers)} of {config.num_experts}: profile this model "
                              "(leave the profiles out) or give its own")


class RouteTally:
    """Routes per (phase, layer, expert) of the passes run, counted on each layer's device."""

    PHASES = ("prefill", "decode")

    def __init__(self, layers: list[int], num_experts: int, top_k: int):
        self.layers, self.num_experts, self.top_k = list(layers), num_experts, top_k
        self.counts: dict[int, torch.Tensor] = {}  # layer -> [2, E] int64, allocated at its first pass
        self.passes: dict[int, int] = {}  # prefill passes by size, counted on the host at the first MoE layer
        self._one: dict[torch.device, torch.Tensor] = {}  # a 1 per device, expanded to each pass's ids
        self.rows = None  # a captured prefill pass's real rows (StepRows) while it is captured: only they count
        self._valid: tuple = (None, None)  # (those rows, a 1 per real route): made at the pass's first layer

    def wrap(self, backend):
        return _Counting(backend, self)

    def add(self, layer: int, topk: TopKOutput) -> None:
        c = self.counts.get(layer)
        if c is None:
            c = self.counts[layer] = torch.zeros(2, self.num_experts, dtype=torch.int64, device=topk.ids.device)
        T, K = topk.ids.shape
        ids = topk.ids.reshape(-1)
        if self.rows is not None:  # a captured pass (engine/graph.py PassGraphs counts it at each replay)
            if self._valid[0] is not self.rows:
                self._valid = (self.rows, self.rows.valid[:, None].expand(T, K).reshape(-1).long())
            c[0].index_add_(0, ids, self._valid[1])
            return
        if T > 1 and layer == self.layers[0]:  # a host-driven prefill pass
            self.count_pass(T)
        one = self._one.get(ids.device)
        if one is None:
            one = self._one[ids.device] = torch.ones(1, dtype=torch.int64, device=ids.device)
        c[int(T == 1)].index_add_(0, ids, one.expand(ids.numel()))

    def count_pass(self, T: int) -> None:
        """A prefill pass of T tokens ran (counted on the host)."""
        self.passes[T] = self.passes.get(T, 0) + 1

    @torch.inference_mode()  # the counters were made inside the runner's passes
    def reset(self) -> None:
        """Zero in place (captured graphs keep adding into the same buffers)."""
        for c in self.counts.values():
            c.zero_()
        self.passes = {}

    def take(self) -> RouteCounts:
        """The counts so far, on the host, and zero the tally."""
        rc = RouteCounts.zeros(self.layers, self.num_experts)
        rc.passes = dict(self.passes)
        for layer, c in self.counts.items():
            host = c.cpu()
            rc.prefill[layer], rc.decode[layer] = host[0].clone(), host[1].clone()
        self.reset()
        first = next(iter(rc.prefill), None)
        for phase in self.PHASES:  # every token routes K experts in every MoE layer
            rc.tokens[phase] = int(getattr(rc, phase)[first].sum()) // self.top_k if first is not None else 0
        return rc


class _Counting:
    """The backend the model calls: counts, then the backend that computes."""

    def __init__(self, inner, tally: RouteTally):
        self.inner, self.tally = inner, tally

    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        self.tally.add(layer, topk)
        return self.inner(layer, x, topk)

    def many(self, layer: int, xs: list[torch.Tensor], topks: list[TopKOutput]) -> list[torch.Tensor]:
        """Each chunk counted as a pass of its own, as when the chunks ran one after the other."""
        for topk in topks:
            self.tally.add(layer, topk)
        return self.inner.many(layer, xs, topks)
