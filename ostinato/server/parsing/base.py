"""Generated text -> ordered blocks (reasoning, text, tool calls), incrementally.

A model family writes its tool calls and reasoning in its own markup; a `ToolFormat`
knows one of them as a pure function `scan(text, final)` from the output so far to the
blocks it holds. `OutputParser` feeds it the growing text, normalises whitespace around
the blocks and emits what changed since the last feed as `Delta`s: new text, new
reasoning, a call's start (its name) and its arguments as they arrive.

Re-scanning the whole output on every delta costs O(n^2) in the output's length, but the
scans are a few regex searches, and it makes the property that matters easy to keep: the
deltas of any split of the text add up to the one-shot parse. That holds because a scan
of a prefix shows only what no continuation can change: a partial marker, trailing
whitespace and a call whose name is not yet known are held back; a call to a function the
request did not declare is held until its block closes and then shown as text.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger("ostinato.server")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Block:
    kind: Literal["reasoning", "text", "call"]
    text: str  # the text, the reasoning, or a call's arguments (JSON text, possibly partial)
    name: str = ""  # calls: the function
    start: int = 0  # calls: offset of the call's markup in the output (its id derives from what precedes it)


def text(t: str) -> Block:
    return Block("text", t)


def reasoning(t: str) -> Block:
    return Block("reasoning", t)


def call(name: str, arguments: str, start: int) -> Block:
    return Block("call", arguments, name, start)


@dataclass(frozen=True)
class Delta:
    kind: Literal["reasoning", "text", "call"]
    block: int  # index of the block it extends (blocks are numbered in output order)
    text: str  # the new characters (for a call: of its arguments)
    new: bool = False  # the block's first delta
    name: str = ""  # calls
    call: int = -1  # calls: their ordinal among the calls (OpenAI's tool_calls index)
    key: str = ""  # calls: a deterministic id suffix (the same text gives the same ids)


def partial_suffix(text: str, needles: tuple[str, ...] | list[str]) -> int:
    """Length of the longest end of `text` that starts one of `needles` (without completing it)."""
    best = 0
    for needle in needles:
        for k in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:k]):
                best = k
                break
    return best


def until(text: str, ends: tuple[str, ...], final: bool) -> tuple[str, int]:
    """The part of `text` before the first of `ends` -> (part, offset of that end or -1).
    With no end yet (and not final), a partial end is held back."""
    hits = [i for e in ends if (i := text.find(e)) >= 0]
    if hits:
        return text[:min(hits)], min(hits)
    return text[:len(text) - (0 if final else partial_suffix(text, ends))], -1


class ToolFormat:
    """One family's tool-call markup. `scan` must be monotone: the blocks of a prefix are a
    prefix of the blocks of the whole (each one's text a prefix of its final text). `head`
    and `call_end` are what the server writes to require a call and watches for to end after
    one (server/steering.py)."""
    name = ""
    reasons = False  # the format carries reasoning itself (harmony's analysis channel)
    call_end = ""  # the markup that closes a call (empty where an end-of-turn token does)

    def __init__(self, tools: dict[str, dict]):
        self.tools = tools  # declared function name -> its parameters' JSON schema

    def scan(self, text: str, final: bool) -> list[Block]:
        raise NotImplementedError

    @classmethod
    def head(cls, name: str | None) -> str:
        """The markup that opens a call, up to its name, or with `name` up to its arguments
        (and the brace that opens JSON arguments), as the chat template writes it."""
        raise NotImplementedError


def split_reasoning(out: str, inside: bool, final: bool) -> tuple[str | None, int]:
    """`<think>...</think>` at the start of the output -> (reasoning or None, where the rest begins).
    `inside`: the prompt opened `<think>`, the output starts in it. An unclosed think is all reasoning."""
    if not inside:
        head = out.lstrip()
        if not head.startswith(THINK_OPEN):
            if not final and head and THINK_OPEN.startswith(head):
                return None, len(out)  # might still become `<think>`: hold it
            return None, 0
        body_at = len(out) - len(head) + len(THINK_OPEN)
    else:
        body_at = 0
    body, end = until(out[body_at:], (THINK_CLOSE,), final)
    return body, len(out) if end < 0 else body_at + end + len(THINK_CLOSE)


def normalise(blocks: list[Block], final: bool) -> list[Block]:
    """Merge neighbours of a kind; strip the whitespace that touches another kind of block
    (the markup's own newlines); hold back trailing whitespace until something follows it."""
    merged: list[Block] = []
    for b in blocks:
        if merged and b.kind == merged[-1].kind != "call":
            merged[-1] = Block(b.kind, merged[-1].text + b.text)
        else:
            merged.append(b)
    out = []
    for i, b in enumerate(merged):
        if b.kind == "call":
            out.append(b)
            continue
        t = b.text
        if i > 0 or b.kind == "reasoning":
            t = t.lstrip()
        if i + 1 < len(merged) or not final or b.kind == "reasoning":
            t = t.rstrip()
        if t:
            out.append(Block(b.kind, t))
    return out


class OutputParser:
    """Text deltas in, `Delta`s out; `feed` as the text comes, `finish` once at the end."""

    def __init__(self, fmt: ToolFormat | None, reasoning: bool = False, in_reasoning: bool = False):
        self.fmt = fmt
        self.reasoning = reasoning and not (fmt is not None and fmt.reasons)
        self.in_reasoning = in_reasoning and self.reasoning
        self.text = ""
        self.blocks: list[Block] = []  # what has been emitted, block by block
        self.keys: list[str] = []  # per call
        self.finished = False

    def feed(self, delta: str) -> list[Delta]:
        if not delta or self.finished:
            return []
        self.text += delta
        return self._update(final=False)

    def finish(self) -> list[Delta]:
        if self.finished:
            return []
        self.finished = True
        return self._update(final=True)

    def view(self, final: bool) -> list[Block]:
        """The blocks of the output so far (all of them when final)."""
        out, start, blocks = self.text, 0, []
        if self.reasoning:
            thought, start = split_reasoning(out, self.in_reasoning, final)
            if thought is not None:
                blocks.append(reasoning(thought))
        rest = out[start:]
        if self.fmt is None:
            blocks.append(text(rest))
        else:
            blocks += [Block(b.kind, b.text, b.name, b.start + start) for b in self.fmt.scan(rest, final)]
        return normalise(blocks, final)

    def _update(self, final: bool) -> list[Delta]:
        deltas = []
        for i, b in enumerate(self.view(final)):
            if i < len(self.blocks):
                old = self.blocks[i]
                if old.kind != b.kind or old.name != b.name or not b.text.startswith(old.text):
                    log.warning("output parser: block %d changed from %r to %r; keeping what was sent", i, old, b)
                    continue
                if len(b.text) > len(old.text):
                    deltas.append(self._delta(i, b, b.text[len(old.text):], new=False))
                    self.blocks[i] = b
            else:
                if b.kind == "call":
                    digest = hashlib.sha256(self.text[:b.start].encode("utf-8", "surrogatepass")).hexdigest()[:16]
                    self.keys.append(f"{digest}_{len(self.keys)}")
                self.blocks.append(b)
                deltas.append(self._delta(i, b, b.text, new=True))
        return deltas

    def _delta(self, i: int, b: Block, chunk: str, new: bool) -> Delta:
        if b.kind != "call":
            return Delta(b.kind, i, chunk, new)
        ordinal = sum(1 for x in self.blocks[:i] if x.kind == "call")
        return Delta("call", i, chunk, new, b.name, ordinal, self.keys[ordinal])
