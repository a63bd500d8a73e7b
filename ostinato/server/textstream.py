"""Generated tokens -> the text a client sees, piece by piece (on the engine thread).

`TextStream`: ids -> text deltas. End-of-turn tokens are silent; stop sequences end the
output before them. Text that could still become a stop sequence is held back until it
cannot, so the engine is cancelled at the token that completes one and never sends text
past it. What the text means (reasoning, content, tool calls) is decided on the request
side, by the model family's parser (ostinato.server.parsing).
"""
from __future__ import annotations

from ostinato.loader.tokenizer import ChatTokenizer
from ostinato.server.parsing.base import partial_suffix


class TextStream:
    def __init__(self, tokenizer: ChatTokenizer, stop: list[str], silent_ids: frozenset[int]):
        self.decoder = tokenizer.stream_decoder()
        self.stop = stop
        self.silent_ids = silent_ids
        self.pending = ""  # decoded, not yet released: might start a stop sequence
        self.text = ""  # released so far
        self.stopped = False  # a stop sequence was found; ignore the rest
        self.matched: str | None = None  # the stop sequence that ended the output

    def feed(self, token: int) -> str:
        if self.stopped or token in self.silent_ids:
            return ""
        return self._release(self.decoder.feed(token), final=False)

    def flush(self) -> str:
        return "" if self.stopped else self._release(self.decoder.flush(), final=True)

    def _release(self, delta: str, final: bool) -> str:
        self.pending += delta
        hits = [(i, s) for s in self.stop if (i := self.pending.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)
            out, self.pending, self.stopped = self.pending[:at], "", True
        else:
            keep = 0 if final else partial_suffix(self.pending, self.stop)
            cut = len(self.pending) - keep
            out, self.pending = self.pending[:cut], self.pending[cut:]
        self.text += out
        return out
