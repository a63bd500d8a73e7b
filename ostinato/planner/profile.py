"""Routing profile: how many routes each (layer, expert) receives in a set of sessions (a
RouteCounts, engine/routes.py).

A session's turns form one token stream: turn i+1's prompt begins with turn i's prompt
and its (forced) output, which is what lets the engine reuse the KV cache. So a session
is profiled by running its stream once, in chunks, with every token tagged as prompt
("prefill") or recorded output ("decode"); the router sees exactly the tokens a replay
would run, without paying for token-by-token decoding. Counts stay on the device.

Legend: L MoE layers (indexed by model layer), E experts, T tokens of a pass, K top-k.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ostinato.engine.routes import RouteCounts
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


def turn_prompts(st: SessionStream) -> list[int]:
    """The new prompt tokens of each turn of a stream: what a replay prefills at that turn (the
    rest of the prompt is the KV cache the turn before left), from the turn's start to its first
    output token."""
    out = []
    for s in st.turn_starts:
        e = s
        while e < len(st.ids) and not st.is_output[e]:
            e += 1
        out.append(e - s)
    return out


def turn_tools(session):
    return session.tools or None


class CountingExperts:
    """Wraps an experts backend; counts the routes of each pass by the phase of its tokens."""

    def __init__(self, inner, counts: RouteCounts):
        self.inner, self.counts = inner, counts
        self.is_output: torch.Tensor | None = None  # [T] bool of the pass being run

    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        self._count(layer, topk.ids)
        return self.inner(layer, x, topk)

    def many(self, layer: int, xs: list[torch.Tensor], topks: list[TopKOutput]) -> list[torch.Tensor]:
        """Every chunk of the pass counted (is_output covers the pass), then handed on together."""
        self._count(layer, torch.cat([t.ids for t in topks]))
        return self.inner.many(layer, xs, topks)

    def _count(self, layer: int, ids: torch.Tensor) -> None:
        """ids [T, K] of the pass being run, whose tokens' phases is_output [T] gives."""
        E = self.counts.prefill[layer].numel()
        mask = self.is_output[:, None].expand_as(ids)
        ones = torch.ones_like(ids)
        self.counts.decode[layer].index_add_(0, ids[mask], ones[mask])
        self.counts.prefill[layer].index_add_(0, ids[~mask], ones[~mask])
        assert self.counts.prefill[layer].numel() == E
