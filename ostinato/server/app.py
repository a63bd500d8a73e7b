"""Wiring: model argument and settings -> the FastAPI app with its engine thread.

Shared by `ostinato serve` and the tests, which run the same app under uvicorn in a
thread. Nothing is loaded here: the engine thread loads the model once the server
starts, so /health answers from the first moment. The experts placement (a residency:
hybrid CPU-GPU) goes to `load_engine` as it is, like `ostinato generate` does; a GPU memory
cap without one is planned for at start-up, or read from the plan cache (jobs/serve_plan.py).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

from fastapi import FastAPI

from ostinato.engine.placement import PlacementSettings
from ostinato.engine.runner import RunnerSettings
from ostinato.load import load_engine, startup_summary, summary_text
from ostinato.jobs.serve_plan import AutoPlan, load_planned
from ostinato.planner.served import ServedRoutes, served_path
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
              conversations: int = DEFAULT_CONVERSATIONS, conversation_bytes: int | None = None,
              url: str | None = None,
              auto_plan: AutoPlan | None = AutoPlan(), learn: bool = True) -> FastAPI:
    """`conversations`: how many conversations besides the active one keep their KV cache
    in host memory, so that an agent's side requests do not cost its session a prefill (one KV
    cache's worth of it is taken at load); `conversation_bytes`: the most host memory those copies
    take together (None: no cap).
    `url`: where the server listens, for the start-up summary logged once the model is ready.
    `auto_plan`: with a cap and no residency, the plan comes from the cache or is made at start-up
    (jobs/serve_plan.py); None: every expert on the GPU, refused when they do not fit the cap.
    `learn`: count the routes served and keep them beside the plan (planner/served.py)."""
    plans = placement is not None and (placement.residency or (placement.gpu_memory and auto_plan is not None))
    settings = dataclasses.replace(settings, count_routes=bool(learn and plans))

    def load(progress):
        if placement is not None and not placement.residency and placement.gpu_memory and auto_plan is not None:
            loaded = load_planned(model, settings, placement, auto_plan, progress)
        else:
            progress("loading weights")
            loaded = load_engine(model, settings, placement, announce=False)
        loaded.engine.keep_conversations(conversations, conversation_bytes)
        return loaded

    worker = EngineWorker(load, warmup=warmup)

    def ready(loaded) -> None:  # on the engine thread, after the warm-up
        routes = loaded.runner.routes
        if routes is not None and loaded.placement is not None and loaded.placement.residency:
            routes.reset()  # the warm-up's and the calibration's passes were not served
            served = ServedRoutes(served_path(loaded.placement.residency))
            worker.after_job = lambda: served.flush(routes)
            worker.on_stop = lambda: served.flush(routes, force=True)
        log.info(summary_text(startup_summary(loaded, url)))

    worker.on_ready = ready
    return create_app(worker, served_names(model, name), api_key, tool_call_parser, max_body_size)
