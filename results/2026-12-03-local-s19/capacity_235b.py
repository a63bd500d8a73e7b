"""The capacity test of session 18's 235B-shaped plan (results/2026-12-02-h200-s18/bench_235b/), computed again
with the dense weights in bf16 (as planned then) and in their Q4_K_M blocks (commit dfff8dc). Pure arithmetic of
planner/capacity.py on the committed development profile: no GPU, no file. Run from the repository root:
    python results/2026-12-03-local-s19/capacity_235b.py > results/2026-12-03-local-s19/capacity_235b.json
"""
import json
import subprocess

import torch

from ostinato.config import ModelConfig
from ostinato.engine.routes import RouteCounts
from ostinato.loader.build import WeightFormats, dense_formats
from ostinato.loader.gguf import gguf_name
from ostinato.models.registry import new_model
from ostinato.planner.capacity import CapacitySettings, plan_capacity
from ostinato.synth.gguf_writer import tensor_qtype, use_more_bits
from ostinato.synth.presets import preset_config

S18 = "results/2026-12-02-h200-s18/bench_235b"
cfg = ModelConfig.from_dict(preset_config("qwen3-235b-a22b", 32))


class Recipe:
    """The types llama.cpp's Q4_K_M gives the dense tensors (synth/gguf_writer.py), without the 46 GB file."""

    config = cfg
    model = new_model(cfg)

    def dense_qtype(self, name):
        return tensor_qtype("Q4_K_M", gguf_name(name), tuple(self.model.get_parameter(name).shape), cfg)


experts = {l: ("Q4_K", "Q6_K" if use_more_bits(l, 32) else "Q4_K") for l in cfg.moe_layers}
counts = RouteCounts.load(f"{S18}/profile-dev.json").total("all")
planned = json.load(open(f"{S18}/residency.json"))["capacity"]
out = {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
       "model": "synth:qwen3-235b-a22b?layers=32, Q4_K_M", "cap": "24 GiB", "kv_tokens": 8292, "pass_tokens": 2048,
       "session_18_plan": {k: planned[k] for k in ("dense_weights", "activations", "margin", "hot_slots", "flex_slots")}}
for name, formats in (("dense_bf16", WeightFormats(experts)), ("dense_in_blocks", WeightFormats(experts, dense_formats(Recipe())))):
    c = plan_capacity(cfg, counts, 24 * 2**30, 8292, torch.bfloat16, CapacitySettings(prefill_chunk=2048), formats=formats)
    out[name] = {"dense_weights": c.dense_weights, "activations": c.activations, "margin": c.margin,
                 "hot_slots": c.hot_slots, "flex_slots": c.flex_slots, "max_flex": c.max_flex, "pool_bytes": c.pool_bytes}
print(json.dumps(out, indent=1))
