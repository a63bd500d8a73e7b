"""Routing regimes of the synthetic model: each knob moves its statistic, `flat` is unchanged,
and transformers still computes what we compute on a model with every knob set."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from ostinato.sessions.read import load_sessions, split_sessions
from ostinato.engine.runner import ModelRunner, RunnerSettings
from ostinato.load import load_engine
from ostinato.loader.source import CheckpointSource
from ostinato.planner.skew import content_report, hot_share, persistence_report, top_experts, trace_sessions
from ostinato.synth.build import write_checkpoint
from ostinato.synth.presets import Regime, regime
from ostinato.synth.weights import TOKEN_CLASSES, SynthSpec, token_class

# sha256[:16] of the bf16 bits of tiny's tensors (seed 0, active_vocab 4100), computed with the
# generator as it was before regimes existed (git show e805d12:ostinato/synth/weights.py)
FLAT_HASHES = {
    "model.embed_tokens.weight": "b1a83b3e563ddef4",
    "model.layers.0.self_attn.q_proj.weight": "c9a0b939eb3ee51e",
    "model.layers.0.self_attn.o_proj.weight": "328a44d34602afab",
    "model.layers.0.self_attn.q_norm.weight": "26ab507cf4bbb401",
    "model.layers.1.mlp.gate.weight": "2b16feafe592bedd",
    "model.layers.3.mlp.experts.5.down_proj.weight": "5c4867ec9e5161f9",
    "lm_head.weight": "b114b337b4778a46",
}


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.view(torch.int16).numpy().tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("spec", [SynthSpec("tiny", active_vocab=4100),
                                  SynthSpec("tiny", active_vocab=4100, regime=regime("flat"))], ids=["none", "flat"])
def test_flat_weights_are_unchanged(spec):
    assert spec.regime.is_flat and spec.reserved == 1
    assert {n: _hash(spec.tensor(n)) for n in FLAT_HASHES} == FLAT_HASHES


def test_regime_knobs_and_errors():
    assert regime("layered", persistence=0.5) == Regime(depth="hump", low=0.3, high=1.7, persistence=0.5,
                                                         skew_factor=regime("layered").skew_factor)
    with pytest.raises(ValueError, match="unknown routing regime"):
        regime("bogus")
    with pytest.raises(ValueError, match="depth profile"):
        Regime(depth="zigzag")
    spec = SynthSpec("tiny", regime=regime("content"))
    with pytest.raises(ValueError, match="needs the tokenizer"):
        spec.tensor("model.embed_tokens.weight")


def test_token_classes():
    got = [TOKEN_CLASSES[token_class(t)] for t in (" the", "\n\n", '":', "7", "_id", "Name", " x1")]
    assert got == ["word", "space", "punct", "digit", "ident", "ident", "ident"]


def test_hump_profile_is_weak_at_the_ends():
    s = SynthSpec("qwen3-30b-a3b", regime=regime("layered"))
    skews = [s.layer_skew(l) for l in range(48)]
    ends, middle = skews[:4] + skews[-4:], skews[20:28]
    assert max(ends) < 0.5 * min(middle)


@pytest.fixture(scope="module")
def stats(tiny_dir, tmp_path_factory):
    """Per regime: (global share at 44%, per-layer shares, persistence report, content report)."""
    dev, held = split_sessions(load_sessions("embedded:8"))
    out = {}
    for name in ("flat", "layered", "layered-persistent", "content"):
        d = tiny_dir if name == "flat" else write_checkpoint("tiny", tmp_path_factory.mktemp(name), regime=regime(name))
        loaded = load_engine(str(d), RunnerSettings(device="cpu", dtype="fp32", max_context=8192))
        cd, _ = trace_sessions(loaded, dev, progress=False)
        ch, sh = trace_sessions(loaded, held, progress=False)
        share, per_layer = hot_share(cd.total("all"), ch.total("all"), 0.44)
        out[name] = (share, per_layer, persistence_report(sh, 4), content_report(sh, top_experts(cd.total("all"), 0.44)))
    return out


@pytest.mark.parametrize("name", ["flat", "layered", "layered-persistent", "content"])
def test_every_regime_keeps_the_agent_figure(stats, name):
    share = stats[name][0]
    assert 0.78 <= share <= 0.88, share


def test_layered_spreads_the_layers(stats):
    spread = {n: max(s[1].values()) - min(s[1].values()) for n, s in stats.items()}
    assert spread["layered"] > spread["flat"] + 0.03, spread
    per_layer = stats["layered"][1]
    assert (per_layer[0] + per_layer[3]) / 2 < (per_layer[1] + per_layer[2]) / 2 - 0.05, per_layer


def test_persistent_tokens_share_experts(stats):
    assert abs(stats["flat"][2]["excess"]) < 0.02, stats["flat"][2]  # memoryless
    assert abs(stats["layered"][2]["excess"]) < 0.02, stats["layered"][2]
    p = stats["layered-persistent"][2]
    assert p["overlap"] > p["independent"] + 0.06, p


def test_content_routing_follows_the_token_class(stats):
    flat, content = stats["flat"][3]["class_divergence"], stats["content"][3]["class_divergence"]
    assert content > 2 * flat, (flat, content)


def test_transformers_matches_a_model_with_every_knob(tmp_path):
    transformers = pytest.importorskip("transformers")
    knobs = regime("layered-persistent", content=1.0)
    d = write_checkpoint("tiny", tmp_path / "all", layers=2, regime=knobs)
    meta = json.loads((d / "model.safetensors.index.json").read_text())["metadata"]["ostinato_synth"]
    assert meta["regime"]["persistence"] == knobs.persistence and meta["regime"]["content"] == 1.0
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours = ModelRunner(CheckpointSource(d), RunnerSettings(device="cpu", dtype="fp32", max_context=256,
                                                           prefill_chunk=24))
    ids = torch.randint(0, 4000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = ours.forward(ids, 0, all_logits=True)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-3


def test_synth_command_takes_the_knobs(tmp_path):
    from ostinato.cli import build_parser

    a = build_parser().parse_args(["synth", "--preset", "tiny", "--layers", "1", "--out", str(tmp_path),
                                   "--regime", "layered", "--persistence", "0.5", "--depth-range", "0.2", "1.0"])
    assert a.func(a) == 0
    meta = json.loads((tmp_path / "model.safetensors.index.json").read_text())["metadata"]["ostinato_synth"]
    assert meta["regime"] | {"skew_factor": None} == {"depth": "hump", "low": 0.2, "high": 1.0, "persistence": 0.5,
                                                      "content": 0.0, "skew_factor": None}


def test_synth_uri_takes_the_regime_and_its_knobs():
    from ostinato.config import ConfigError
    from ostinato.sources import open_source

    src = open_source("synth:tiny?regime=layered-persistent&persistence=0.5&layers=2")
    assert src.spec.regime == regime("layered-persistent", persistence=0.5)
    assert open_source("synth:tiny?layers=2").spec.regime == regime("flat")
    with pytest.raises(ConfigError, match="unknown routing regime"):
        open_source("synth:tiny?regime=bumpy")


def test_a_preset_measured_on_the_gpu_keeps_its_own_skew_factor():
    """qwen3-30b-a3b's layered factor is its own (tiny's 1.5 sent 93.7% of its routes to the top
    45%); other presets keep tiny's; an explicit knob still wins; the knobs reach the bench's record."""
    from types import SimpleNamespace

    from ostinato.bench.report import routing_knobs
    from ostinato.synth.presets import PRESET_SKEW_FACTORS, REGIMES, regime

    assert regime("layered", "qwen3-30b-a3b").skew_factor == PRESET_SKEW_FACTORS["qwen3-30b-a3b"]["layered"]
    assert regime("layered", "tiny") == regime("layered") == REGIMES["layered"]
    assert regime("flat", "qwen3-30b-a3b") == REGIMES["flat"]
    assert regime("layered", "qwen3-30b-a3b", skew_factor=2.0).skew_factor == 2.0
    spec = SimpleNamespace(regime=regime("layered", "qwen3-30b-a3b"), skew=None)
    assert routing_knobs(SimpleNamespace(spec=spec))["routing"]["skew_factor"] == 0.9
    assert routing_knobs(SimpleNamespace()) == {}
