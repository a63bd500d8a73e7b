"""HTTP routes: chat and text completions (OpenAI's API), messages (Anthropic's), models,
tokenize / detokenize (vLLM's), health, metrics.

The app owns the engine worker's life: the engine thread starts (and begins loading
the model) with the server and stops with it. With an API key, the /v1 routes and
/tokenize, /detokenize need it (as `Authorization: Bearer KEY` or Anthropic's
`x-api-key`); /health and /metrics never do, so probes and scrapers need no secret.
The model answers to each of its served names; the first is the one responses report
and /v1/models lists.
"""
from __future__ import annotations

import hmac
from collections.abc import Sequence
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ostinato.server.errors import APIError, install_handlers
from ostinato.server.handlers import DEFAULT_MAX_BODY, Generations
from ostinato.server.metrics import Metrics
from ostinato.server.worker import EngineWorker


def _api_key_check(key: str, metrics: Metrics):
    async def check(request: Request) -> None:
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not given or not hmac.compare_digest(given.encode(), key.encode()):
            metrics.request(request.url.path, 401)
            what = "invalid API key" if given else "missing API key"
            raise APIError(401, f"{what}: send the server's key as 'Authorization: Bearer KEY' "
                                "(or an 'X-API-Key' header)", code="invalid_api_key")
    return check


def create_app(worker: EngineWorker, names: str | Sequence[str], api_key: str | None = None,
               tool_call_parser: str | None = None, max_body_size: int = DEFAULT_MAX_BODY) -> FastAPI:
    """`tool_call_parser`: a key of ostinato.server.parsing.FORMATS; None: chosen from the chat template.
    `max_body_size`: the largest request body read, in bytes (a larger one: 413)."""
    names = [names] if isinstance(names, str) else list(names)
    model_name = names[0]
    metrics = Metrics(worker)
    worker.on_finished = metrics.on_finished
    generations = Generations(worker, metrics, names, tool_call_parser, max_body_size)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="Ostinato", lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics
    install_handlers(app)
    guard = [Depends(_api_key_check(api_key, metrics))] if api_key else []
    app.add_api_route("/v1/chat/completions", generations.chat, methods=["POST"], dependencies=guard)
    app.add_api_route("/v1/completions", generations.completion, methods=["POST"], dependencies=guard)
    app.add_api_route("/v1/messages", generations.messages, methods=["POST"], dependencies=guard)
    app.add_api_route("/v1/messages/count_tokens", generations.count_tokens, methods=["POST"], dependencies=guard)
    app.add_api_route("/tokenize", generations.tokenize, methods=["POST"], dependencies=guard)
    app.add_api_route("/detokenize", generations.detokenize, methods=["POST"], dependencies=guard)

    @app.get("/v1/models", dependencies=guard)
    async def models():
        card = {"id": model_name, "object": "model", "created": int(worker.started_at_wall), "owned_by": "ostinato"}
        if worker.loaded is not None:
            card["max_model_len"] = worker.loaded.engine.max_context
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if worker.state == "ok":
            return {"status": "ok"}
        if worker.state == "loading":
            return JSONResponse({"status": "loading", **worker.progress()}, status_code=503)
        return JSONResponse({"status": "error", "error": worker.error}, status_code=500)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
