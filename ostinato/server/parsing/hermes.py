"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The arguments stream when the call is written the way templates write it (name first,
then an object of arguments): they are the model's own text between `"arguments": ` and
the block's closing brace, so a re-rendered call reproduces its tokens. Any other layout
(arguments first, arguments as a JSON string) is parsed when its block closes.
"""
from __future__ import annotations

import json
import re

from ostinato.server.parsing.base import Block, ToolFormat, call, partial_suffix, text

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def blocks_between(out: str, final: bool, open_: str, close: str, parse) -> list[Block]:
    """Text with `open_ ... close` blocks; `parse(body, complete, start)` -> a call, or
    None: shown as text once complete, held back before."""
    blocks, pos = [], 0
    while True:
        i = out.find(open_, pos)
        if i < 0:
            tail = out[pos:]
            blocks.append(text(tail[:len(tail) - (0 if final else partial_suffix(tail, (open_,)))]))
            return blocks
        blocks.append(text(out[pos:i]))
        at = i + len(open_)
        j = out.find(close, at)
        body = out[at:j] if j >= 0 else out[at:]
        if j < 0 and not final:
            body = body[:len(body) - partial_suffix(body, (close,))]
        found = parse(body, j >= 0 or final, i)
        if found is None:
            if j < 0 and not final:
                return blocks  # undecided: hold the rest
            found = text(out[i:j + len(close)] if j >= 0 else out[i:])
        blocks.append(found)
        if j < 0:
            return blocks
        pos = j + len(close)


def _trim_arguments(region: str, complete: bool) -> str:
    """The arguments' text: the region less the block's closing brace (held back while it
    might be that brace) and the whitespace around it."""
    r = region.rstrip()
    inner = (r[:-1] if r.endswith("}") else r).rstrip()
    if complete and not _is_json(inner) and _is_json(r):
        return r  # the block's own brace was missing: keep the arguments whole
    return inner


def _is_json(s: str) -> bool:
    try:
        json.loads(s)
        return True
    except ValueError:
        return False


class Hermes(ToolFormat):
    name = "hermes"
    call_end = CLOSE

    @classmethod
    def head(cls, name: str | None) -> str:
        opening = OPEN + '\n{"name": '
        return opening + '"' if name is None else opening + json.dumps(name, ensure_ascii=False) + ', "arguments": {'

    def scan(self, out: str, final: bool) -> list[Block]:
        return blocks_between(out, final, OPEN, CLOSE, self._call)

    def _call(self, body: str, complete: bool, start: int) -> Block | None:
        head = _HEAD.match(body)
        if head is not None:
            name = json.loads(head.group(1))
            region = body[head.end():]
            if name in self.tools and region[:1] == "{":
                return call(name, _trim_arguments(region, complete), start)
        return self._whole(body, start) if complete else None

    def _whole(self, body: str, start: int) -> Block | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.tools:
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return call(obj["name"], json.dumps(args, ensure_ascii=False), start)
