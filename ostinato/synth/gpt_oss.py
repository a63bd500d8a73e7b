"""The tensors of a synthetic gpt-oss that Qwen3's generator does not know: in the Hugging Face
layout transformers' GptOssForCausalLM loads (fused, transposed, gate/up interleaved experts with
biases, MXFP4 blocks when the preset's config says so), attention biases and sinks, and the
router (a linear with a bias).

The routing skew is synth/weights.py's: residual channel 0 is constant, the router's column 0
carries the per-expert bias, the regime's channels follow; every reader of the stream (the
experts' gate_up_proj reads it along its dim 1 here) has zeros there, every writer (o_proj and
the experts' down_proj, their biases too) leaves those channels alone. The router's own bias
is a small random vector: it exercises the bias and shifts routing without shaping the skew.
The persistence regime's local-attention head is built from Qwen3's q/k norms, which gpt-oss
has not: it is refused; depth and content apply.

Each expert's slice of a fused tensor has a key of its own (name + expert), so an expert is
generated alone (a synthetic source builds gpt-oss-120b's experts one at a time) and equals
its slice of the whole. MXFP4 blocks are the bf16 weights quantized by quant/formats.py (GGUF
MXFP4, then repacked to Hugging Face's layout): a checkpoint's blocks and an in-memory model's
are the same bytes, and the bf16 and MXFP4 presets of one seed share their float weights.

Legend: E experts, D hidden, F expert FFN size, H heads, Hkv KV heads, Hd head dim.
"""
from __future__ import annotations

import torch

from ostinato.loader import gpt_oss as layout
from ostinato.quant import formats
from ostinato.quant.mxfp4 import to_hf
from ostinato.synth.hashrand import fill_uniform_, tensor_key

BIAS_STD = {"q_proj": 0.1, "k_proj": 0.1, "v_proj": 0.1, "o_proj": 0.1, "router": 0.05, "gate_up_proj": 0.5,
            "down_proj": 0.1}
SINK_STD = 1.0  # the sinks' logits, against attention scores of about unit size


def is_mxfp4(c: dict) -> bool:
    qc = c.get("quantization_config") or {}
    return qc.get("quant_method") == "mxfp4"


def shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, in transformers' naming, in a fixed order."""
    D, E, F, V = c["hidden_size"], c["num_local_experts"], c["intermediate_size"], c["vocab_size"]
    H, Hkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    experts = layout.mxfp4_shapes(E, D, F) if is_mxfp4(c) else layout.float_shapes(E, D, F)
    out = {"model.embed_tokens.weight": (V, D)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (D,)
        for proj, rows, cols in (("q_proj", H * hd, D), ("k_proj", Hkv * hd, D), ("v_proj", Hkv * hd, D),
                                 ("o_proj", D, H * hd)):
            out[f"{p}self_attn.{proj}.weight"] = (rows, cols)
            out[f"{p}self_attn.{proj}.bias"] = (rows,)
        out[p + "self_attn.sinks"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (D,)
        out[p + "mlp.router.weight"] = (E, D)
        out[p + "mlp.router.bias"] = (E,)
        out |= {layout.prefix(i) + suffix: shape for suffix, shape in experts.items()}
    out["model.norm.weight"] = (D,)
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (V, D)
    return out


def owns(name: str) -> bool:
    """The tensors this module fills (the rest are Qwen3's kinds: synth/weights.py)."""
    return name.endswith((".bias", ".sinks", "mlp.router.weight")) or ".mlp.experts." in name


def dtype_of(name: str) -> torch.dtype:
    return torch.uint8 if name.endswith(("_blocks", "_scales")) else torch.bfloat16


def fill_(spec, name: str, out: torch.Tensor) -> torch.Tensor:
    """Write tensor `name` (one `owns`) into `out`, any device."""
    c = spec.config
    R = spec.reserved
    writer_scale = 0.5 / c["num_hidden_layers"] ** 0.5
    key = tensor_key(spec.seed, name)
    if name.endswith(".sinks"):
        return fill_uniform_(out, key, SINK_STD)
    if name.endswith("mlp.router.weight"):
        fill_uniform_(out, key, out.shape[1] ** -0.5)
        layer = int(name.split(".")[2])
        out[:, 0] = spec.router_bias(layer).to(out.device, out.dtype)
        spec._router_regime_(layer, out)
        return out
    if ".mlp.experts." in name and not name.endswith("_bias"):
        for e in range(out.shape[0]):
            out[e].copy_(expert_slice(spec, name, e, out.device))
        return out
    last = name.rsplit(".", 1)[-1]  # "bias", or an expert bias: "gate_up_proj_bias", "down_proj_bias"
    kind = last.removesuffix("_bias") if last != "bias" else name.rsplit(".", 2)[-2]  # q_proj, ..., router
    fill_uniform_(out, key, BIAS_STD[kind] * (writer_scale if kind in ("o_proj", "down_proj") else 1.0))
    if kind in ("o_proj", "down_proj"):  # writers' biases leave the reserved channels alone
        out[..., :R] = 0
    return out


def expert_slice(spec, name: str, e: int, device) -> torch.Tensor:
    """Expert e's slice of a fused expert weight (float, or MXFP4 blocks / scales)."""
    if name.endswith(("_blocks", "_scales")):
        blocks, scales = mxfp4_expert(spec, name.rsplit("_", 1)[0], e, device)
        return blocks if name.endswith("_blocks") else scales
    return float_expert(spec, name, e, device)


def float_expert(spec, name: str, e: int, device) -> torch.Tensor:
    """gate_up_proj [D, 2F] or down_proj [F, D] of expert e, bf16 values (fp32 tensor)."""
    c = spec.config
    D, F, R = c["hidden_size"], c["intermediate_size"], spec.reserved
    gate_up = name.endswith("gate_up_proj")
    out = torch.empty((D, 2 * F) if gate_up else (F, D), device=device)
    std = D ** -0.5 if gate_up else F ** -0.5 * 0.5 / c["num_hidden_layers"] ** 0.5
    fill_uniform_(out, tensor_key(spec.seed, f"{name}.{e}"), std)
    if gate_up:
        out[:R, :] = 0  # reads the stream along D
    else:
        out[:, :R] = 0  # writes it along D
    return out.bfloat16().float()


def mxfp4_expert(spec, base: str, e: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's gate_up_proj / down_proj (`base`, without the suffix) as Hugging Face MXFP4
    blocks [rows, G, 16] and scales [rows, G]: the bf16 weight, rows = output features, quantized."""
    w = float_expert(spec, base, e, device).T.contiguous()  # [2F, D] interleaved rows, or [D, F]
    return to_hf(formats.quantize(w, "MXFP4"))


def reader(spec, device):
    """The loader's read(name, e) (loader/gpt_oss.py) over the generated tensors. The loader
    asks for an expert's MXFP4 blocks, then its scales: both come from one quantization."""
    last: dict = {}

    def read(name: str, e: int | None) -> torch.Tensor:
        if e is None:  # a bias: the checkpoint's bf16 values
            return spec.tensor(name, device=device, dtype=dtype_of(name)).float()
        if not name.endswith(("_blocks", "_scales")):
            return float_expert(spec, name, e, device)
        base = name.rsplit("_", 1)[0]
        if last.get("key") != (base, e):
            last["key"], last["value"] = (base, e), mxfp4_expert(spec, base, e, device)
        blocks, scales = last["value"]
        return blocks if name.endswith("_blocks") else scales
    return read
