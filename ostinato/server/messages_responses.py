"""Anthropic Messages responses: a whole message, or its event stream.

The stream is Anthropic's sequence: message_start, ping, then per content block
content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta)
/ content_block_stop, then message_delta (stop_reason, usage) and message_stop. Blocks
are the family parser's, in output order: thinking, text, tool_use, ... A whole message
is built from the same deltas, so both carry the same blocks.

Usage follows Anthropic's split: input_tokens are the prompt tokens that were run,
cache_read_input_tokens the ones whose KV cache was reused (their sum is the prompt).
"""
from __future__ import annotations

import json
import uuid

from ostinato.server.errors import APIError
from ostinato.server.parsing import Delta, OutputParser
from ostinato.server.responses import timings
from ostinato.server.worker import Finished


def event(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


def anthropic_usage(done: Finished) -> dict:
    s = done.stats
    return {"input_tokens": s.prompt_tokens - s.cached_tokens, "output_tokens": s.output_tokens,
            "cache_read_input_tokens": s.cached_tokens, "cache_creation_input_tokens": 0}


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}  # cut off by max_tokens: the partial JSON was streamed, the object is unknown
    return value if isinstance(value, dict) else {}


class MessageShape:
    def __init__(self, model: str, prompt_tokens: int, parser: OutputParser):
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.parser = parser
        self.blocks: list[dict] = []  # content blocks; a tool_use holds its arguments' text until the end
        self._ended: list[str] | None = None

    def _apply(self, deltas: list[Delta]) -> list[str]:
        out = []
        for d in deltas:
            if d.new:
                if self.blocks:
                    out.append(event("content_block_stop", {"index": len(self.blocks) - 1}))
                self.blocks.append(self._start(d))
                start = dict(self.blocks[-1], input={}) if d.kind == "call" else dict(self.blocks[-1])
                start.pop("arguments", None)
                start.update({"text": ""} if d.kind == "text" else {"thinking": ""} if d.kind == "reasoning" else {})
                out.append(event("content_block_start", {"index": len(self.blocks) - 1, "content_block": start}))
            block, index = self.blocks[-1], len(self.blocks) - 1
            if not d.text:
                continue
            if d.kind == "text":
                block["text"] += d.text if not d.new else ""
                delta = {"type": "text_delta", "text": d.text}
            elif d.kind == "reasoning":
                block["thinking"] += d.text if not d.new else ""
                delta = {"type": "thinking_delta", "thinking": d.text}
            else:
                block["arguments"] += d.text if not d.new else ""
                delta = {"type": "input_json_delta", "partial_json": d.text}
            out.append(event("content_block_delta", {"index": index, "delta": delta}))
        return out

    @staticmethod
    def _start(d: Delta) -> dict:
        if d.kind == "text":
            return {"type": "text", "text": d.text}
        if d.kind == "reasoning":
            return {"type": "thinking", "thinking": d.text, "signature": ""}
        return {"type": "tool_use", "id": "toolu_" + d.key, "name": d.name, "arguments": d.text}

    def feed(self, text: str) -> list[str]:
        return self._apply(self.parser.feed(text))

    def _end(self, done: Finished) -> list[str]:
        if self._ended is None:
            self._ended = self._apply(self.parser.feed(done.tail) + self.parser.finish())
        return self._ended

    def stop_reason(self, done: Finished) -> str:
        if done.finish_reason == "length":
            return "max_tokens"
        if done.stop_sequence is not None:
            return "stop_sequence"
        return "tool_use" if any(b["type"] == "tool_use" for b in self.blocks) else "end_turn"

    def content(self) -> list[dict]:
        return [{k: v for k, v in b.items() if k != "arguments"} | {"input": _input(b["arguments"])}
                if b["type"] == "tool_use" else b for b in self.blocks]

    def response(self, done: Finished) -> dict:
        self._end(done)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content(), "stop_reason": self.stop_reason(done),
                "stop_sequence": done.stop_sequence, "usage": anthropic_usage(done), "timings": timings(done.stats)}

    def stream_start(self) -> list[str]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        return [event("message_start", {"message": message}), event("ping", {})]

    def stream_text(self, text: str) -> list[str]:
        return self.feed(text)

    def stream_end(self, done: Finished) -> list[str]:
        out = self._end(done)
        if self.blocks:
            out = out + [event("content_block_stop", {"index": len(self.blocks) - 1})]
        delta = {"stop_reason": self.stop_reason(done), "stop_sequence": done.stop_sequence}
        return out + [event("message_delta", {"delta": delta, "usage": anthropic_usage(done)}),
                      event("message_stop", {})]

    def stream_error(self, error: APIError) -> list[str]:
        return [event("error", {"error": error.anthropic_body()["error"]})]
