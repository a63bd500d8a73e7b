"""A model argument -> its weight source: `synth:PRESET[?seed=S&layers=N&skew=X&regime=R]` a
synthetic model (synth/source.py), a .gguf file or a directory holding one and no config.json
(loader/gguf.py), else a Hugging Face checkpoint directory (loader/source.py). Above the loader
and synth, which know nothing of each other's model arguments."""
from __future__ import annotations

from pathlib import Path

from ostinato.config import ConfigError
from ostinato.loader.gguf import GGUFSource, find_gguf
from ostinato.loader.source import CheckpointSource
from ostinato.synth.build import synth_source
from ostinato.synth.presets import regime
from ostinato.synth.source import parse_synth


def open_source(model: str | Path):
    """A model argument -> a weight source."""
    text = str(model)
    if text.startswith("synth:"):
        preset, opts = parse_synth(text)
        knobs = {k: opts.pop(k) for k in ("persistence", "content") if k in opts}
        try:
            routing = regime(opts.pop("regime", "flat"), preset, **knobs)
        except ValueError as e:
            raise ConfigError(f"{text}: {e}") from None
        return synth_source(preset, **opts, regime=routing)
    path = Path(text)
    if not (path / "config.json").is_file():  # a checkpoint directory wins over a .gguf beside it
        gguf_file = find_gguf(path)
        if gguf_file is not None:
            return GGUFSource(gguf_file)
    return CheckpointSource(text)
