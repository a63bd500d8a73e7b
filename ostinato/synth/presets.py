"""Synthetic model presets: config.json contents with the real Qwen3-30B-A3B keys.

`tiny` is the CI model (CPU, every test run); `tiny-k` is its sibling for GGUF K-quants,
whose rows must be multiples of 256 values (two layers, so Q4_K_M gives one Q4_K and one
Q6_K down projection); `qwen3-30b-a3b` has the real shapes.
A preset can be cut to fewer layers (`--layers`) for file-based runs on small disks.

A routing regime (`Regime`, named in REGIMES) says how the model routes beyond the
per-expert bias that every regime has: how the skew varies with depth, whether consecutive
tokens keep their experts, whether routing follows the class of the token. Trained routers
do all three; `flat` (the default) does none, and its weights are those of the generator
before regimes existed. synth/weights.py puts each knob into the weights.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

TINY = {
    **QWEN3_30B_A3B,
    "head_dim": 32,
    "hidden_size": 128,
    "intermediate_size": 256,
    "max_position_embeddings": 8192,
    "max_window_layers": 4,
    "moe_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "vocab_size": 8192,
}

TINY_K = {
    **TINY,
    "head_dim": 64,
    "hidden_size": 256,
    "intermediate_size": 512,
    "max_window_layers": 2,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 2,
    "vocab_size": 4096,
}

PRESETS = {"tiny": TINY, "tiny-k": TINY_K, "qwen3-30b-a3b": QWEN3_30B_A3B}

# Router bias scale (see synth/weights.py) of each preset, chosen so that the 40-45% of
# experts most routed in development sessions receive 80-85% of held-out routes:
# tiny: 1.0 measured with `ostinato skew` (40.6% -> 81.3%). qwen3-30b-a3b: 0.75 measured 88.4% at
# 40% on the H200 (results/2026-11-29-h200/); 0.5, chosen from a per-layer fit of that run, measured
# 76.7% at 40% and 80.2% at 44% of held-out tau2 / SWE-agent routes (results/2026-11-29-h200x2/):
# inside BENCHMARK.md's 80-85% for 40-45% only at its upper end of experts.
DEFAULT_SKEW = {"tiny": 1.0, "tiny-k": 1.0, "qwen3-30b-a3b": 0.5}  # tiny-k: tiny's, not measured

# Tokenizer vocabulary trained for each preset; the embedding keeps the preset's size.
TOKENIZER_VOCAB = {"tiny": 4096, "tiny-k": 4096, "qwen3-30b-a3b": 32768}


def preset_config(name: str, layers: int | None = None) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    cfg = dict(PRESETS[name])
    if layers is not None:
        if not 1 <= layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"--layers must be in 1..{cfg['num_hidden_layers']} for {name}")
        cfg["num_hidden_layers"] = layers
        cfg["max_window_layers"] = layers
    return cfg


DEPTH_PROFILES = ("drawn", "hump")


@dataclass(frozen=True)
class Regime:
    """Routing knobs of a synthetic model (see synth/weights.py for how each is built).

    depth: how the router bias scale varies over the layers, as multiples low..high of the
    calibrated scale. `drawn`: uniform in low..high per layer (0.75..1.25 is the generator's
    original); `hump`: low + (high - low) * 4x(1-x) over the depth x in [0, 1], times a
    0.9..1.1 draw per layer: weakest at the first and last layers, strongest in the middle.
    Trained models' per-layer miss rates are U-shaped (the end layers route least
    predictably), and a miss rate falls as the skew grows, so the skew is the inverted U.
    persistence: scale of the router logits that read a channel written by a local-attention
    head (a smoothed state of the last ~10 tokens); 0: memoryless.
    content: scale of per-(token class, expert) router biases; 0: none.
    skew_factor: multiplies the preset's calibrated bias scale, so that the regime keeps the
    global skew figure (40-45% of experts -> 80-85% of held-out routes).
    """

    depth: str = "drawn"
    low: float = 0.75
    high: float = 1.25
    persistence: float = 0.0
    content: float = 0.0
    skew_factor: float = 1.0

    def __post_init__(self):
        if self.depth not in DEPTH_PROFILES:
            raise ValueError(f"unknown depth profile {self.depth!r} (choose from {', '.join(DEPTH_PROFILES)})")
        if not 0 <= self.low <= self.high:
            raise ValueError(f"depth range needs 0 <= low <= high, got {self.low}..{self.high}")
        if self.persistence < 0 or self.content < 0 or self.skew_factor < 0:
            raise ValueError("persistence, content and skew_factor must be >= 0")

    @property
    def is_flat(self) -> bool:
        return self == Regime()


# skew_factor, persistence and content measured on `tiny` with `ostinato skew` (see
# tests/test_synth_regimes.py for the statistics each regime must reach); qwen3-30b-a3b is
# given the same factors until it is measured on the GPU machine.
REGIMES = {
    "flat": Regime(),
    "layered": Regime(depth="hump", low=0.3, high=1.7, skew_factor=1.5),
    "layered-persistent": Regime(depth="hump", low=0.3, high=1.7, persistence=1.0, skew_factor=1.8),
    "content": Regime(content=1.0, skew_factor=1.1),
}

REGIME_KNOBS = tuple(f.name for f in fields(Regime))


def regime(name: str = "flat", **overrides) -> Regime:
    """A named regime, with any of its knobs overridden (None: keep the regime's)."""
    if name not in REGIMES:
        raise ValueError(f"unknown routing regime {name!r} (choose from {', '.join(REGIMES)})")
    return replace(REGIMES[name], **{k: v for k, v in overrides.items() if v is not None})
