"""Qwen3-Coder tool calls, in XML:

    <tool_call>
    <function=NAME>
    <parameter=P>
    value
    </parameter>
    </function>
    </tool_call>

The values are bare text; the declared JSON-schema type of each parameter says what they
are: strings stay strings (a string value streams as it comes), numbers, booleans, null,
objects and arrays are converted once the value is complete (and stay strings if they do
not convert). The arguments are built as JSON text, `{"P": value, ...}`, one piece at a
time, so they stream like a JSON-writing model's. The template writes a newline after
`<parameter=P>` and before `</parameter>`; one of each is not part of the value.
"""
from __future__ import annotations

import json
import re

from ostinato.server.parsing.base import Block, ToolFormat, call, until
from ostinato.server.parsing.hermes import CLOSE, OPEN, blocks_between

_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>")
PARAM, PARAM_END, FUNCTION_END = "<parameter=", "</parameter>", "</function>"
_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}


def _type_of(schema: dict, param: str) -> str | None:
    spec = (schema.get("properties") or {}).get(param)
    t = spec.get("type") if isinstance(spec, dict) else None
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), None)
    return t if isinstance(t, str) else None


def _strip_newlines(value: str, complete: bool) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value  # (while streaming: held back)


def convert(value: str, kind: str | None) -> str:
    """A complete bare value -> JSON text, by the declared type (a string when it does not fit)."""
    v = value.strip()
    if kind is None or kind in _STRING_TYPES:
        return json.dumps(value, ensure_ascii=False)
    if v.lower() == "null":
        return "null"
    try:
        if kind == "integer":
            return json.dumps(int(v))
        if kind == "number":
            number = float(v)
            return json.dumps(int(number) if number.is_integer() and re.fullmatch(r"-?\d+", v) else number)
        if kind == "boolean" and v.lower() in ("true", "false"):
            return v.lower()
        if kind in ("object", "array"):
            parsed = json.loads(v)
            if isinstance(parsed, dict if kind == "object" else list):
                return json.dumps(parsed, ensure_ascii=False)
    except (ValueError, OverflowError):
        pass
    return json.dumps(value, ensure_ascii=False)


class Qwen3Coder(ToolFormat):
    name = "qwen3_coder"
    call_end = CLOSE

    @classmethod
    def head(cls, name: str | None) -> str:
        return OPEN + "\n<function=" + ("" if name is None else name + ">\n")

    def scan(self, out: str, final: bool) -> list[Block]:
        return blocks_between(out, final, OPEN, CLOSE, self._call)

    def _call(self, body: str, complete: bool, start: int) -> Block | None:
        head = _FUNCTION.match(body)
        if head is None or head.group(1).strip() not in self.tools:
            return None
        name = head.group(1).strip()
        return call(name, self._arguments(body[head.end():], complete, self.tools[name] or {}), start)

    @staticmethod
    def _arguments(rest: str, complete: bool, schema: dict) -> str:
        pieces, pos, open_string = [], 0, None
        while True:
            k, end = rest.find(PARAM, pos), rest.find(FUNCTION_END, pos)
            if k < 0 or 0 <= end < k:
                complete = complete or end >= 0
                break
            close = rest.find(">", k)
            if close < 0:
                break  # the parameter's name is still coming
            param = rest[k + len(PARAM):close].strip()
            kind = _type_of(schema, param)
            value, stop = until(rest[close + 1:], (PARAM_END, PARAM, FUNCTION_END), final=complete)
            key = json.dumps(param, ensure_ascii=False) + ": "
            if stop >= 0 or complete:
                pieces.append(key + convert(_strip_newlines(value, True), kind))
                if stop < 0:
                    break
                pos = close + 1 + stop + (len(PARAM_END) if rest.startswith(PARAM_END, close + 1 + stop) else 0)
                continue
            if kind is None or kind in _STRING_TYPES:
                open_string = key + json.dumps(_strip_newlines(value, False), ensure_ascii=False)[:-1]
            break
        args = "{" + ", ".join(pieces + ([open_string] if open_string else []))
        return args + "}" if complete else args
