"""Model argument + settings -> a ready engine and its tokenizer: the one place that wires
source, runner, placement and session slot together (generate, serve, replay, bench)."""
from __future__ import annotations

from dataclasses import dataclass

from ostinato.engine.runner import ModelRunner, RunnerSettings
from ostinato.engine.session import Engine
from ostinato.loader.source import open_source
from ostinato.loader.tokenizer import ChatTokenizer


@dataclass
class Loaded:
    engine: Engine
    tokenizer: ChatTokenizer
    source: object
    model_name: str

    @property
    def runner(self) -> ModelRunner:
        return self.engine.runner


def load_engine(model: str, settings: RunnerSettings = RunnerSettings(), experts_factory=None) -> Loaded:
    """experts_factory(source, runner_settings) -> experts backend (default: all on one device)."""
    source = open_source(model)
    tok = ChatTokenizer.from_dir(source.tokenizer_dir)
    experts = experts_factory(source, settings) if experts_factory else None
    runner = ModelRunner(source, settings, experts=experts)
    return Loaded(Engine(runner, set(tok.eos_ids)), tok, source, str(model))
