"""Response bodies and stream chunks in OpenAI's formats, with llama.cpp-style timings.

A `Shape` turns the engine's text pieces into one endpoint's choice objects: chat
(content deltas, then tool calls parsed at the end of the turn) or text completion.
The same shape builds both the streamed chunks and the whole response, so the two
cannot disagree.
"""
from __future__ import annotations

import json
import time
import uuid

from ostinato.engine.session import GenerationStats
from ostinato.server.textstream import ChatDeltas
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

    def __init__(self, model: str, prompt_ids: list[int] | None):
        self.id = self.prefix + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model
        self.prompt_ids = prompt_ids  # reported when the request asked for ids

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
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prefix = "chatcmpl-"

    def __init__(self, model: str, prompt_ids, tokenizer, parse_tools: bool):
        super().__init__(model, prompt_ids)
        self.deltas = ChatDeltas(tokenizer, parse_tools)
        self._end: tuple[str, str, list[dict]] | None = None

    def _chunk(self, delta: dict) -> dict:
        return self.envelope(self.chunk_object, [{"index": 0, "delta": delta, "logprobs": None,
                                                         "finish_reason": None}])

    def first_chunks(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def text_chunks(self, text: str) -> list[dict]:
        piece = self.deltas.feed(text)
        return [self._chunk({"content": piece})] if piece else []

    def end(self) -> tuple[str, str, list[dict]]:
        if self._end is None:
            self._end = self.deltas.finish()
        return self._end

    def end_chunks(self, done: Finished) -> list[dict]:
        out = self.text_chunks(done.tail)
        rest, _, calls = self.end()
        if rest:
            out.append(self._chunk({"content": rest}))
        if calls:
            out.append(self._chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}))
        return out + [self.final_chunk(done, {"delta": {}})]

    def finish_reason(self, done: Finished) -> str:
        return "tool_calls" if self.end()[2] and done.finish_reason != "length" else done.finish_reason

    def choice(self, done: Finished) -> dict:
        self.deltas.feed(done.tail)
        _, content, calls = self.end()
        message = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish_reason(done)}


class CompletionShape(Shape):
    object = "text_completion"
    chunk_object = "text_completion"
    prefix = "cmpl-"

    def __init__(self, model: str, prompt_ids):
        super().__init__(model, prompt_ids)
        self.text = ""

    def _chunk(self, text: str) -> dict:
        return self.envelope(self.object, [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}])

    def first_chunks(self) -> list[dict]:
        return []

    def text_chunks(self, text: str) -> list[dict]:
        self.text += text
        return [self._chunk(text)] if text else []

    def end_chunks(self, done: Finished) -> list[dict]:
        return self.text_chunks(done.tail) + [self.final_chunk(done, {"text": ""})]

    def choice(self, done: Finished) -> dict:
        self.text += done.tail
        return {"index": 0, "text": self.text, "logprobs": None, "finish_reason": self.finish_reason(done)}
