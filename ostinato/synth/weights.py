"""The weights of a synthetic model (Qwen3-MoE, DeepSeek-V3), one tensor at a time, by name.

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

A routing regime (synth/presets.py) reserves more channels the same way (zero rows in the
writers, zero columns in every reader but the routers), after channel 0:

* depth: s_layer follows the regime's profile instead of the 0.75..1.25 draw, and z is
  standardised per layer (zero mean, unit standard deviation over the E experts), so that
  a layer's skew is its profile's and not the luck of E draws (every regime but `flat`);
* persistence, STATE_CHANNELS channels: layer 0's attention head 0 is a local average.
  Its query and key read only channel 0, so after q_norm / k_norm they are the same
  constant vector for every token, and the score of key j for query i depends on i - j
  alone, through RoPE: sqrt(hd) * w^2 * mean over pairs f in STATE_FREQS of
  cos(theta_f (i - j)), w the norm weight of those pairs. That is a window of about
  STATE_WINDOW recent tokens (the low frequencies keep far tokens out: no revival within
  the context). The head averages its values (a random reading of each token) over the
  window and o_proj writes the average, and nothing else, into the state channels, which
  the routers read with scale `persistence`: neighbouring tokens share most of their
  window, so they share experts. Only the weights do this, so every engine sees it;
* content, one channel per token class (TOKEN_CLASSES, from the tokenizer's vocabulary):
  the embedding sets its class's channel to 1, and each router reads it with scale
  `content` times a standard normal per (layer, class, expert): a per-class expert bias.

With no knob set (`flat`), only channel 0 is reserved and every tensor is the same as
before regimes existed.

DeepSeek-V3 gets the same construction through its own tensors: its router (`mlp.gate`)
reads the channels, its selection bias `e_score_correction_bias` is a small random vector
(fp32, as DeepSeek stores it; it only chooses, so it shifts routing without shaping the
weights), the readers of the residual (q_a_proj or q_proj, kv_a_proj_with_mqa, the shared
and dense MLPs) have the zero columns, q_b_proj and kv_b_proj read latents and are plain.
GLM-4-MoE has DeepSeek's MoE with per-head attention, whose q/k/v biases are small random
vectors. The persistence regime needs Qwen3's per-head q/k norms and full rotary for its
constant-query head and is refused for the other attentions; depth and content apply.
gpt-oss has a layout of its own (fused, interleaved experts with biases, MXFP4 blocks, sinks,
a router with a bias): synth/gpt_oss.py writes those tensors by the same construction; those
it shares with Qwen3 (embedding, norms, q/k/v/o weights, lm_head) come from here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ostinato.config import ModelConfig
from ostinato.layers.moe.types import expert_views
from ostinato.models.registry import model_class
from ostinato.synth import gpt_oss
from ostinato.synth.hashrand import fill_uniform_, normal_vector, tensor_key, uniform_bits
from ostinato.synth.presets import DEFAULT_SKEW, Regime, preset_config

BIAS_CHANNEL = 0
BIAS_VALUE = 1.0
STATE_CHANNELS = 8
STATE_LAYER = 0
STATE_FREQS = (1e-3, 0.1)  # RoPE pair frequencies (radians per token) the state head's score uses
STATE_SHARPNESS = 32.0  # score at distance 0; with STATE_FREQS a window of ~10 tokens
STATE_WINDOW = 10.0  # effective number of tokens averaged (1 / sum of squared weights)
TOKEN_CLASSES = ("space", "punct", "digit", "word", "ident", "special")
WRITERS = ("o_proj", "down_proj")
LATENT_READERS = ("q_b_proj", "kv_b_proj")  # MLA's up-projections: they read latents, not the residual
SELECTION_BIAS_STD = 0.03  # DeepSeek's e_score_correction_bias, against sigmoid scores in (0, 1)
FP32_TENSORS = ("e_score_correction_bias",)  # stored fp32 in the checkpoint (name endings)
ATTENTION_BIASES = ("q_proj.bias", "k_proj.bias", "v_proj.bias")  # GLM-4-MoE's, added after the projection
ATTENTION_BIAS_STD = 0.1


def token_class(text: str) -> int:
    """Index in TOKEN_CLASSES of a (non-special) token's text: whitespace; punctuation and
    symbols; digits; a space-led word (prose); any other piece with letters (identifiers,
    keys, word pieces)."""
    body = text.strip()
    if not body:
        return 0
    if any(ch.isalpha() for ch in body):
        return 3 if text[0] == " " and body.isalpha() else 4
    return 2 if any(ch.isdigit() for ch in body) else 1


def token_classes(tok: Tokenizer, n: int) -> torch.Tensor:
    """Class of ids 0..n-1, [n] int64; -1 for ids the tokenizer does not have."""
    have = tok.get_vocab_size(with_added_tokens=True)
    texts = tok.decode_batch([[i] for i in range(min(n, have))], skip_special_tokens=False)
    out = torch.full((n,), -1, dtype=torch.int64)
    out[:len(texts)] = torch.tensor([token_class(t) for t in texts], dtype=torch.int64)
    special = [i for i, t in tok.get_added_tokens_decoder().items() if t.special and i < n]
    out[special] = TOKEN_CLASSES.index("special")
    return out


@dataclass(frozen=True)
class SynthSpec:
    preset: str
    layers: int | None = None
    seed: int = 0
    skew: float | None = None  # router bias scale; None: the preset's default
    active_vocab: int | None = None  # ids below this are real tokens
    regime: Regime = Regime()
    tokenizer_dir: Path | None = field(default=None, compare=False)  # for content classes

    @cached_property
    def config(self) -> dict:
        return preset_config(self.preset, self.layers)

    @cached_property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.config)

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the checkpoint, in the Hugging Face naming, in a fixed order."""
        c, mc = self.config, self.model_config
        if mc.family == "gpt_oss":  # fused experts, biases, sinks: its own layout (synth/gpt_oss.py)
            return gpt_oss.shapes(c)
        D, E = c["hidden_size"], mc.num_experts
        out = {"model.embed_tokens.weight": (c["vocab_size"], D)}
        attention = _mla_shapes if mc.kv_lora_rank else _gqa_shapes
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (D,)
            out |= {p + "self_attn." + n: shape for n, shape in attention(c, mc).items()}
            out[p + "post_attention_layernorm.weight"] = (D,)
            if not mc.is_moe_layer(i):
                out |= _mlp_shapes(p + "mlp.", D, c["intermediate_size"])
                continue
            out[p + "mlp.gate.weight"] = (E, D)
            if mc.scoring_func == "sigmoid":
                out[p + "mlp.gate.e_score_correction_bias"] = (E,)
            F = c["moe_intermediate_size"]
            for e in range(E):
                out |= _mlp_shapes(f"{p}mlp.experts.{e}.", D, F)
            if mc.n_shared_experts:
                out |= _mlp_shapes(p + "mlp.shared_experts.", D, mc.n_shared_experts * F)
        out["model.norm.weight"] = (D,)
        if not c["tie_word_embeddings"]:
            out["lm_head.weight"] = (c["vocab_size"], D)
        return out

    def dtype_of(self, name: str) -> torch.dtype:
        """The tensor's dtype in the checkpoint: bf16, but the selection bias fp32 (and gpt-oss's
        MXFP4 blocks and scales uint8)."""
        if self.model_config.family == "gpt_oss":
            return gpt_oss.dtype_of(name)
        return torch.float32 if name.endswith(FP32_TENSORS) else torch.bfloat16

    @cached_property
    def channels(self) -> dict[str, range]:
        """Residual channels only the routers read: bias, then those the regime adds."""
        r, out = self.regime, {"bias": range(BIAS_CHANNEL, BIAS_CHANNEL + 1)}
        mc = self.model_config
        if r.persistence and (mc.kv_lora_rank or not mc.qk_norm or mc.partial_rotary_factor != 1 or mc.attention_bias):
            raise ValueError("the persistence regime builds its local-attention head from Qwen3's q/k norms and full "
                             f"rotary, which {self.preset}'s attention has not: use flat, layered or content")
        if r.persistence:
            out["state"] = range(1, 1 + STATE_CHANNELS)
        if r.content:
            start = 1 + STATE_CHANNELS * bool(r.persistence)
            out["class"] = range(start, start + len(TOKEN_CLASSES))
        return out

    @cached_property
    def reserved(self) -> int:
        """Channels [0, reserved) are only the routers' (contiguous by construction)."""
        return max(ch.stop for ch in self.channels.values())

    @cached_property
    def token_classes(self) -> torch.Tensor:
        if self.tokenizer_dir is None:
            raise ValueError("the content regime needs the tokenizer (SynthSpec.tokenizer_dir) to classify tokens")
        tok = Tokenizer.from_file(str(Path(self.tokenizer_dir) / "tokenizer.json"))
        return token_classes(tok, self.config["vocab_size"])

    def layer_skew(self, layer: int) -> float:
        r = self.regime
        u = uniform_bits(tensor_key(self.seed, f"skew.{layer}"), 0, 1, "cpu").item()
        skew = DEFAULT_SKEW[self.preset] * r.skew_factor if self.skew is None else self.skew
        if r.depth == "drawn":
            return skew * (r.low + (r.high - r.low) * u)
        L = self.config["num_hidden_layers"]
        x = layer / (L - 1) if L > 1 else 0.5
        return skew * (r.low + (r.high - r.low) * 4 * x * (1 - x)) * (0.9 + 0.2 * u)

    def router_bias(self, layer: int) -> torch.Tensor:
        """Per-expert router logit bias of one layer, [E] fp32."""
        E = self.model_config.num_experts
        z = normal_vector(tensor_key(self.seed, f"bias.{layer}"), E)
        if not self.regime.is_flat:  # the layers follow the profile, not the luck of E draws
            z = (z - z.mean()) / z.std()
        return self.layer_skew(layer) * z

    def state_pairs(self) -> torch.Tensor:
        """The RoPE pairs (indices < head_dim / 2) the state head's query and key occupy."""
        c = self.config
        hd = c["head_dim"]
        theta = c["rope_theta"] ** (-2 * torch.arange(hd // 2, dtype=torch.float64) / hd)
        return torch.nonzero((theta >= STATE_FREQS[0]) & (theta <= STATE_FREQS[1])).flatten()

    def tensor(self, name: str, device="cpu", dtype=torch.bfloat16) -> torch.Tensor:
        out = torch.empty(self.shapes[name], device=device, dtype=dtype)
        return self.fill_(name, out)

    def fill_(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Write tensor `name` into `out` (any device, any float dtype)."""
        c = self.config
        kind = name.rsplit(".", 2)[-2]
        if self.model_config.family == "gpt_oss" and gpt_oss.owns(name):
            return gpt_oss.fill_(self, name, out)
        if name.endswith("e_score_correction_bias"):
            return fill_uniform_(out, tensor_key(self.seed, name), SELECTION_BIAS_STD)
        if name.endswith(ATTENTION_BIASES):
            return fill_uniform_(out, tensor_key(self.seed, name), ATTENTION_BIAS_STD)
        if kind.endswith("norm"):
            out.fill_(1.0)
            if kind in ("q_norm", "k_norm") and self._is_state_layer(name):
                pairs = self.state_pairs()
                w = (STATE_SHARPNESS / c["head_dim"] ** 0.5) ** 0.5
                out[torch.cat([pairs, pairs + c["head_dim"] // 2]).to(out.device)] = w
            return out
        writer_scale = 0.5 / c["num_hidden_layers"] ** 0.5
        fan_in = out.shape[-1]
        std = {"embed_tokens": 1.0, "lm_head": 3.0 / fan_in ** 0.5}.get(kind, fan_in ** -0.5)
        if kind in ("o_proj", "down_proj"):
            std *= writer_scale
        fill_uniform_(out, tensor_key(self.seed, name), std)
        R = self.reserved
        if kind == "embed_tokens":
            out[:, BIAS_CHANNEL] = BIAS_VALUE
            out[:, 1:R] = 0
            if "class" in self.channels:
                self._mark_classes_(out)
        elif kind in WRITERS:
            out[:R, :] = 0
            if kind == "o_proj" and self._is_state_layer(name):
                self._state_writer_(out)
        elif kind == "gate" and name.endswith("mlp.gate.weight"):
            layer = int(name.split(".")[2])
            out[:, BIAS_CHANNEL] = self.router_bias(layer).to(out.device, out.dtype)
            self._router_regime_(layer, out)
        elif kind in LATENT_READERS:
            pass
        else:
            out[:, :R] = 0
            if kind in ("q_proj", "k_proj") and self._is_state_layer(name):
                self._state_reader_(out)
        if kind == "lm_head" and self.active_vocab is not None:
            out[self.active_vocab:] = 0
        if name.endswith(model_class(self.model_config).fp32_params) and self.dtype_of(name) == torch.bfloat16:
            out.copy_(out.to(torch.bfloat16))  # the model keeps it fp32: the checkpoint's bf16 values, in memory too
        return out

    def _is_state_layer(self, name: str) -> bool:
        return "state" in self.channels and name.startswith(f"model.layers.{STATE_LAYER}.self_attn.")

    def _state_reader_(self, out: torch.Tensor) -> None:
        """Query head 0 / key head 0 [hd, D] read only channel 0: a constant vector per token."""
        hd = self.config["head_dim"]
        out[:hd] = 0
        out[self.state_pairs().to(out.device), BIAS_CHANNEL] = 1.0

    def _state_writer_(self, out: torch.Tensor) -> None:
        """o_proj [D, H*hd]: head 0 writes its window average into the state channels only."""
        hd, ch = self.config["head_dim"], self.channels["state"]
        # a window average of unit-variance values has variance ~1 / STATE_WINDOW: back to ~unit RMS
        m = normal_vector(tensor_key(self.seed, "state.write"), len(ch) * hd).view(len(ch), hd)
        out[:, :hd] = 0
        out[ch.start:ch.stop, :hd] = (m * (STATE_WINDOW / hd) ** 0.5).to(out.device, out.dtype)

    def _mark_classes_(self, out: torch.Tensor) -> None:
        cls = self.token_classes.to(out.device)
        ids = torch.nonzero(cls >= 0).flatten()
        out[ids, self.channels["class"].start + cls[ids]] = 1.0

    def _router_regime_(self, layer: int, out: torch.Tensor) -> None:
        """Router [E, D] columns for the regime's channels (see the module docstring)."""
        E, r = out.shape[0], self.regime
        if "state" in self.channels:
            ch = self.channels["state"]
            g = normal_vector(tensor_key(self.seed, f"state.{layer}"), E * len(ch)).view(E, len(ch))
            out[:, ch.start:ch.stop] = (r.persistence / len(ch) ** 0.5 * g).to(out.device, out.dtype)
        if "class" in self.channels:
            ch = self.channels["class"]
            z = normal_vector(tensor_key(self.seed, f"class.{layer}"), E * len(ch)).view(E, len(ch))
            out[:, ch.start:ch.stop] = (r.content * z).to(out.device, out.dtype)

    def fill_experts_(self, layer: int, w13: torch.Tensor, w2: torch.Tensor, first: int = 0) -> None:
        """Experts [first, first + n) of one layer into w13 [n, 2F, D] and w2 [n, D, F]."""
        for name, view in expert_views(layer, w13, w2, first):
            self.fill_(name, view)


def _mlp_shapes(prefix: str, dim: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, dim), prefix + "up_proj.weight": (inter, dim),
            prefix + "down_proj.weight": (dim, inter)}


def _gqa_shapes(c: dict, mc: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Qwen3's attention (q/k norms), or GLM-4-MoE's (q/k/v biases with attention_bias, q/k norms
    with use_qk_norm; o_proj never has a bias: synthetic Qwen3 models have attention_bias false)."""
    D, hd, H, Hkv = mc.hidden_size, mc.head_dim, mc.num_attention_heads, mc.num_key_value_heads
    out = {"q_proj.weight": (H * hd, D), "k_proj.weight": (Hkv * hd, D), "v_proj.weight": (Hkv * hd, D),
           "o_proj.weight": (D, H * hd)}
    if mc.attention_bias:
        out |= {"q_proj.bias": (H * hd,), "k_proj.bias": (Hkv * hd,), "v_proj.bias": (Hkv * hd,)}
    if mc.qk_norm:
        out |= {"q_norm.weight": (hd,), "k_norm.weight": (hd,)}
    return out


def _mla_shapes(c: dict, mc: ModelConfig) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's latent attention (no attention_bias: the checkpoints have none)."""
    if c.get("attention_bias"):
        raise ValueError("synthetic latent attention has no attention biases (attention_bias must be false)")
    D, H, R, Rq = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], c["q_lora_rank"]
    dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    out = {"q_proj.weight": (H * (dn + dr), D)} if Rq is None else {
        "q_a_proj.weight": (Rq, D), "q_a_layernorm.weight": (Rq,), "q_b_proj.weight": (H * (dn + dr), Rq)}
    return out | {"kv_a_proj_with_mqa.weight": (R + dr, D), "kv_a_layernorm.weight": (R,),
                  "kv_b_proj.weight": (H * (dn + dv), R), "o_proj.weight": (D, H * dv)}
