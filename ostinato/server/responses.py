"""Response bodies and stream chunks in OpenAI's formats, with llama.cpp-style timings.

A `Shape` turns the engine's text pieces into one endpoint's answer: chat (the family
parser's deltas as content, reasoning_content and tool_calls deltas) or text completion.
The same shape builds both the streamed chunks and the whole response (a whole response
is the sum of the chunks it would have streamed), so the two cannot disagree. Every
shape, Anthropic's included (messages_responses.py), answers the same four calls:
`feed(text)` while tokens come, then `response(done)`, or, streaming, `stream_start()`,
`stream_text(text)`, `stream_end(done)` / `stream_error(error)` as SSE strings.
"""
from __future__ import annotations

import json
import time
import uuid

from ostinato.engine.session import GenerationStats
from ostinato.server.errors import APIError
from ostinato.server.parsing import Delta, OutputParser
from ostinato.server.worker import Finished


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.output_tokens,
            "total_tokens": stats.prompt_tokens + stats.output_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


def timings(stats: GenerationStats) -> dict:
    """llama.cpp server's fields. prompt_n counts only the prompt tokens that were run
    (cache_n were reused); prompt_ms runs to the first token, predicted_ms covers the
    tokens after it, so predicted_per_token_ms is the decode time per token (TPOT)."""
    prompt_ms, predicted_ms = 1000 * stats.prefill_s, 1000 * stats.decode_s
    new, later = stats.new_prompt_tokens, max(0, stats.output_tokens - 1)
    return {"cache_n": stats.cached_tokens, "prompt_n": new, "prompt_ms": round(prompt_ms, 3),
            "prompt_per_token_ms": round(prompt_ms / max(1, new), 3),
            "prompt_per_second": round(1000 * new / prompt_ms, 3) if prompt_ms else 0.0,
            "predicted_n": stats.output_tokens, "predicted_ms": round(predicted_ms, 3),
            "predicted_per_token_ms": round(predicted_ms / later, 3) if later else 0.0,
            "predicted_per_second": round(1000 * later / predicted_ms, 3) if predicted_ms else 0.0}


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


class Shape:
    """What chat and text completions share: ids, envelopes, usage, timings."""
    object = ""
    chunk_object = ""
    prefix = ""

    def __init__(self, model: str, prompt_ids: list[int] | None, include_usage: bool = False):
        self.id = self.prefix + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model
        self.prompt_ids = prompt_ids  # reported when the request asked for ids
        self.include_usage = include_usage

    def feed(self, text: str) -> list[dict]:
        raise NotImplementedError

    def end_chunks(self, done: Finished) -> list[dict]:
        raise NotImplementedError

    def first_chunks(self) -> list[dict]:
        return []

    def stream_start(self) -> list[str]:
        return [sse(c) for c in self.first_chunks()]

    def stream_text(self, text: str) -> list[str]:
        return [sse(c) for c in self.feed(text)]

    def stream_end(self, done: Finished) -> list[str]:
        chunks = self.end_chunks(done) + ([self.usage_chunk(done)] if self.include_usage else [])
        return [sse(c) for c in chunks] + [sse("[DONE]")]

    def stream_error(self, error: APIError) -> list[str]:
        return [sse(error.body()), sse("[DONE]")]

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def _ids(self, choice: dict, done: Finished) -> dict:
        if self.prompt_ids is not None:
            choice["ostinato_output_ids"] = done.ids
        return choice

    def final_chunk(self, done: Finished, last: dict) -> dict:
        body = self.envelope(self.chunk_object, [self._ids({"index": 0, **last, "logprobs": None,
                                                            "finish_reason": self.finish_reason(done)}, done)])
        body["timings"] = timings(done.stats)
        if self.prompt_ids is not None:
            body["ostinato_prompt_ids"] = self.prompt_ids
        return body

    def usage_chunk(self, done: Finished) -> dict:
        body = self.envelope(self.chunk_object, [])
        body["usage"] = usage(done.stats)
        return body

    def response(self, done: Finished) -> dict:
        body = self.envelope(self.object, [self._ids(self.choice(done), done)])
        body["usage"] = usage(done.stats)
        body["timings"] = timings(done.stats)
        if self.prompt_ids is not None:
            body["ostinato_prompt_ids"] = self.prompt_ids
        return body

    def finish_reason(self, done: Finished) -> str:
        return done.finish_reason


class ChatShape(Shape):
    """Reasoning, content and tool calls, as the family parser finds them. Text blocks
    after a call join the content on a new line."""
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prefix = "chatcmpl-"

    def __init__(self, model: str, prompt_ids, parser: OutputParser, include_usage: bool = False):
        super().__init__(model, prompt_ids, include_usage)
        self.parser = parser
        self.content, self.reasoning, self.calls = "", "", []
        self._ended: list[dict] | None = None

    def _chunk(self, delta: dict) -> dict:
        return self.envelope(self.chunk_object, [{"index": 0, "delta": delta, "logprobs": None,
                                                         "finish_reason": None}])

    def first_chunks(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def _apply(self, deltas: list[Delta]) -> list[dict]:
        out = []
        for d in deltas:
            if d.kind == "reasoning":
                self.reasoning += d.text
                out.append({"reasoning_content": d.text})
            elif d.kind == "text":
                piece = "\n" + d.text if d.new and self.content else d.text
                self.content += piece
                out.append({"content": piece})
            elif d.new:
                function = {"name": d.name, "arguments": d.text}
                self.calls.append({"id": "call_" + d.key, "type": "function", "function": dict(function)})
                out.append({"tool_calls": [{"index": d.call, "id": "call_" + d.key, "type": "function",
                                            "function": function}]})
            else:
                self.calls[d.call]["function"]["arguments"] += d.text
                out.append({"tool_calls": [{"index": d.call, "function": {"arguments": d.text}}]})
        return [self._chunk(x) for x in out]

    def feed(self, text: str) -> list[dict]:
        return self._apply(self.parser.feed(text))

    def _end(self, done: Finished) -> list[dict]:
        if self._ended is None:
            self._ended = self._apply(self.parser.feed(done.tail) + self.parser.finish())
        return self._ended

    def end_chunks(self, done: Finished) -> list[dict]:
        return self._end(done) + [self.final_chunk(done, {"delta": {}})]

    def finish_reason(self, done: Finished) -> str:
        return "tool_calls" if self.calls and done.finish_reason != "length" else done.finish_reason

    def choice(self, done: Finished) -> dict:
        self._end(done)
        message = {"role": "assistant", "content": self.content if self.content or not self.calls else None}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = self.calls
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish_reason(done)}


class CompletionShape(Shape):
    object = "text_completion"
    chunk_object = "text_completion"
    prefix = "cmpl-"

    def __init__(self, model: str, prompt_ids, include_usage: bool = False):
        super().__init__(model, prompt_ids, include_usage)
        self.text = ""

    def _chunk(self, text: str) -> dict:
        return self.envelope(self.object, [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}])

    def feed(self, text: str) -> list[dict]:
        self.text += text
        return [self._chunk(text)] if text else []

    def end_chunks(self, done: Finished) -> list[dict]:
        return self.feed(done.tail) + [self.final_chunk(done, {"text": ""})]

    def choice(self, done: Finished) -> dict:
        self.text += done.tail
        return {"index": 0, "text": self.text, "logprobs": None, "finish_reason": self.finish_reason(done)}
