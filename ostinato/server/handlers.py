"""Generation requests, end to end: read, validate, tokenize, queue, shape the answer.

One generation path serves both APIs. The body is read chunk by chunk up to a limit
(a larger one is a 413 before it is all in memory); parsing, validation, the chat
template and tokenization run on a thread of the pool, so the event loop keeps answering
/health and streaming other requests' bytes; the prompt is checked against the context
there, before the job takes a place in the engine queue. The request is
then handed to the engine thread as one job through a `Run`, and its events are shaped into
a whole response or an SSE stream by the endpoint's `Shape` (OpenAI chat or text
completion, Anthropic message). A stream is opened only once the first event is back,
so a request that fails before its first token gets a real status code (400, 500)
rather than an error inside a 200 stream; after that, a failure is the stream's last
event. Every request is counted in the metrics with its status (499: client gone).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ostinato.engine.sampling import SamplingDefaults
from ostinato.server.bridge import Run
from ostinato.server.errors import APIError
from ostinato.server.messages_protocol import CountTokensRequest, MessagesRequest
from ostinato.server.messages_responses import MessageShape
from ostinato.server.metrics import Metrics
from ostinato.server.parsing import FORMATS, Family
from ostinato.server.prompts import (Prepared, prepare_chat, prepare_completion, prepare_messages, render,
                                     render_conversation)
from ostinato.server.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse_body
from ostinato.server.responses import ChatShape, CompletionShape
from ostinato.server.steering import Steering
from ostinato.server.worker import EngineWorker, Failed, Job, Token


DEFAULT_MAX_BODY = 16 * 2**20


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to exceed `limit` bytes (from its declared
    length, or while it arrives): an oversized body is never held whole."""
    def too_large(size: str) -> APIError:
        return APIError(413, f"the request body is {size} bytes, over this server's limit of {limit} bytes "
                             f"({limit / 2**20:g} MiB): send a smaller request, or start the server with a larger "
                             "--max-body-size", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def engine_error(e: Exception) -> APIError:
    if isinstance(e, ValueError):  # ContextLengthError, an empty prompt: the request's fault
        return APIError(400, str(e), code="invalid_request")
    return APIError(500, f"the engine failed on this request ({type(e).__name__}: {e}); "
                         "the server is still serving", code="engine_error")


@dataclass(frozen=True)
class Endpoint:
    path: str
    body: type
    prepare: Callable  # (request, loaded, SamplingDefaults) -> Prepared
    shape: Callable  # (request, Prepared, loaded) -> a Shape


class Generations:
    def __init__(self, worker: EngineWorker, metrics: Metrics, names: list[str], tool_call_parser: str | None = None,
                 max_body_size: int = DEFAULT_MAX_BODY):
        self.worker, self.metrics, self.names = worker, metrics, names
        self.max_body_size = max_body_size
        self.model_name = names[0]  # what responses report
        self.tool_call_parser = tool_call_parser
        self._family: Family | None = None
        self._defaults: SamplingDefaults | None = None

    def family(self, loaded) -> Family:
        if self._family is None:
            self._family = Family.of(loaded.tokenizer, self.tool_call_parser)
        return self._family

    def defaults(self, loaded) -> SamplingDefaults:
        """The model's sampling defaults (its generation_config.json), read once."""
        if self._defaults is None:
            self._defaults = SamplingDefaults.of(loaded.source)
        return self._defaults

    def ready(self, endpoint: str):
        w = self.worker
        if w.state == "ok":
            return w.loaded
        self.metrics.request(endpoint, 503 if w.state == "loading" else 500)
        if w.state == "loading":
            raise APIError(503, f"the model is still loading ({w.phase}): poll GET /health until it answers 200",
                           code="model_loading")
        raise APIError(500, f"the model failed to load: {w.error}", code="model_load_failed")

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(404, f"the model {name!r} does not exist here: this server serves "
                                f"{', '.join(map(repr, self.names))}", param="model", code="model_not_found")

    def _parser(self, prep: Prepared, loaded):
        return self.family(loaded).parser(prep.tools, prep.in_reasoning)

    def _steering(self, prep: Prepared, loaded) -> Steering | None:
        if prep.forced is not None or not prep.asked.anything:
            return None  # a forced output is emitted as it is
        family = self.family(loaded)
        if prep.asked.call and FORMATS[family.tool_format] is None:
            raise APIError(400, "tool_choice requires a tool call, but this model's chat template shows no tool-call "
                                "format to write it in: start the server with --tool-call-parser "
                                f"({', '.join(k for k, v in FORMATS.items() if v)})", param="tool_choice")
        return Steering(prep.asked, family, loaded.tokenizer.encode, prep.in_reasoning)

    async def chat(self, request: Request):
        def shape(req, prep, loaded):
            ids = prep.prompt if req.ostinato_return_ids else None
            return ChatShape(self.model_name, ids, self._parser(prep, loaded), req.include_usage)
        return await self._generate(request, Endpoint("/v1/chat/completions", ChatRequest, prepare_chat, shape))

    async def completion(self, request: Request):
        def shape(req, prep, loaded):
            return CompletionShape(self.model_name, prep.prompt if req.ostinato_return_ids else None,
                                   req.include_usage)
        return await self._generate(request, Endpoint("/v1/completions", CompletionRequest, prepare_completion,
                                                      shape))

    async def messages(self, request: Request):
        def shape(req, prep, loaded):
            return MessageShape(self.model_name, len(prep.prompt), self._parser(prep, loaded))
        return await self._generate(request, Endpoint("/v1/messages", MessagesRequest, prepare_messages, shape))

    async def count_tokens(self, request: Request):
        def count(req, loaded):
            return {"input_tokens": len(render_conversation(req, loaded).ids)}
        return await self._utility(request, "/v1/messages/count_tokens", CountTokensRequest, count)

    async def tokenize(self, request: Request):
        def tokenize(req, loaded):
            if req.prompt is not None:
                ids = loaded.tokenizer.encode(req.prompt)
            else:
                tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
                ids = render(loaded.tokenizer, [m.for_template() for m in req.messages], tools,
                             req.chat_template_kwargs, req.add_generation_prompt).ids
            return {"count": len(ids), "max_model_len": loaded.engine.max_context, "tokens": ids}
        return await self._utility(request, "/tokenize", TokenizeRequest, tokenize)

    async def detokenize(self, request: Request):
        def detokenize(req, loaded):
            vocab = loaded.tokenizer.vocab_size
            bad = next((i for i in req.tokens if not 0 <= i < vocab), None)
            if bad is not None:
                raise APIError(400, f"tokens: token id {bad} is outside the vocabulary (0..{vocab - 1})",
                               param="tokens")
            return {"prompt": loaded.tokenizer.decode(req.tokens)}
        return await self._utility(request, "/detokenize", DetokenizeRequest, detokenize)

    def _fail(self, endpoint: str, error: APIError) -> APIError:
        self.metrics.request(endpoint, error.status)
        return error

    async def _utility(self, request: Request, endpoint: str, body_type, answer) -> JSONResponse:
        loaded = self.ready(endpoint)
        try:
            req = await run_in_threadpool(parse_body, body_type, await read_body(request, self.max_body_size))
            self.check_model(req.model)
            out = await run_in_threadpool(answer, req, loaded)
        except APIError as e:
            raise self._fail(endpoint, e) from None
        self.metrics.request(endpoint, 200)
        return JSONResponse(out)

    async def _generate(self, request: Request, endpoint: Endpoint):
        arrived = time.perf_counter()
        path = endpoint.path
        loaded = self.ready(path)
        try:
            req = await run_in_threadpool(parse_body, endpoint.body, await read_body(request, self.max_body_size))
            self.check_model(req.model)
            prep = await run_in_threadpool(endpoint.prepare, req, loaded, self.defaults(loaded))
            steering = self._steering(prep, loaded)
        except APIError as e:
            raise self._fail(path, e) from None
        shape = endpoint.shape(req, prep, loaded)
        run = Run(self.worker, Job(prep.prompt, prep.params, prep.forced, prep.stop, steering), request)
        try:
            first = await run.next()
        except BaseException:
            run.close()
            raise
        if isinstance(first, Failed):
            run.close()
            raise self._fail(path, engine_error(first.error))
        if isinstance(first, Token):
            self.metrics.ttft.observe(time.perf_counter() - arrived)
        if req.stream:
            return StreamingResponse(self._stream(run, shape, first, path), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._whole(run, shape, first, path)

    async def _whole(self, run: Run, shape, event, endpoint: str) -> JSONResponse:
        try:
            while isinstance(event, Token):
                shape.feed(event.text)
                event = await run.next()
        finally:
            run.close()
        if isinstance(event, Failed):
            raise self._fail(endpoint, engine_error(event.error))
        self.metrics.request(endpoint, 499 if event.finish_reason == "cancelled" else 200)
        return JSONResponse(shape.response(event))

    async def _stream(self, run: Run, shape, event, endpoint: str):
        status = 499  # unless the stream reaches its end: the client went away
        try:
            for piece in shape.stream_start():
                yield piece
            while isinstance(event, Token):
                for piece in shape.stream_text(event.text):
                    yield piece
                event = await run.next()
            if isinstance(event, Failed):
                error = engine_error(event.error)
                for piece in shape.stream_error(error):
                    yield piece
                status = error.status
            elif event.finish_reason != "cancelled":
                for piece in shape.stream_end(event):
                    yield piece
                status = 200
        finally:
            run.close()
            self.metrics.request(endpoint, status)
