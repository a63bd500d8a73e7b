"""Routing profile: how many routes each (layer, expert) receives in a set of sessions.

A session's turns form one token stream: turn i+1's prompt begins with turn i's prompt
and its (forced) output, which is what lets the engine reuse the KV cache. So a session
is profiled by running its stream once, in chunks, with every token tagged as prompt
("prefill") or recorded output ("decode"); the router sees exactly the tokens a replay
would run, without paying for token-by-token decoding. Counts stay on the device.

Legend: L MoE layers (indexed by model layer), E experts, T tokens of a pass, K top-k.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ostinato.layers.moe.types import TopKOutput


@dataclass
class SessionStream:
    ids: list[int]
    is_output: list[bool]  # recorded assistant output tokens ("decode" routes)
    turn_starts: list[int] = field(default_factory=list)  # index of each turn's first new token


def session_stream(session, tok, max_tokens: int | None = None) -> SessionStream:
    """Token stream of a session: prompts and forced outputs, as a replay runs them."""
    ids: list[int] = []
    out: list[bool] = []
    starts = []
    for turn in session.turns:
        prompt = tok.render_ids(turn.messages, turn_tools(session), add_generation_prompt=True)
        if prompt[:len(ids)] != ids:  # the template re-rendered history: no reuse here
            ids, out = [], []
        starts.append(len(ids))
        out += [False] * (len(prompt) - len(ids))
        ids = list(prompt)
        forced = tok.encode(tok.render_assistant_output(turn.output, turn_tools(session)))
        ids += forced
        out += [True] * len(forced)
        if max_tokens and len(ids) >= max_tokens:
            break
    if max_tokens:
        ids, out = ids[:max_tokens], out[:max_tokens]
    return SessionStream(ids, out, [s for s in starts if s < len(ids)])


def turn_tools(session):
    return session.tools or None


@dataclass
class RouteCounts:
    """counts[phase][layer] = routes per expert, phase in {'prefill', 'decode'}."""

    prefill: dict[int, torch.Tensor]
    decode: dict[int, torch.Tensor]
    tokens: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    sessions: int = 0
    max_tokens: int = 0  # the longest session stream (= longest request: prompt + output), in tokens

    @classmethod
    def zeros(cls, layers: list[int], num_experts: int, device="cpu") -> "RouteCounts":
        z = lambda: {l: torch.zeros(num_experts, dtype=torch.int64, device=device) for l in layers}  # noqa: E731
        return cls(z(), z())

    def total(self, phase: str = "all") -> dict[int, torch.Tensor]:
        if phase == "all":
            return {l: self.prefill[l] + self.decode[l] for l in self.prefill}
        return getattr(self, phase)

    def to_json(self) -> dict:
        return {"version": 1, "sessions": self.sessions, "tokens": self.tokens, "max_tokens": self.max_tokens,
                "prefill": {str(l): c.tolist() for l, c in self.prefill.items()},
                "decode": {str(l): c.tolist() for l, c in self.decode.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "RouteCounts":
        t = lambda m: {int(l): torch.tensor(c, dtype=torch.int64) for l, c in m.items()}  # noqa: E731
        return cls(t(d["prefill"]), t(d["decode"]), dict(d["tokens"]), d.get("sessions", 0), d.get("max_tokens", 0))

    def layer_top_shares(self, fraction: float, phase: str = "all") -> dict[int, float]:
        """Per layer: the share of its routes on its own top `fraction` of experts (skew figure)."""
        out = {}
        for l, c in self.total(phase).items():
            c = torch.sort(c.double(), descending=True).values
            n = max(1, round(fraction * c.numel()))
            out[l] = float(c[:n].sum() / c.sum()) if c.sum() > 0 else 0.0
        return out

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()) + "\n")

    @classmethod
    def load(cls, path: Path) -> "RouteCounts":
        return cls.from_json(json.loads(Path(path).read_text()))


class CountingExperts:
    """Wraps an experts backend; counts the routes of each pass by the phase of its tokens."""

    def __init__(self, inner, counts: RouteCounts):
        self.inner, self.counts = inner, counts
        self.is_output: torch.Tensor | None = None  # [T] bool of the pass being run

    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        E = self.counts.prefill[layer].numel()
        mask = self.is_output[:, None].expand_as(topk.ids)
        ones = torch.ones_like(topk.ids)
        self.counts.decode[layer].index_add_(0, topk.ids[mask], ones[mask])
        self.counts.prefill[layer].index_add_(0, topk.ids[~mask], ones[~mask])
        assert self.counts.prefill[layer].numel() == E
        return self.inner(layer, x, topk)
