"""A weight source -> the dense model on a device, and the routed experts stacked per layer.

The dense part (attention, norms, routers, embeddings, dense MLPs) is built on the meta
device and materialised once where the runner says; each parameter is loaded by its
Hugging Face name with a shape check. Experts are loaded separately, because where
they live (GPU, page-locked host memory, a pool) is the runner's decision, not the
model's. A GGUF source also gives them in their block formats (`load_quantized_experts`),
as the quantized kernels read them; `load_experts` dequantizes them for the bf16 path.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ostinato.config import ConfigError, ModelConfig
from ostinato.layers.moe.gpu_quant import QUANT_QTYPES  # the block formats both branches compute
from ostinato.layers.moe.types import ExpertWeights, QuantExpertWeights
from ostinato.layers.quant_linear import keep_quantized_
from ostinato.models.common import MoECausalLM
from ostinato.models.registry import cast_, new_model
from ostinato.quant.formats import row_bytes
from ostinato.threads import LOAD_JOBS


def host_embedding(cfg: ModelConfig, device: torch.device | str) -> bool:
    """Whether the token embedding lives in pinned host memory rather than on `device`: on a GPU,
    unless the head is tied to it (the head reads the whole table every step). A pass reads only
    its tokens' rows (4 KB each for Qwen3-30B-A3B in bf16), and the table (622 MB there) is GPU
    memory the expert pool can hold instead; llama.cpp keeps token_embd on the host alike."""
    return torch.device(device).type == "cuda" and not cfg.tie_word_embeddings


def build_model(source, device: torch.device | str, dtype: torch.dtype | None = None,
                quantized: dict[str, str] | None = None) -> MoECausalLM:
    """The config's family (models/registry.py) in `dtype` (its fp32_params in fp32) on `device`,
    the embedding in pinned host memory where host_embedding says so, and the linear weights named
    in `quantized` (dense_formats) in their blocks (layers/quant_linear.py QuantLinear)."""
    cfg: ModelConfig = source.config
    dtype = dtype or cfg.torch_dtype
    model = keep_quantized_(cast_(new_model(cfg), dtype), quantized or {})
    embed = model.model.embed_tokens
    if host_embedding(cfg, device):  # materialised apart: never on the device, not even for a moment
        model.model.embed_tokens = None
        model.to_empty(device=device)
        w = embed.weight
        embed.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, pin_memory=True), requires_grad=False)
        model.model.embed_tokens = embed
    else:
        model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty gives each module its own tensor: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    known = set(source.names())
    for name, p in model.named_parameters():
        if name not in known:
            raise ConfigError(f"the checkpoint lacks tensor {name!r} that config.json implies")
        with torch.no_grad():
            source.load_(name, p.data)
    for name in quantized or {}:
        source.load_quantized_(name, model.get_submodule(name.removesuffix(".weight")).qweight)
    return model.eval().requires_grad_(False)


def dense_formats(source, mode: str = "native") -> dict[str, str]:
    """The dense linear weights a GPU keeps in their GGUF blocks: parameter name -> qtype, for every
    nn.Linear of the model whose weight the source stores in a format the kernels read
    (QUANT_QTYPES), but a head tied to the embedding (the table stays one float tensor). {} for a
    checkpoint, a float file and mode "bf16" (everything dequantized at load)."""
    check_mode(mode)
    qtype_of = getattr(source, "dense_qtype", None)
    if qtype_of is None or mode != "native":
        return {}
    cfg = source.config
    out = {}
    for name, m in new_model(cfg).named_modules():
        if isinstance(m, nn.Linear) and not (name == "lm_head" and cfg.tie_word_embeddings):
            qt = qtype_of(f"{name}.weight")
            if qt in QUANT_QTYPES:
                out[f"{name}.weight"] = qt
    return out


class WeightFormats(NamedTuple):
    """What a GPU keeps of a file's weights in their block formats (weight_formats): each MoE layer's
    experts (qt13, qt2), None where float; the dense linear weights, parameter name -> qtype."""

    experts: dict[int, tuple[str, str] | None] = {}
    dense: dict[str, str] = {}  # WeightFormats(): everything in the compute dtype


def weight_formats(source, mode: str = "native") -> WeightFormats:
    """expert_formats and dense_formats together: what the capacity test counts in real bytes."""
    return WeightFormats(expert_formats(source, mode), dense_formats(source, mode))


def alloc_biases(cfg: ModelConfig, device, pin: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """fp32 b13 [E, 2F] and b2 [E, D] for experts with biases (gpt-oss), else (None, None)."""
    if not cfg.expert_bias:
        return None, None
    E, F, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    return (torch.empty((E, 2 * F), device=device, pin_memory=pin),
            torch.empty((E, D), device=device, pin_memory=pin))


def bias_args(w) -> dict:
    """A source's load_*experts_ keyword arguments for w's biases (none without)."""
    return {} if w.b13 is None else {"b13": w.b13, "b2": w.b2}


def alloc_experts(cfg: ModelConfig, device, dtype: torch.dtype, pin: bool = False) -> ExpertWeights:
    E, F, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    w13 = torch.empty((E, 2 * F, D), dtype=dtype, device=device, pin_memory=pin)
    w2 = torch.empty((E, D, F), dtype=dtype, device=device, pin_memory=pin)
    return ExpertWeights(w13, w2, *alloc_biases(cfg, device, pin), cfg.expert_act)


def load_experts(source, layer: int, device="cpu", dtype=None, pin: bool = False) -> ExpertWeights:
    """One layer's experts, stacked, in memory allocated once (page-locked if `pin`), with their
    fp32 biases and their activation where the model's experts have them."""
    cfg = source.config
    w = alloc_experts(cfg, device, dtype or cfg.torch_dtype, pin)
    with torch.no_grad():
        source.load_experts_(layer, w.w13, w.w2, **bias_args(w))
    return w


def stage_on(source, device, load):
    """load(device) where the source makes its tensors on `device`, else load(cpu): a layer's experts
    staged where copying them on costs least. A synthetic model generates on the GPU: staged there, a
    layer makes no round trip through pageable host memory (about 3x faster to build for the 30B
    model; on an H100, copying a gpt-oss-120b expert's MXFP4 gate_up into pageable memory took 4.9 ms,
    into page-locked memory 0.2 ms, and the loader's whole expert 11.2 ms into pageable memory:
    results/2026-12-07-h100-s47). A layer staged on the GPU is transient memory the
    capacity test does not hold: when a nearly full pool under the cap leaves no room for it, it is
    staged in host memory instead."""
    device = torch.device(device)
    if getattr(source, "generate_on", None) == device.type:
        try:
            return load(device)
        except torch.OutOfMemoryError:
            pass
    return load(torch.device("cpu"))


def load_experts_staged(source, layer: int, device, dtype=None) -> ExpertWeights:
    """One layer's float experts, staged by stage_on."""
    return stage_on(source, device, lambda d: load_experts(source, layer, device=d, dtype=dtype))


def load_jobs(source, device) -> int:
    """Layers a load may copy at once (threads.on_workers): LOAD_JOBS from a file, one where the
    source makes its experts on `device` (stage_on stages a whole layer there: memory the capacity
    test does not hold, once per layer in flight)."""
    return 1 if getattr(source, "generate_on", None) == torch.device(device).type else LOAD_JOBS


def load_all_experts(source, device="cpu", dtype=None, pin: bool = False) -> dict[int, ExpertWeights]:
    return {i: load_experts(source, i, device, dtype, pin) for i in source.config.moe_layers}


def alloc_quantized_experts(cfg: ModelConfig, qt13: str, qt2: str, device, pin: bool = False) -> QuantExpertWeights:
    """uint8 w13 [E, 2F, row_bytes(qt13, D)] and w2 [E, D, row_bytes(qt2, F)]."""
    E, F, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    w13 = torch.empty((E, 2 * F, row_bytes(qt13, D)), dtype=torch.uint8, device=device, pin_memory=pin)
    w2 = torch.empty((E, D, row_bytes(qt2, F)), dtype=torch.uint8, device=device, pin_memory=pin)
    return QuantExpertWeights(qt13, w13, qt2, w2, *alloc_biases(cfg, device, pin), cfg.expert_act)


def load_quantized_experts(source, layer: int, device="cpu", pin: bool = False) -> QuantExpertWeights:
    """One layer's experts in the source's block formats (a GGUF source: `expert_qtypes`), stacked,
    in memory allocated once (page-locked if `pin`)."""
    qt13, qt2 = source.expert_qtypes(layer)
    w = alloc_quantized_experts(source.config, qt13, qt2, device, pin)
    source.load_quantized_experts_(layer, w.w13, w.w2, **bias_args(w))
    return w


EXPERT_MODES = ("native", "bf16")  # weights in their file's block formats on the GPU, or dequantized at load


def check_mode(mode: str) -> None:
    """ConfigError unless `mode` is one of EXPERT_MODES."""
    if mode not in EXPERT_MODES:
        raise ConfigError(f"experts {mode!r}: give one of {', '.join(EXPERT_MODES)}")


def expert_formats(source, mode: str = "native") -> dict[int, tuple[str, str] | None]:
    """Each MoE layer's (qt13, qt2) where its experts stay in their GGUF block formats, else None
    (float weights: a checkpoint, a float GGUF tensor, or mode "bf16", which dequantizes at load).
    A layer whose gate/up or down is a float type while the other is blocks is dequantized whole:
    the expert kernels read one kind per layer."""
    check_mode(mode)
    qtypes_of = getattr(source, "expert_qtypes", None)
    out: dict[int, tuple[str, str] | None] = {}
    for layer in source.config.moe_layers:
        qt = qtypes_of(layer) if qtypes_of is not None and mode == "native" else None
        out[layer] = qt if qt is not None and all(q in QUANT_QTYPES for q in qt) else None
    return out


def load_layer_experts(source, layer: int, qtypes: tuple[str, str] | None, device, dtype=None):
    """One layer's experts as the pool and host copies keep them: the file's blocks when `qtypes`
    (expert_formats) says so, else float (dequantized if need be); either staged by stage_on."""
    if qtypes is None:
        return load_experts_staged(source, layer, device, dtype)
    w = stage_on(source, device, lambda d: load_quantized_experts(source, layer, d))
    if (w.qt13, w.qt2) != tuple(qtypes):
        raise ConfigError(f"layer {layer}: experts are {w.qt13}/{w.qt2}, the placement expected {'/'.join(qtypes)}")
    return w
