"""Synthetic model presets: config.json contents with the real keys of their family.

`tiny` is the CI model (CPU, every test run); `tiny-k` is its sibling for GGUF K-quants,
whose rows must be multiples of 256 values (two layers, so Q4_K_M gives one Q4_K and one
Q6_K down projection); `qwen3-30b-a3b` and `qwen3-235b-a22b` have the real shapes (the latter cut to
32 of its 94 layers on the GPU machine's disk, QWEN3_235B_A22B says why).
`tiny-deepseek-v3` is DeepSeek-V3 (`DeepseekV3ForCausalLM`) for CI: one dense first layer,
then MoE layers with a shared expert, grouped routing (n_group > 1), low-rank queries,
latent attention and yarn rope with mscale; `deepseek-v3-shaped` has DeepSeek-V3's real
dimensions with as many of its layers (3 dense, then MoE) as fit about 100 GiB in bf16 (7:
92.4 GiB; the full model's 61 do not fit a GPU machine, and its multi-token-prediction
layer is left out: num_nextn_predict_layers 0). `tiny-glm4-moe` is GLM-4-MoE
(`Glm4MoeForCausalLM`), DeepSeek-V3's MoE under grouped-query attention, for CI.
`tiny-gpt-oss` is gpt-oss (`GptOssForCausalLM`) for CI: sliding and full attention layers,
sinks, attention / router / expert biases, the clamped SwiGLU, bf16 experts in the fused,
interleaved layout; `tiny-gpt-oss-mxfp4` the same model with MXFP4 experts (the Hugging Face
`*_blocks` / `*_scales` form and quantization_config); `gpt-oss-120b` has the real shapes
(36 layers of 128 experts, top-4, MXFP4 experts).
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

# Qwen3-235B-A22B's real dimensions (its config.json): hidden 4096, 94 layers of 128 experts (top 8,
# expert FFN 1536), 64 query and 4 KV heads of 128. As a Q4_K_M file a layer takes about 1.5 GB, so the
# GPU machine's 64 GiB disk holds 32 of its layers (48 GB), and its 125 GiB of memory the file's page
# cache beside Ostinato's copy of the cold experts: `--layers 32` (or synth:qwen3-235b-a22b?layers=32).
QWEN3_235B_A22B = {
    **QWEN3_30B_A3B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_window_layers": 94,
    "moe_intermediate_size": 1536,
    "num_attention_heads": 64,
    "num_hidden_layers": 94,
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

# DeepSeek-V3's config.json keys (its quantization_config and remote-code auto_map left out:
# the synthetic checkpoint is bf16 and loads with transformers' own DeepseekV3ForCausalLM)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 7,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 0,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

# mscale differs from mscale_all_dim so that both yarn factors (cos/sin and the softmax scale) count
TINY_DEEPSEEK_V3 = {
    **DEEPSEEK_V3,
    "first_k_dense_replace": 1,
    "hidden_size": 128,
    "intermediate_size": 256,
    "kv_lora_rank": 32,
    "max_position_embeddings": 8192,
    "moe_intermediate_size": 64,
    "n_group": 4,
    "n_routed_experts": 16,
    "num_attention_heads": 4,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                     "original_max_position_embeddings": 2048, "type": "yarn"},
    "topk_group": 2,
    "v_head_dim": 24,
    "vocab_size": 8192,
}

# gpt-oss-120b's config.json (openai's release: MXFP4 experts, everything else bf16); a synthetic
# source or checkpoint of it holds its experts in MXFP4 too (about 61 GiB of them)
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_local_experts": 128,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}

# CI-sized gpt-oss in bf16: sliding (window 8, so that short prompts cross it) and full layers,
# sinks, biases, yarn as gpt-oss has it (truncate false). swiglu_limit 1.0, not 7.0: the tiny
# model's gate and up values are of unit size, and the clamps must act for the tests to see them.
TINY_GPT_OSS = {
    **{k: v for k, v in GPT_OSS_120B.items() if k != "quantization_config"},
    "head_dim": 32,
    "hidden_size": 128,
    "intermediate_size": 64,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 8192,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 16,
    "pad_token_id": None,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 4.0, "original_max_position_embeddings": 2048,
                     "rope_type": "yarn", "truncate": False},
    "sliding_window": 8,
    "swiglu_limit": 1.0,
    "vocab_size": 8192,
}

# The same model with MXFP4 experts as openai's checkpoints store them (the quantized path)
TINY_GPT_OSS_MXFP4 = {**TINY_GPT_OSS, "quantization_config": GPT_OSS_120B["quantization_config"]}

# GLM-4-MoE (transformers' Glm4MoeConfig keys) for CI: DeepSeek-V3's MoE under grouped-query
# attention with q/k norms, q/k/v biases and rotary on half of each head
TINY_GLM4_MOE = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "first_k_dense_replace": 1,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 128,
    "initializer_range": 0.02,
    "intermediate_size": 256,
    "max_position_embeddings": 8192,
    "model_type": "glm4_moe",
    "moe_intermediate_size": 64,
    "n_group": 2,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "num_nextn_predict_layers": 0,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0",
    "use_cache": True,
    "use_qk_norm": True,
    "vocab_size": 8192,
}

PRESETS = {"tiny": TINY, "tiny-k": TINY_K, "qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3-235b-a22b": QWEN3_235B_A22B,
           "tiny-deepseek-v3": TINY_DEEPSEEK_V3, "deepseek-v3-shaped": DEEPSEEK_V3, "tiny-glm4-moe": TINY_GLM4_MOE,
           "tiny-gpt-oss": TINY_GPT_OSS, "tiny-gpt-oss-mxfp4": TINY_GPT_OSS_MXFP4, "gpt-oss-120b": GPT_OSS_120B}

# Router bias scale (see synth/weights.py) of each preset, chosen so that the 40-45% of
# experts most routed in development sessions receive 80-85% of held-out routes:
# tiny: 1.0 measured with `ostinato skew` (40.6% -> 81.3%). qwen3-30b-a3b: 0.75 measured 88.4% at
# 40% on the H200 (results/2026-11-29-h200/); 0.5, chosen from a per-layer fit of that run, measured
# 76.7% at 40% and 80.2% at 44% of held-out tau2 / SWE-agent routes (results/2026-11-29-h200x2/):
# inside BENCHMARK.md's 80-85% for 40-45% only at its upper end of experts.
DEFAULT_SKEW = {"tiny": 1.0, "tiny-k": 1.0, "qwen3-30b-a3b": 0.5,  # tiny-k: tiny's, not measured
                "qwen3-235b-a22b": 0.5,  # qwen3-30b-a3b's, not measured
                # tiny-deepseek-v3, tiny-glm4-moe: the 7 of 16 experts most routed on 1500 random tokens get 82% /
                # 84% of another 1500's routes (a quick count, not `ostinato skew`)
                "tiny-deepseek-v3": 1.0, "tiny-glm4-moe": 1.0,
                "deepseek-v3-shaped": 0.5,  # qwen3-30b-a3b's, not measured
                "tiny-gpt-oss": 1.0, "tiny-gpt-oss-mxfp4": 1.0, "gpt-oss-120b": 0.5}  # likewise

# Tokenizer vocabulary trained for each preset; the embedding keeps the preset's size.
TOKENIZER_VOCAB = {"tiny": 4096, "tiny-k": 4096, "qwen3-30b-a3b": 32768, "qwen3-235b-a22b": 32768,
                   "tiny-deepseek-v3": 4096,
                   "deepseek-v3-shaped": 32768, "tiny-glm4-moe": 4096, "tiny-gpt-oss": 4096, "tiny-gpt-oss-mxfp4": 4096,
                   "gpt-oss-120b": 32768}


def preset_config(name: str, layers: int | None = None) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    cfg = dict(PRESETS[name])
    if layers is not None:
        if not 1 <= layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"--layers must be in 1..{cfg['num_hidden_layers']} for {name}")
        cfg["num_hidden_layers"] = layers
        if "max_window_layers" in cfg:  # Qwen3's key
            cfg["max_window_layers"] = layers
        if "layer_types" in cfg:  # gpt-oss's: one per layer
            cfg["layer_types"] = cfg["layer_types"][:layers]
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
# tests/test_synth_regimes.py for the statistics each regime must reach); a preset measured
# on the GPU machine has its own factors in PRESET_SKEW_FACTORS, the others take tiny's.
REGIMES = {
    "flat": Regime(),
    "layered": Regime(depth="hump", low=0.3, high=1.7, skew_factor=1.5),
    "layered-persistent": Regime(depth="hump", low=0.3, high=1.7, persistence=1.0, skew_factor=1.8),
    "content": Regime(content=1.0, skew_factor=1.1),
}

# A shape's own skew factors. qwen3-30b-a3b: with tiny's 1.5, `layered` sent 93.7% of held-out
# routes to the top 45% of experts (flat: 81.6%; results/2026-12-02-h200-s13). 0.9 is
# scripts/regime_fit.py's estimate from both runs' per-layer profiles for about 83%, to be
# confirmed on the GPU; `layered-persistent` keeps tiny's ratio to `layered` (1.8 / 1.5).
PRESET_SKEW_FACTORS = {"qwen3-30b-a3b": {"layered": 0.9, "layered-persistent": 1.08}}

REGIME_KNOBS = tuple(f.name for f in fields(Regime))


def regime(name: str = "flat", preset: str | None = None, **overrides) -> Regime:
    """A named regime, with the preset's own skew factor where it has one (PRESET_SKEW_FACTORS)
    and any of its knobs overridden (None: keep the regime's)."""
    if name not in REGIMES:
        raise ValueError(f"unknown routing regime {name!r} (choose from {', '.join(REGIMES)})")
    factor = PRESET_SKEW_FACTORS.get(preset, {}).get(name)
    base = REGIMES[name] if factor is None else replace(REGIMES[name], skew_factor=factor)
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})
