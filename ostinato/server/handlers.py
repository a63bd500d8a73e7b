"""Generation requests, end to end: validate, tokenize, queue, shape the answer.

A request is validated and tokenized on the request side (a thread of the pool, so
the event loop keeps streaming other bytes), handed to the engine thread as one job
through a `Run`, and its events are shaped into a whole response or an SSE stream. A
stream is opened only once the first event is back, so a request that fails before
its first token gets a real status code (400, 500) rather than an error inside a 200
stream; after that, a failure is sent as a last `data: {"error": ...}` event before
`[DONE]`. Every request is counted in the metrics with its status (499: client gone).
"""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ostinato.server.bridge import Run
from ostinato.server.errors import APIError
from ostinato.server.metrics import Metrics
from ostinato.server.prompts import prepare_chat, prepare_completion
from ostinato.server.protocol import ChatRequest, CompletionRequest, parse_body
from ostinato.server.responses import ChatShape, CompletionShape, sse
from ostinato.server.worker import EngineWorker, Failed, Job, Token


def engine_error(e: Exception) -> APIError:
    if isinstance(e, ValueError):  # ContextLengthError, an empty prompt: the request's fault
        return APIError(400, str(e), code="invalid_request")
    return APIError(500, f"the engine failed on this request ({type(e).__name__}: {e}); "
                         "the server is still serving", code="engine_error")


class Generations:
    def __init__(self, worker: EngineWorker, metrics: Metrics, model_name: str):
        self.worker, self.metrics, self.model_name = worker, metrics, model_name

    def ready(self, endpoint: str):
        w = self.worker
        if w.state == "ok":
            return w.loaded
        self.metrics.request(endpoint, 503 if w.state == "loading" else 500)
        if w.state == "loading":
            raise APIError(503, f"the model is still loading ({w.phase}): poll GET /health until it answers 200",
                           code="model_loading")
        raise APIError(500, f"the model failed to load: {w.error}", code="model_load_failed")

    async def chat(self, request: Request):
        def shape(req, prep, loaded):
            ids = prep.prompt if req.ostinato_return_ids else None
            return ChatShape(self.model_name, ids, loaded.tokenizer, prep.parse_tools)
        return await self._generate(request, "/v1/chat/completions", ChatRequest, prepare_chat, shape)

    async def completion(self, request: Request):
        def shape(req, prep, loaded):
            return CompletionShape(self.model_name, prep.prompt if req.ostinato_return_ids else None)
        return await self._generate(request, "/v1/completions", CompletionRequest, prepare_completion, shape)

    def _fail(self, endpoint: str, error: APIError) -> APIError:
        self.metrics.request(endpoint, error.status)
        return error

    async def _generate(self, request: Request, endpoint: str, body_type, prepare, make_shape):
        arrived = time.perf_counter()
        loaded = self.ready(endpoint)
        try:
            req = parse_body(body_type, await request.body())
            prep = await run_in_threadpool(prepare, req, loaded)
        except APIError as e:
            raise self._fail(endpoint, e) from None
        shape = make_shape(req, prep, loaded)
        run = Run(self.worker, Job(prep.prompt, prep.params, prep.forced, prep.stop), request)
        try:
            first = await run.next()
        except BaseException:
            run.close()
            raise
        if isinstance(first, Failed):
            run.close()
            raise self._fail(endpoint, engine_error(first.error))
        if isinstance(first, Token):
            self.metrics.ttft.observe(time.perf_counter() - arrived)
        if req.stream:
            return StreamingResponse(self._stream(run, shape, first, req.include_usage, endpoint),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._whole(run, shape, first, endpoint)

    async def _whole(self, run: Run, shape, event, endpoint: str) -> JSONResponse:
        try:
            while isinstance(event, Token):
                shape.text_chunks(event.text)
                event = await run.next()
        finally:
            run.close()
        if isinstance(event, Failed):
            raise self._fail(endpoint, engine_error(event.error))
        self.metrics.request(endpoint, 499 if event.finish_reason == "cancelled" else 200)
        return JSONResponse(shape.response(event))

    async def _stream(self, run: Run, shape, event, include_usage: bool, endpoint: str):
        status = 499  # unless the stream reaches its end: the client went away
        try:
            for chunk in shape.first_chunks():
                yield sse(chunk)
            while isinstance(event, Token):
                for chunk in shape.text_chunks(event.text):
                    yield sse(chunk)
                event = await run.next()
            if isinstance(event, Failed):
                error = engine_error(event.error)
                yield sse(error.body())
                yield sse("[DONE]")
                status = error.status
            elif event.finish_reason != "cancelled":
                for chunk in shape.end_chunks(event):
                    yield sse(chunk)
                if include_usage:
                    yield sse(shape.usage_chunk(event))
                yield sse("[DONE]")
                status = 200
        finally:
            run.close()
            self.metrics.request(endpoint, status)
