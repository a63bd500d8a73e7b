"""Settings, validated once at start-up.

`ModelConfig` is the subset of a Hugging Face `config.json` that the supported model
families read, with one meaning per field whatever the family calls it (`num_experts` is
DeepSeek's `n_routed_experts`); it accepts both the transformers-4 keys (`rope_theta`,
`rope_scaling`) and the transformers-5 key (`rope_parameters`).

A model family is registered in two places, one per layer: here (`FAMILIES`: its
architectures and how its config.json reads) and in models/registry.py (its nn.Module).
A field a family does not have keeps a default that means "absent" (no shared experts,
softmax routing, one group, no MLA), so code reads fields, never family names.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ConfigError(ValueError):
    """A checkpoint or setting that Ostinato cannot use, with what to do about it."""


def env_count(name: str, default: int, what: str) -> int:
    """A switch of the environment that counts `what` (0: off), `default` where unset; anything but
    digits is refused with the variable's name."""
    v = os.environ.get(name, str(default))
    if not v.isdigit():
        raise ConfigError(f"{name} must be a count of {what} (0: off), not {v!r}")
    return int(v)


ACT_KINDS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class ExpertAct:
    """The activation between an expert's two projections, a property of the model family:
      silu            h = silu(g) * u                                      (Qwen3-MoE, DeepSeek)
      clamped_swiglu  g' = min(g, limit), u' = clamp(u, -limit, limit),
                      h = (u' + 1) * g' * sigmoid(alpha * g')              (gpt-oss: 1.702, 7.0)
    g and u include their biases when the experts have them."""

    kind: str = "silu"
    alpha: float = 1.0
    limit: float = 0.0

    def __post_init__(self):
        if self.kind not in ACT_KINDS:
            raise ValueError(f"unknown expert activation {self.kind!r} (known: {', '.join(ACT_KINDS)})")
        if self.kind == "clamped_swiglu" and not self.limit > 0:
            raise ValueError(f"clamped_swiglu needs a positive limit, got {self.limit}")

    @property
    def code(self) -> int:
        """The kernels' number for the kind (kernels/cpu/experts.h Act, the Triton ACT constexpr)."""
        return ACT_KINDS.index(self.kind)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """h from gate and up (same shapes, any float dtype; computed in that dtype)."""
        if self.kind == "silu":
            return torch.nn.functional.silu(gate) * up
        g = gate.clamp(max=self.limit)
        u = up.clamp(min=-self.limit, max=self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))


SILU = ExpertAct()


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    family: str = "qwen3_moe"  # a key of FAMILIES (and of models/registry.py's MODELS)
    # routing beyond softmax top-k (DeepSeek-V3): sigmoid scores with a selection-only bias,
    # experts in n_group groups of which topk_group are eligible, weights times the factor
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0  # an always-on MLP of n_shared_experts * moe_intermediate_size per MoE layer
    first_k_dense_replace: int = 0  # layers [0, k) are dense (DeepSeek-V3)
    moe_layer_freq: int = 1  # then every freq-th layer is sparse (DeepSeek's original code)
    # multi-head latent attention (DeepSeek-V3); kv_lora_rank 0: not MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # per-head attention options (GLM-4-MoE): q/k norms, rotary on a share of each head's dims
    qk_norm: bool = True
    partial_rotary_factor: float = 1.0
    # gpt-oss: attention sinks, per-layer sliding windows, router and expert biases, and the
    # clamped SwiGLU (swiglu_limit None: plain silu(g) * u)
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" or "sliding_attention"; () all full
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    attention_sinks: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: float | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def is_moe_layer(self, i: int) -> bool:
        """Sparse unless listed in mlp_only_layers (Qwen3), below first_k_dense_replace (DeepSeek),
        or off the step: (i + 1) % decoder_sparse_step (Qwen3) and i % moe_layer_freq (DeepSeek)."""
        return (
            i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def window_of(self, i: int) -> int | None:
        """Layer i's sliding window (keys a query sees, itself included), None for full attention."""
        if self.layer_types and self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def expert_act(self) -> ExpertAct:
        """The routed experts' activation (config.ExpertAct), what every expert kernel computes."""
        if self.swiglu_limit is None:
            return SILU
        return ExpertAct("clamped_swiglu", self.swiglu_alpha, self.swiglu_limit)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert (gate, up, down) in the checkpoint dtype."""
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 3 * self.hidden_size * self.moe_intermediate_size * itemsize

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        family = family_of(d)
        try:
            common = {**{k: d[v] for k, v in family.aliases.items() if v in d}, **d}
            keys = {**_common_keys(common), **family.keys(d)}
        except KeyError as e:
            raise ConfigError(f"config.json lacks the key {e.args[0]!r} that {family.title} needs") from None
        return cls(**keys, family=family.name, raw=d)

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such file (a model directory needs config.json)")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None


@dataclass(frozen=True)
class Family:
    """A model family as config.json names it: its architectures and how its keys read."""

    name: str  # "qwen3_moe": also the key of models/registry.py's MODELS
    title: str  # what a person calls it, for messages
    architectures: tuple[str, ...]
    keys: Callable[[dict], dict]  # config.json -> the family's ModelConfig fields (KeyError: a key is missing)
    aliases: dict = field(default_factory=dict)  # common key -> this family's name for it (read if present)


def _common_keys(d: dict) -> dict:
    """The fields every family reads the same way."""
    rope_params = d.get("rope_parameters") or {}
    rope_scaling = d.get("rope_scaling")
    if rope_params and rope_params.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
        rope_scaling = None
    eos = d.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
    if dtype not in _DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r} in config.json (use one of {list(_DTYPES)})")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {d['hidden_act']!r} in config.json: the expert kernels compute SwiGLU (silu)")
    heads = d["num_attention_heads"]
    return dict(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        moe_intermediate_size=d["moe_intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        num_experts_per_tok=d["num_experts_per_tok"],
        norm_topk_prob=d.get("norm_topk_prob", True),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=rope_params.get("rope_theta", d.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=d.get("max_position_embeddings", 40960),
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        attention_bias=d.get("attention_bias", False),
        dtype=dtype,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=eos,
    )


def _qwen3_moe_keys(d: dict) -> dict:
    return dict(
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        num_experts=d["num_experts"],
        decoder_sparse_step=d.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
    )


def _grouped_routing_keys(d: dict, title: str, scaling: float, dense: int) -> dict:
    """The DeepSeek-V3-style MoE (DeepSeek-V3, GLM-4-MoE): sigmoid scores, selection bias, groups,
    shared experts and dense first layers; `scaling` and `dense`: the family's defaults of
    routed_scaling_factor and first_k_dense_replace. transformers ignores moe_layer_freq;
    DeepSeek's own code honours it, and every released checkpoint has 1, where both agree."""
    scoring, method = d.get("scoring_func", "sigmoid"), d.get("topk_method", "noaux_tc")
    if scoring != "sigmoid" or method != "noaux_tc":
        raise ConfigError(f"{title} routing with scoring_func {scoring!r} and topk_method {method!r}: Ostinato "
                          "computes the sigmoid, bias-corrected grouped top-k (sigmoid, noaux_tc)")
    E, K = d["n_routed_experts"], d["num_experts_per_tok"]
    groups, eligible = d.get("n_group") or 1, d.get("topk_group") or 1
    if E % groups or E // groups < 2 or not 1 <= eligible <= groups or K > eligible * (E // groups):
        raise ConfigError(f"{E} routed experts in n_group {groups} groups with topk_group {eligible} cannot give "
                          f"num_experts_per_tok {K} (each group needs >= 2 experts, K <= topk_group * E / n_group)")
    return dict(
        num_experts=E,
        n_shared_experts=d.get("n_shared_experts", 1) or 0,
        scoring_func=scoring,
        n_group=groups,
        topk_group=eligible,
        routed_scaling_factor=float(d.get("routed_scaling_factor", scaling)),
        first_k_dense_replace=d.get("first_k_dense_replace", dense),
        moe_layer_freq=d.get("moe_layer_freq") or 1,
    )


def _deepseek_v3_keys(d: dict) -> dict:
    """DeepSeek-V3's keys, as transformers' DeepseekV3Config reads them: its defaults where a
    key may be absent, but the attention's shapes (q_lora_rank too: null or a rank) required."""
    kv_rank = d["kv_lora_rank"]
    if not kv_rank:
        raise ConfigError("config.json has kv_lora_rank 0: DeepSeek-V3's attention is MLA and needs the latent rank")
    nope, rope = d["qk_nope_head_dim"], d["qk_rope_head_dim"]
    return dict(
        **_grouped_routing_keys(d, "DeepSeek-V3", scaling=2.5, dense=3),
        head_dim=nope + rope,  # the query / key head dim (values: v_head_dim)
        q_lora_rank=d["q_lora_rank"],
        kv_lora_rank=kv_rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=d["v_head_dim"],
        rope_interleave=d.get("rope_interleave", True),
    )


def _glm4_moe_keys(d: dict) -> dict:
    """GLM-4-MoE's keys, as transformers' Glm4MoeConfig reads them: DeepSeek-V3's MoE with
    grouped-query attention (q/k norms if use_qk_norm, rotary on partial_rotary_factor of each
    head, 0.5 by default, q/k/v biases if attention_bias, none on o_proj)."""
    rope = d.get("rope_parameters") or {}
    return dict(
        **_grouped_routing_keys(d, "GLM-4-MoE", scaling=1.0, dense=1),
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        qk_norm=d.get("use_qk_norm", False),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5))),
        rms_norm_eps=d.get("rms_norm_eps", 1e-5),
        max_position_embeddings=d.get("max_position_embeddings", 131072),
    )


GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def _gpt_oss_keys(d: dict) -> dict:
    """gpt-oss's keys, as transformers' GptOssConfig reads them (its defaults where a key may be
    absent): every layer MoE, experts of intermediate_size, layer_types alternating sliding and
    full attention unless given."""
    L = d["num_hidden_layers"]
    types = tuple(d.get("layer_types") or ("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)))
    if len(types) != L or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ConfigError(f"layer_types in config.json must name sliding_attention or full_attention for each of "
                          f"the {L} layers, got {list(types)}")
    window = d.get("sliding_window", 128)
    if "sliding_attention" in types and not (window and window > 0):
        raise ConfigError(f"sliding_window {window!r}: sliding_attention layers need a positive window")
    # transformers' GptOssConfig fills in its yarn when the config names no rope at all
    no_rope = not d.get("rope_scaling") and not d.get("rope_parameters")
    return dict(
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        num_experts=d["num_local_experts"],
        rope_theta=(d.get("rope_parameters") or {}).get("rope_theta", d.get("rope_theta", 150000.0)),
        **({"rope_scaling": dict(GPT_OSS_YARN)} if no_rope else {}),
        attention_bias=d.get("attention_bias", True),
        qk_norm=False,
        rms_norm_eps=d.get("rms_norm_eps", 1e-5),
        layer_types=types,
        sliding_window=window,
        attention_sinks=True,
        router_bias=True,
        expert_bias=True,
        swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(d.get("swiglu_limit", 7.0)),
    )


FAMILIES = (
    Family("qwen3_moe", "Qwen3-MoE", ("Qwen3MoeForCausalLM",), _qwen3_moe_keys),
    Family("deepseek_v3", "DeepSeek-V3", ("DeepseekV3ForCausalLM",), _deepseek_v3_keys),
    Family("glm4_moe", "GLM-4-MoE", ("Glm4MoeForCausalLM",), _glm4_moe_keys),
    Family("gpt_oss", "gpt-oss", ("GptOssForCausalLM",), _gpt_oss_keys,
           aliases={"moe_intermediate_size": "intermediate_size", "num_experts": "num_local_experts"}),
)
SUPPORTED_ARCHITECTURES = tuple(a for f in FAMILIES for a in f.architectures)


def family_of(d: dict) -> Family:
    """The family of a config.json, by its `architectures`."""
    archs = d.get("architectures") or []
    for f in FAMILIES:
        if any(a in f.architectures for a in archs):
            return f
    raise ConfigError(f"unsupported architecture {archs or d.get('model_type')!r}: "
                      f"Ostinato supports {', '.join(SUPPORTED_ARCHITECTURES)}")


def parse_bytes(text: str) -> int:
    """'32GiB', '12GB', '512MiB', '1000000' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1, "": 1}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = None
    if unit not in units or value is None or value < 0:
        raise ConfigError(f"cannot read {text!r} as a size (examples: 32GiB, 12GB, 512MiB)")
    return int(value * units[unit])


def cache_root() -> Path:
    """Where Ostinato keeps what it builds and learns (the CPU kernels, synthetic tokenizers, plans):
    $OSTINATO_CACHE, default ~/.cache/ostinato."""
    return Path(os.environ.get("OSTINATO_CACHE") or Path.home() / ".cache" / "ostinato").expanduser()
