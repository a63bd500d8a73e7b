"""What both session families share: drawing lengths from the measured quantiles, tool-call
envelopes and filling a length with sentences or lines. Kept apart so that the family
modules and the generator that dispatches to them import it without a cycle."""

from __future__ import annotations

import random
import string
from typing import Any, Callable, Iterator, Sequence

from ostinato.sessions.turns import Message


class _Lengths:
    """Draws the lengths of one family from its measured quantiles (inverse CDF)."""

    def __init__(self, rng: random.Random, stats: dict) -> None:
        self.rng, self.stats = rng, stats

    def draw(self, q: Sequence[float]) -> float:
        pos = self.rng.random() * (len(q) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(q) - 1)
        return q[lo] + (q[hi] - q[lo]) * (pos - lo)

    def turns(self) -> int:
        return max(1, round(self.draw(self.stats["turns_per_session"])))

    def new(self, kind: str) -> int:
        table = self.stats["new_chars"]
        return max(1, round(self.draw(table.get(kind) or table["tool"])))

    def output(self, tool_call: bool) -> int:
        table = self.stats["output_chars"]
        return max(1, round(self.draw(table.get("tool_call" if tool_call else "text") or table["text"])))


_Built = tuple[list[Message], list[int], list[str], "list[dict] | None"]


ID_ALPHABET = string.ascii_letters + string.digits


def _call(rng: random.Random, name: str, arguments: str) -> dict:
    call_id = "call_" + "".join(rng.choice(ID_ALPHABET) for _ in range(24))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _prose(rng: random.Random, vocabulary: Any, sentences: Sequence[str], size: int,
           opening: Sequence[str] = ()) -> str:
    """Sentences (the first from `opening` if given) filled with the vocabulary's slots
    until `size` characters, then cut."""
    parts: list[str] = []
    length = 0
    while length < size:
        text = rng.choice(opening if opening and not parts else sentences).format_map(vocabulary.slots(rng))
        parts.append(text)
        length += len(text) + 1
    return _fit(" ".join(parts), size)


def _fit(text: str, size: int) -> str:
    """text cut to at most `size` characters, at a word boundary when one is close."""
    if len(text) <= size:
        return text
    cut = text[:size]
    boundary = max(cut.rfind(" "), cut.rfind("\n"))
    return cut[:boundary] if boundary >= size - 12 else cut


def _lines(rng: random.Random, make: Callable[[random.Random], str] | Iterator[str], size: int) -> str:
    """Lines from `make` (a function of rng or an iterator) until `size` characters, cut at
    a line end when one is close."""
    parts: list[str] = []
    length = 0
    while length < size:
        parts.append(next(make) if isinstance(make, Iterator) else make(rng))
        length += len(parts[-1]) + 1
    text = "\n".join(parts)
    if len(text) > size and text.rfind("\n", 0, size) >= size - 80:
        return text[: text.rfind("\n", 0, size)]
    return text[:size]
