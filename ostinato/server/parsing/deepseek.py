"""DeepSeek tool calls, between special tokens (the bars are U+FF5C, the spaces U+2581).

V3 writes the type, then the name, then the arguments in a fenced JSON block:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 (and its chat template) drops the type and the fence: the name comes before the
separator, the arguments' JSON right after it:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The two share the scan over the calls; each reads a call's body its own way. The arguments
stream as they come (between the fences in V3); a V3 call without the fence, or a V3.1
call with one, is accepted as well. The name is known once the separator (V3: the line
after it) is complete, so a call shows nothing before.
"""
from __future__ import annotations

import re

from ostinato.server.parsing.base import Block, ToolFormat, call, partial_suffix, text, until

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"
_HEAD = re.compile(r"[^\n<]*" + re.escape(SEP) + r"([^\n]*)\n")
_OPEN_FENCE = re.compile(r"\s*```[a-zA-Z]*[ \t]*\n")


def _arguments(rest: str, complete: bool) -> str:
    head = rest.lstrip()
    if head.startswith("`") or (not complete and not head):
        fence = _OPEN_FENCE.match(rest)
        if fence is None:
            return ""  # the opening fence is still coming
        inner, _ = until(rest[fence.end():], (FENCE,), complete)
        return inner.strip()
    return rest.strip()


class DeepSeekV3(ToolFormat):
    name = "deepseek_v3"
    call_end = CALL_END

    @classmethod
    def head(cls, name: str | None) -> str:
        return CALLS_BEGIN + CALL_BEGIN + "function" + SEP + ("" if name is None else name + "\n```json\n{")

    def scan(self, out: str, final: bool) -> list[Block]:
        begin = out.find(CALLS_BEGIN)
        if begin < 0:
            return [text(out[:len(out) - (0 if final else partial_suffix(out, (CALLS_BEGIN,)))])]
        blocks, pos = [text(out[:begin])], begin + len(CALLS_BEGIN)
        while True:
            at, end = out.find(CALL_BEGIN, pos), out.find(CALLS_END, pos)
            if at < 0 or 0 <= end < at:
                if end >= 0:  # text after the calls
                    tail = out[end + len(CALLS_END):]
                    blocks.append(text(tail))
                return blocks
            j = out.find(CALL_END, at)
            body = out[at + len(CALL_BEGIN):j if j >= 0 else len(out)]
            complete = j >= 0 or final
            if not complete:
                body = body[:len(body) - partial_suffix(body, (CALL_END,))]
            found = self._call(body, complete, at)
            if found is None:
                if not complete:
                    return blocks
                found = text(out[at:j + len(CALL_END)] if j >= 0 else out[at:])
            blocks.append(found)
            if j < 0:
                return blocks
            pos = j + len(CALL_END)

    def _call(self, body: str, complete: bool, start: int) -> Block | None:
        head = _HEAD.match(body)
        if head is None or head.group(1).strip() not in self.tools:
            return None
        return call(head.group(1).strip(), _arguments(body[head.end():], complete), start)


class DeepSeekV31(DeepSeekV3):
    name = "deepseek_v31"

    @classmethod
    def head(cls, name: str | None) -> str:
        return CALLS_BEGIN + CALL_BEGIN + ("" if name is None else name + SEP + "{")

    def _call(self, body: str, complete: bool, start: int) -> Block | None:
        at = body.find(SEP)
        if at < 0 or body[:at].strip() not in self.tools:
            return None
        return call(body[:at].strip(), _arguments(body[at + len(SEP):], complete), start)
