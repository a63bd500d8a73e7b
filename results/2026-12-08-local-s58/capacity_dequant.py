"""What the default tuning's dequantized path cost the capacity test, on the two [L] models: the plan with the
experts' dequantized path from 512 tokens (gpu_quant's default before session 58) against none (its default
since). Pure arithmetic of planner/capacity.py on committed development profiles (session 28's, both shapes as
Q4_K_M): no GPU, no file. The settings are `ostinato bench`'s defaults (a 2048-token prefill chunk, captured passes
up to the engine's default rows, the default margin) with an 8292-token KV cache, as the [L] replays ran.
Run from the repository root:
    python results/2026-12-08-local-s58/capacity_dequant.py > results/2026-12-08-local-s58/capacity_dequant.json
"""
import json

import torch

from ostinato.bench.report import source_state
from ostinato.config import ModelConfig
from ostinato.engine.routes import RouteCounts
from ostinato.layers.moe import gpu_quant as gq
from ostinato.loader.build import WeightFormats, dense_formats
from ostinato.loader.gguf import gguf_name
from ostinato.models.registry import new_model
from ostinato.planner.capacity import CapacitySettings, plan_capacity
from ostinato.synth.gguf_writer import tensor_qtype, use_more_bits
from ostinato.synth.presets import preset_config

S28 = "results/2026-12-04-h200-s28"
MODELS = {"synth:qwen3-30b-a3b, Q4_K_M, 12 GiB": ("qwen3-30b-a3b", None, 12, f"{S28}/pair_30b/profile-dev.json"),
          "synth:qwen3-235b-a22b?layers=32, Q4_K_M, 24 GiB": ("qwen3-235b-a22b", 32, 24,
                                                                  f"{S28}/pair_235b/profile-dev.json")}


def recipe(cfg):
    """The types llama.cpp's Q4_K_M gives the dense tensors (synth/gguf_writer.py), without the file."""
    model = new_model(cfg)

    class Recipe:
        config = cfg

        def dense_qtype(self, name):
            return tensor_qtype("Q4_K_M", gguf_name(name), tuple(model.get_parameter(name).shape), cfg)

    return Recipe()


def plan(cfg, counts, cap_gib, formats, threshold):
    gq.DEFAULT_QUANT_TUNING["dequant_min_tokens"] = threshold
    gq.clear_quant_tuning_cache()
    c = plan_capacity(cfg, counts, cap_gib * 2**30, 8292, torch.bfloat16, CapacitySettings(), formats=formats)
    return {"hot_slots": c.hot_slots, "flex_slots": c.flex_slots, "pool_bytes": c.pool_bytes,
            "activations": c.activations, "dequant_scratch": c.activation_parts["dequant_scratch"],
            "pass_graphs": c.activation_parts.get("pass_graphs")}


out = {**source_state(), "machine": "the 2-core CPU machine (arithmetic only)",
       "tuned_files_thresholds": "none in the tree sets one (moe_quant_h100_80gb_hbm3.json: null; moe_quant_h200.json: "
                                 "unset, so the default)",
       "kv_tokens": 8292, "models": {}}
for name, (preset, layers, cap, profile) in MODELS.items():
    cfg = ModelConfig.from_dict(preset_config(preset, layers))
    L = cfg.num_hidden_layers
    experts = {l: ("Q4_K", "Q6_K" if use_more_bits(l, L) else "Q4_K") for l in cfg.moe_layers}
    formats = WeightFormats(experts, dense_formats(recipe(cfg)))
    counts = RouteCounts.load(profile).total("all")
    before, after = plan(cfg, counts, cap, formats, 512), plan(cfg, counts, cap, formats, None)
    out["models"][name] = {"profile": profile, "experts": len(cfg.moe_layers) * cfg.num_experts,
                           "dequant_from_512": before, "no_dequant_path": after,
                           "more_hot_experts": after["hot_slots"] - before["hot_slots"]}
print(json.dumps(out, indent=1))
