"""gpt-oss's harmony format: the output is a sequence of messages on channels.

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>

The prompt ends with `<|start|>assistant`, so the first message's header comes without
it. `analysis` is reasoning; `final` (and `commentary` without a recipient, a preamble
to the user) is text; a message addressed `to=functions.NAME` (in the header before or
after the channel) is a call whose body is the JSON arguments. `<|call|>` and
`<|return|>` usually end the generation as end-of-turn tokens and are not in the text:
the end of the output ends the last message.
"""
from __future__ import annotations

import re

from ostinato.server.parsing.base import Block, ToolFormat, call, reasoning, text, until

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class Harmony(ToolFormat):
    name = "harmony"
    reasons = True  # call_end: <|call|> is an end-of-turn token, a call ends the output anyway

    @classmethod
    def head(cls, name: str | None) -> str:
        to = CHANNEL + "commentary to=functions."
        return to if name is None else to + name + " <|constrain|>json" + MESSAGE + "{"

    def scan(self, out: str, final: bool) -> list[Block]:
        blocks, pos = [], 0
        while pos < len(out):
            if not out.startswith((START, CHANNEL), pos):  # text outside any message
                plain, end = until(out[pos:], (START, CHANNEL), final)
                if plain:
                    blocks.append(text(plain))
                if end < 0:
                    break
                pos += end
                continue
            at = out.find(MESSAGE, pos)
            if at < 0:  # a header on its way (at the end: never finished, shown as written)
                if final:
                    blocks.append(text(out[pos:]))
                break
            header = out[pos:at]
            body, end = until(out[at + len(MESSAGE):], (*ENDS, START), final)
            complete = end >= 0 or final
            stop = len(out) if end < 0 else at + len(MESSAGE) + end
            found = self._message(header, body, complete, pos)
            if found is None:
                if not complete:
                    break
                found = text(out[pos:stop])  # a call to an undeclared function: as written
            if found.kind != "call" and blocks and blocks[-1].kind == found.kind:
                found = Block(found.kind, "\n" + found.text)  # two messages of a kind
            blocks.append(found)
            if end < 0:
                break
            pos = stop
            for e in ENDS:
                if out.startswith(e, pos):
                    pos += len(e)
                    break
        return blocks

    def _message(self, header: str, body: str, complete: bool, start: int) -> Block | None:
        to = _RECIPIENT.search(header)
        if to is not None:
            target = to.group(1)
            name = target.removeprefix("functions.")
            return call(name, body.strip(), start) \
                if target.startswith("functions.") and name in self.tools else None
        channel = _CHANNEL.search(header)
        return reasoning(body) if channel is not None and channel.group(1) == "analysis" else text(body)
