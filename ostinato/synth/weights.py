"""The weights of a synthetic Qwen3-MoE, one tensor at a time, by name.

Routing in a random model is nearly uniform; agent sessions route skewed and stably.
The skew is put into the model's own weights, so every engine that loads the checkpoint
(transformers, llama.cpp after GGUF conversion) routes the same way:

* residual channel 0 is a constant "massive activation": the embedding sets it to
  BIAS_VALUE for every token, and every matrix that writes into the residual stream
  (o_proj, down_proj) has a zero row 0, so it stays constant through all layers;
* every matrix that reads the normalised stream (q/k/v, experts, dense MLP, lm_head)
  has a zero column 0, so only the routers see the channel;
* router column 0 holds skew * s_layer * z_expert: after the RMSNorm this adds a
  per-expert bias to the router logits, on top of the token-dependent part (about unit
  variance). z is a standard normal per (layer, expert); s_layer in [0.75, 1.25] makes
  the skew vary by layer.

Writers into the residual are scaled by 0.5 / sqrt(layers), so the residual's RMS (and
with it the bias each router sees) stays within ~15% of the embedding's through the
stack. The lm_head rows of ids the tokenizer never produces are zero, so generation
stays on real tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ostinato.layers.moe.types import expert_views
from ostinato.synth.hashrand import fill_uniform_, normal_vector, tensor_key, uniform_bits
from ostinato.synth.presets import DEFAULT_SKEW, preset_config

BIAS_CHANNEL = 0
BIAS_VALUE = 1.0


@dataclass(frozen=True)
class SynthSpec:
    preset: str
    layers: int | None = None
    seed: int = 0
    skew: float | None = None  # router bias scale; None: the preset's default
    active_vocab: int | None = None  # ids below this are real tokens

    @cached_property
    def config(self) -> dict:
        return preset_config(self.preset, self.layers)

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the checkpoint, in the Hugging Face naming, in a fixed order."""
        c = self.config
        D, hd, H, Hkv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
        F, E = c["moe_intermediate_size"], c["num_experts"]
        out = {"model.embed_tokens.weight": (c["vocab_size"], D)}
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            out |= {
                p + "input_layernorm.weight": (D,),
                p + "self_attn.q_proj.weight": (H * hd, D),
                p + "self_attn.k_proj.weight": (Hkv * hd, D),
                p + "self_attn.v_proj.weight": (Hkv * hd, D),
                p + "self_attn.o_proj.weight": (D, H * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "post_attention_layernorm.weight": (D,),
            }
            if i in c["mlp_only_layers"] or (i + 1) % c["decoder_sparse_step"] != 0:
                I = c["intermediate_size"]
                out |= {p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D),
                        p + "mlp.down_proj.weight": (D, I)}
                continue
            out[p + "mlp.gate.weight"] = (E, D)
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                out |= {q + "gate_proj.weight": (F, D), q + "up_proj.weight": (F, D), q + "down_proj.weight": (D, F)}
        out["model.norm.weight"] = (D,)
        if not c["tie_word_embeddings"]:
            out["lm_head.weight"] = (c["vocab_size"], D)
        return out

    def layer_skew(self, layer: int) -> float:
        u = uniform_bits(tensor_key(self.seed, f"skew.{layer}"), 0, 1, "cpu").item()
        skew = DEFAULT_SKEW[self.preset] if self.skew is None else self.skew
        return skew * (0.75 + 0.5 * u)

    def router_bias(self, layer: int) -> torch.Tensor:
        """Per-expert router logit bias of one layer, [E] fp32."""
        E = self.config["num_experts"]
        return self.layer_skew(layer) * normal_vector(tensor_key(self.seed, f"bias.{layer}"), E)

    def tensor(self, name: str, device="cpu", dtype=torch.bfloat16) -> torch.Tensor:
        out = torch.empty(self.shapes[name], device=device, dtype=dtype)
        return self.fill_(name, out)

    def fill_(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Write tensor `name` into `out` (any device, any float dtype)."""
        c = self.config
        kind = name.rsplit(".", 2)[-2]
        if kind.endswith("norm"):
            return out.fill_(1.0)
        writer_scale = 0.5 / c["num_hidden_layers"] ** 0.5
        fan_in = out.shape[-1]
        std = {"embed_tokens": 1.0, "lm_head": 3.0 / fan_in ** 0.5}.get(kind, fan_in ** -0.5)
        if kind in ("o_proj", "down_proj"):
            std *= writer_scale
        fill_uniform_(out, tensor_key(self.seed, name), std)
        if kind == "embed_tokens":
            out[:, BIAS_CHANNEL] = BIAS_VALUE
        elif kind in ("o_proj", "down_proj"):
            out[BIAS_CHANNEL, :] = 0
        elif kind == "gate" and name.endswith("mlp.gate.weight"):
            layer = int(name.split(".")[2])
            out[:, BIAS_CHANNEL] = self.router_bias(layer).to(out.device, out.dtype)
        else:
            out[:, BIAS_CHANNEL] = 0
        if kind == "lm_head" and self.active_vocab is not None:
            out[self.active_vocab:] = 0
        return out

    def fill_experts_(self, layer: int, w13: torch.Tensor, w2: torch.Tensor, first: int = 0) -> None:
        """Experts [first, first + n) of one layer into w13 [n, 2F, D] and w2 [n, D, F]."""
        for name, view in expert_views(layer, w13, w2, first):
            self.fill_(name, view)
