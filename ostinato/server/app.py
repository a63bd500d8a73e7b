"""Wiring: model argument and settings -> the FastAPI app with its engine thread.

Shared by `ostinato serve` and the tests, which run the same app under uvicorn in a
thread. Nothing is loaded here: the engine thread loads the model once the server
starts, so /health answers from the first moment. The experts placement (a residency:
hybrid CPU-GPU) goes to `load_engine` as it is, like `ostinato generate` does.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from fastapi import FastAPI

from ostinato.engine.factory import load_engine, startup_summary, summary_text
from ostinato.engine.placement import PlacementSettings
from ostinato.engine.runner import RunnerSettings
from ostinato.server.handlers import DEFAULT_MAX_BODY
from ostinato.server.routes import create_app
from ostinato.server.worker import EngineWorker


DEFAULT_CONVERSATIONS = 4
log = logging.getLogger("ostinato.server")


def served_name(model: str) -> str:
    """What responses report as `model`: a directory's name, or the synth spec."""
    return model if model.startswith("synth:") else Path(model).name or model


def served_names(model: str, names: str | Sequence[str] | None) -> list[str]:
    """The names a request's `model` may give: the ones asked for (the first is reported),
    or else the model's own name and the argument as it was given."""
    if names:
        return [names] if isinstance(names, str) else list(names)
    return list(dict.fromkeys([served_name(str(model)), str(model)]))


def build_app(model: str, settings: RunnerSettings = RunnerSettings(), placement: PlacementSettings | None = None,
              api_key: str | None = None, name: str | Sequence[str] | None = None, warmup: bool = True,
              tool_call_parser: str | None = None, max_body_size: int = DEFAULT_MAX_BODY,
              conversations: int = DEFAULT_CONVERSATIONS, url: str | None = None) -> FastAPI:
    """`conversations`: how many conversations besides the active one keep their KV cache
    in host memory, so that an agent's side requests do not cost its session a prefill.
    `url`: where the server listens, for the start-up summary logged once the model is ready."""
    def load(progress):
        progress("loading weights")
        loaded = load_engine(model, settings, placement, announce=False)
        loaded.engine.keep_conversations(conversations)
        return loaded

    worker = EngineWorker(load, warmup=warmup)
    worker.on_ready = lambda loaded: log.info(summary_text(startup_summary(loaded, url)))
    return create_app(worker, served_names(model, name), api_key, tool_call_parser, max_body_size)
