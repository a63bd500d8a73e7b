"""Wiring: model argument and settings -> the FastAPI app with its engine thread.

Shared by `ostinato serve` and the tests, which run the same app under uvicorn in a
thread. Nothing is loaded here: the engine thread loads the model once the server
starts, so /health answers from the first moment. The experts placement (a residency:
hybrid CPU-GPU) goes to `load_engine` as it is, like `ostinato generate` does.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fastapi import FastAPI

from ostinato.engine.placement import PlacementSettings
from ostinato.engine.runner import RunnerSettings
from ostinato.server.routes import create_app
from ostinato.server.worker import EngineWorker


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
              tool_call_parser: str | None = None) -> FastAPI:
    def load(progress):
        from ostinato.engine.factory import load_engine

        progress("loading weights")
        return load_engine(model, settings, placement)

    return create_app(EngineWorker(load, warmup=warmup), served_names(model, name), api_key, tool_call_parser)
