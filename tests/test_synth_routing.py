"""The synthetic model routes like agent sessions do: skewed and stable across sessions."""
from __future__ import annotations

from ostinato.sessions.read import load_sessions, split_sessions
from ostinato.engine.runner import RunnerSettings
from ostinato.load import load_engine
from ostinato.planner.run_profile import profile_sessions
from ostinato.planner.skew import hot_share


def test_tiny_default_skew_gives_the_agent_figure(tiny_dir):
    """The preset's default: the ~42% of experts most routed in development sessions get
    80-85% of held-out routes (held here with a margin for the few generated sessions)."""
    loaded = load_engine(str(tiny_dir), RunnerSettings(device="cpu", dtype="fp32", max_context=8192))
    dev, held = split_sessions(load_sessions("embedded:8"))
    share, per_layer = hot_share(profile_sessions(loaded, dev, progress=False).total("all"),
                                 profile_sessions(loaded, held, progress=False).total("all"), 0.42)
    assert 0.78 <= share <= 0.88, share
    assert max(per_layer.values()) - min(per_layer.values()) > 0.01  # the skew varies by layer


def test_zero_skew_is_not_skewed(tmp_path):
    """Without the router bias the same figure falls well below: the skew is the weights' doing."""
    from ostinato.synth.build import write_checkpoint

    flat = write_checkpoint("tiny", tmp_path / "flat", skew=0.0)
    loaded = load_engine(str(flat), RunnerSettings(device="cpu", dtype="fp32", max_context=8192))
    dev, held = split_sessions(load_sessions("embedded:8"))
    share, _ = hot_share(profile_sessions(loaded, dev, progress=False).total("all"),
                         profile_sessions(loaded, held, progress=False).total("all"), 0.42)
    assert share < 0.75, share
