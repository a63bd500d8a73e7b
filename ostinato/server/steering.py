"""Tokens the server writes into an output where a request asks for what sampling alone
does not promise.

- A required call (OpenAI's tool_choice "required" or a named function, Anthropic's "any"
  or "tool"): the opening of a call in the family's markup (`ToolFormat.head`), with the
  function's name when the request names one or declares only one, is written where the
  answer begins: at the start of the output, or right after the reasoning when the prompt
  opened it. A model that would open its reasoning itself does not get to; the call comes
  first. The model writes the rest, unconstrained: its arguments may still miss the schema.
- One call at most (parallel_tool_calls false, disable_parallel_tool_use): the output ends
  once the first call's closing markup is written (after the reasoning).
- A reasoning budget (Anthropic's thinking.budget_tokens): once the output has taken that
  many tokens with its reasoning still open, the reasoning's closing markup is written and
  the answer follows.

A `Steering` runs on the engine thread after each token, on the text released so far; the
ids it returns are emitted next in place of sampled ones (Engine.generate's `insert`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ostinato.server.parsing import FORMATS, Family
from ostinato.server.parsing.base import THINK_CLOSE, THINK_OPEN


@dataclass(frozen=True)
class Asked:
    """What a request asks of its output beyond sampling."""
    call: bool = False  # a tool call is required
    name: str | None = None  # ... to this function
    single: bool = False  # at most one call
    budget: int | None = None  # reasoning tokens at most

    @property
    def anything(self) -> bool:
        return self.call or self.single or self.budget is not None


@dataclass(frozen=True)
class Reasoning:
    """Where a family's reasoning opens and closes in its output, and what ends it early."""
    open: str
    close: str
    write: str


THINK_TAGS = Reasoning(THINK_OPEN, THINK_CLOSE, "\n" + THINK_CLOSE + "\n\n")
HARMONY_ANALYSIS = Reasoning("<|channel|>analysis", "<|end|>", "<|end|><|start|>assistant")


def reasoning_of(family: Family) -> Reasoning | None:
    fmt = FORMATS[family.tool_format]
    if fmt is not None and fmt.reasons:
        return HARMONY_ANALYSIS
    return THINK_TAGS if family.thinks else None


class Steering:
    """One request's steering; `after(text, tokens)` -> ids to write next, or None: end here."""

    def __init__(self, asked: Asked, family: Family, encode: Callable[[str], list[int]], in_reasoning: bool):
        fmt = FORMATS[family.tool_format]
        self.asked = asked
        self.reasoning = reasoning_of(family)
        self.in_reasoning = in_reasoning and self.reasoning is not None
        self.head = encode(fmt.head(asked.name)) if asked.call and fmt is not None else []
        self.call_end = fmt.call_end if asked.single and fmt is not None else ""
        self.close = encode(self.reasoning.write) if asked.budget is not None and self.reasoning else []
        self.headed, self.closed = not self.head, not self.close
        # the output only grows: each search starts where the last one could not have missed a match
        self._close_end: int | None = None  # where the reasoning's closing markup ends, once found
        self._close_from = self._end_from = 0

    def after(self, text: str, tokens: int) -> list[int] | None:
        state, answer_at = self._state(text)
        if self.call_end and answer_at < len(text):
            start = max(answer_at, self._end_from)
            if text.find(self.call_end, start) >= 0:
                return None
            self._end_from = max(answer_at, len(text) - len(self.call_end) + 1)
        if not self.closed and state == "open" and tokens >= self.asked.budget:
            self.closed = True
            return list(self.close)
        if not self.headed and (state == "closed" if self.in_reasoning else tokens == 0):
            self.headed = True
            return list(self.head)
        return []

    def _state(self, text: str) -> tuple[str, int]:
        """-> (open | closed | none | undecided, where the answer starts) of the reasoning."""
        r = self.reasoning
        if r is None:
            return "none", 0
        body_at = 0
        if not self.in_reasoning:
            head = text.lstrip()
            if not head.startswith(r.open):
                return ("undecided", len(text)) if r.open.startswith(head) else ("none", 0)
            body_at = len(text) - len(head) + len(r.open)
        if self._close_end is None:
            end = text.find(r.close, max(body_at, self._close_from))
            if end < 0:
                self._close_from = max(body_at, len(text) - len(r.close) + 1)
                return "open", len(text)
            self._close_end = end + len(r.close)
        return "closed", self._close_end
