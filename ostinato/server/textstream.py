"""Generated tokens -> the text a client sees, piece by piece.

Two stages, both incremental so that a stream and a whole response agree exactly:

- `TextStream` (on the engine thread): ids -> text deltas. End-of-turn tokens are
  silent; stop sequences end the output before them. Text that could still become a
  stop sequence is held back until it cannot, so the engine is cancelled at the token
  that completes one and never sends text past it.
- `ChatDeltas` (on the request side): text -> content deltas now and tool calls at the
  end. With tools, content is released only up to the first `<tool_call>` (and neither a
  partial marker nor trailing whitespace, which the parser may strip); the rest waits
  for `parse_assistant_output` at the end of the turn, which decides what is a call. The
  released deltas are always a prefix of the final content, so the last delta completes it.
"""
from __future__ import annotations

from ostinato.loader.tokenizer import ChatTokenizer

TOOL_CALL_MARK = "<tool_call>"


def _partial_suffix(text: str, needles: list[str]) -> int:
    """Length of the longest end of `text` that starts one of `needles` (without completing it)."""
    best = 0
    for needle in needles:
        for k in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:k]):
                best = k
                break
    return best


class TextStream:
    def __init__(self, tokenizer: ChatTokenizer, stop: list[str], silent_ids: frozenset[int]):
        self.decoder = tokenizer.stream_decoder()
        self.stop = stop
        self.silent_ids = silent_ids
        self.pending = ""  # decoded, not yet released: might start a stop sequence
        self.text = ""  # released so far
        self.stopped = False  # a stop sequence was found; ignore the rest

    def feed(self, token: int) -> str:
        if self.stopped or token in self.silent_ids:
            return ""
        return self._release(self.decoder.feed(token), final=False)

    def flush(self) -> str:
        return "" if self.stopped else self._release(self.decoder.flush(), final=True)

    def _release(self, delta: str, final: bool) -> str:
        self.pending += delta
        hits = [i for s in self.stop if (i := self.pending.find(s)) >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
        else:
            keep = 0 if final else _partial_suffix(self.pending, self.stop)
            cut = len(self.pending) - keep
            out, self.pending = self.pending[:cut], self.pending[cut:]
        self.text += out
        return out


class ChatDeltas:
    def __init__(self, tokenizer: ChatTokenizer, parse_tools: bool):
        self.tokenizer = tokenizer
        self.parse_tools = parse_tools
        self.text = ""
        self.sent = ""  # content released to the client
        self.in_call = False  # a `<tool_call>` has begun: the rest waits for the end of the turn

    def feed(self, delta: str) -> str:
        self.text += delta
        if not self.parse_tools:
            self.sent += delta
            return delta
        if self.in_call:
            return ""
        mark = self.text.find(TOOL_CALL_MARK)
        self.in_call = mark >= 0
        visible = self.text[:mark] if mark >= 0 else \
            self.text[:len(self.text) - _partial_suffix(self.text, [TOOL_CALL_MARK])]
        visible = visible.strip()
        if len(visible) <= len(self.sent) or not visible.startswith(self.sent):
            return ""
        out, self.sent = visible[len(self.sent):], visible
        return out

    def finish(self) -> tuple[str, str, list[dict]]:
        """-> (the last content delta, the whole content, the tool calls)."""
        if not self.parse_tools:
            return "", self.text, []
        content, calls = self.tokenizer.parse_assistant_output(self.text)
        rest = content[len(self.sent):] if content.startswith(self.sent) else ""
        return rest, content, calls
