"""Model argument + settings -> a ready engine and its tokenizer: the one place that wires
source, runner, placement and session slot together (generate, serve, replay, bench)."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from ostinato.engine.placement import PlacementSettings, hybrid_factory
from ostinato.engine.runner import ModelRunner, RunnerSettings
from ostinato.engine.session import Engine
from ostinato.engine.threads import claim_host_thread
from ostinato.loader.source import open_source
from ostinato.loader.tokenizer import ChatTokenizer
from ostinato.planner.residency import Residency

log = logging.getLogger("ostinato")


@dataclass
class Loaded:
    engine: Engine
    tokenizer: ChatTokenizer
    source: object
    model_name: str

    @property
    def runner(self) -> ModelRunner:
        return self.engine.runner


def load_engine(model: str, settings: RunnerSettings = RunnerSettings(), placement: PlacementSettings | None = None,
                experts_factory=None) -> Loaded:
    """The placement comes from `placement` (a residency: hybrid CPU-GPU) or an explicit
    experts_factory(source, runner_settings); with neither, every expert on one device."""
    if experts_factory is None and placement is not None and placement.residency:
        residency = Residency.load(placement.residency)  # read once, here
        experts_factory = hybrid_factory(placement, residency)
        kv_tokens = residency.capacity.get("kv_tokens")
        if kv_tokens and settings.max_context is None:
            # the plan sized the pool next to a KV cache of this many tokens: a larger cache
            # could push the engine past the memory cap
            settings = dataclasses.replace(settings, max_context=int(kv_tokens))
    source = open_source(model)
    tok = ChatTokenizer.from_dir(source.tokenizer_dir)
    if settings.torch_device().type == "cuda":  # the host thread on its core before the experts load
        claim_host_thread(settings.thread_layout())  # (its page-locked copies land on that core's node)
    experts = experts_factory(source, settings) if experts_factory else None
    runner = ModelRunner(source, settings, experts=experts)
    log.info(runner.threads.describe())
    return Loaded(Engine(runner, set(tok.eos_ids)), tok, source, str(model))
