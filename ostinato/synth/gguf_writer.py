"""A Qwen3-MoE checkpoint as a qwen3moe GGUF file: llama.cpp's names, metadata and quantization recipes.

What llama.cpp's convert_hf_to_gguf.py and then llama-quantize make of a checkpoint, in one
pass and without llama.cpp, so that llama-server, transformers and Ostinato's GGUF source
(loader/gguf.py) load the same synthetic model in the same block formats. The tensors come
from any weight source (a checkpoint directory, or a synthetic model generated on the GPU),
one at a time, and are quantized with ostinato/quant/formats.py where they were made.

Recipes, as llama.cpp's file types of the same names (src/llama-quant.cpp):
- BF16: every matrix in bf16 (convert_hf_to_gguf.py --outtype bf16);
- Q8_0: every matrix Q8_0 (--outtype q8_0);
- Q4_K_M: Q4_K, but Q6_K for output.weight and, on the layers where `use_more_bits` holds,
  for attn_v and ffn_down_exps;
- MXFP4_MOE: the 3-D expert tensors MXFP4, every other matrix Q8_0.
In all of them the norms (1-D) and the router (ffn_gate_inp) stay F32. A row that a block
type cannot hold falls back as llama-quantize does: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0,
then F16 (Q5_0/Q5_1 through gguf.quants: llama.cpp's formats, not the expert kernels').

The tokenizer goes in as llama.cpp's converter writes it (gpt2-style BPE: tokens padded with
[PADn] to the embedding's rows, token types, merges, special ids, chat template), under the
pre-tokenizer name llama.cpp knows for its split (Qwen2's; anything else is refused).

Legend: E experts, F expert FFN size, D hidden, V vocabulary (embedding rows).
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from math import prod
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFWriter,
    LlamaFileType,
    TokenType,
)

from ostinato.config import ConfigError, ModelConfig
from ostinato.loader.gguf import (
    ARCHITECTURE,
    EXPERT_TENSORS,
    LAYER_TENSORS,
    MODEL_TENSORS,
    expert_tensor_name,
)
from ostinato.loader.tokenizer import GGUF_PRE_TOKENIZERS
from ostinato.quant import formats

RECIPES = {"BF16": LlamaFileType.MOSTLY_BF16, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
           "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M, "MXFP4_MOE": LlamaFileType.MOSTLY_MXFP4_MOE}
# llama-quantize's types for rows that are not a whole number of blocks
FALLBACKS = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's layers that get more bits: the first and last eighth, and every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_qtype(recipe: str, name: str, shape: tuple[int, ...], cfg: ModelConfig) -> str:
    """The type llama.cpp gives tensor `name` (GGUF name, PyTorch-order shape) under `recipe`."""
    if len(shape) == 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight")):
        return "F32"
    if recipe == "BF16":
        return "BF16"
    if recipe == "Q8_0":
        qtype = "Q8_0"
    elif recipe == "MXFP4_MOE":
        qtype = "MXFP4" if len(shape) == 3 else "Q8_0"
    elif recipe == "Q4_K_M":
        qtype = _q4_k_m(name, shape, cfg)
    else:
        raise ConfigError(f"unknown GGUF recipe {recipe!r} (choose from {', '.join(RECIPES)})")
    return _fit(qtype, shape[-1])


def _q4_k_m(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> str:
    """llama_tensor_get_type for LLAMA_FTYPE_MOSTLY_Q4_K_M, the branches a qwen3moe file reaches."""
    output = name == "output.weight" or (cfg.tie_word_embeddings and name == "token_embd.weight")
    if output:
        return "Q6_K" if shape[-1] % 256 == 0 else "Q8_0"
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    eight = cfg.num_experts == 8  # llama.cpp's Mixtral-shaped exceptions
    if name.endswith("attn_v.weight"):
        return "Q8_0" if eight else "Q6_K" if use_more_bits(layer, cfg.num_hidden_layers) else "Q4_K"
    if name.endswith("attn_k.weight") and eight:
        return "Q8_0"
    if name.endswith("attn_output.weight") and eight:
        return "Q5_K"
    if "ffn_down" in name and use_more_bits(layer, cfg.num_hidden_layers):
        return "Q6_K"
    return "Q4_K"


def _block(qtype: str) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]


def _fit(qtype: str, n: int) -> str:
    """qtype if a row of n values is a whole number of its blocks, else llama-quantize's fallback."""
    if n % _block(qtype) == 0:
        return qtype
    fallback = FALLBACKS.get(qtype, "F16")
    return fallback if n % _block(fallback) == 0 else "F16"


def _nbytes(qtype: str, shape: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return prod(shape[:-1]) * (shape[-1] // block) * size


def _encode(w: torch.Tensor, qtype: str) -> np.ndarray:
    """float [..., n] -> the GGUF bytes uint8 [..., row bytes]; formats.py for the types the
    engine reads, gguf.quants for llama.cpp's fallbacks."""
    if qtype in formats.QTYPES:
        return formats.quantize(w, qtype).cpu().numpy()
    return gguf.quants.quantize(w.float().cpu().numpy(), GGMLQuantizationType[qtype])


def check_writable(cfg: ModelConfig) -> None:
    """ConfigError for what llama.cpp's qwen3moe cannot express (it would run a different model)."""
    if cfg.family != "qwen3_moe":
        raise ConfigError(f"cannot write a {cfg.family} checkpoint as a GGUF file: the writer knows llama.cpp's "
                          "qwen3moe only (write the Hugging Face checkpoint instead)")
    problems = []
    if not cfg.norm_topk_prob:
        problems.append("norm_topk_prob is false (llama.cpp's qwen3moe always renormalises the top-k weights)")
    if cfg.moe_layers != list(range(cfg.num_hidden_layers)):
        problems.append("some layers are dense (mlp_only_layers / decoder_sparse_step): qwen3moe has experts in all")
    if cfg.attention_bias:
        problems.append("attention_bias is true (qwen3moe has no attention biases)")
    if cfg.rope_scaling:
        problems.append(f"rope scaling {cfg.rope_scaling} is not written to GGUF yet")
    if problems:
        raise ConfigError("cannot write this checkpoint as a qwen3moe GGUF file: " + "; ".join(problems))


def layout(source) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, what to load, PyTorch-order shape) of every tensor, in file order. What to
    load is a Hugging Face name, or 'experts.{layer}.{proj}' for a layer's stacked experts."""
    cfg: ModelConfig = source.config
    E, F, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    hf_of = {v: k for k, v in MODEL_TENSORS.items()}
    out = [("token_embd.weight", hf_of["token_embd.weight"], None)]
    for i in range(cfg.num_hidden_layers):
        out += [(f"blk.{i}.{g}", f"model.layers.{i}.{hf}", None) for hf, g in LAYER_TENSORS.items()]
        out += [(expert_tensor_name(i, p), f"experts.{i}.{p}", (E, D, F) if p == "down_proj" else (E, F, D))
                for p in EXPERT_TENSORS]
    out.append(("output_norm.weight", hf_of["output_norm.weight"], None))
    if not cfg.tie_word_embeddings:
        out.append(("output.weight", hf_of["output.weight"], None))
    return [(g, what, shape or tuple(source.shape(what))) for g, what, shape in out]


def _values(source, plan, device) -> Iterator[torch.Tensor]:
    """The values of each tensor of `plan`, in order, in the checkpoint's dtype (a synthetic
    source rounds to it as `write_checkpoint` does); a layer's experts load once."""
    dtype = source.config.torch_dtype
    experts = {}
    for _, what, shape in plan:
        if not what.startswith("experts."):
            yield source.load_(what, torch.empty(shape, dtype=dtype, device=device))
            continue
        _, layer, proj = what.split(".")
        if proj == "gate_proj":  # first of the three: load the layer's w13 [E, 2F, D] and w2 [E, D, F]
            E, F, D = shape
            w13 = torch.empty((E, 2 * F, D), dtype=dtype, device=device)
            w2 = torch.empty((E, D, F), dtype=dtype, device=device)
            source.load_experts_(int(layer), w13, w2)
            experts = {"gate_proj": w13[:, :F], "up_proj": w13[:, F:], "down_proj": w2}
        yield experts.pop(proj)


def write_gguf(source, out: str | Path, recipe: str = "BF16", *, name: str | None = None,
               tokenizer_dir: str | Path | None = None, generation: dict | None = None,
               device: str | torch.device | None = None, progress=None) -> Path:
    """Write `source` (a weight source: config, shapes, load_) as one qwen3moe GGUF file.

    The tokenizer is read from `tokenizer_dir` (default: the source's); `generation` holds
    generation_config.json's sampling defaults (default: that file beside the tokenizer, if
    any). Tensors are made and quantized on `device` (default: cuda if present), one at a time.
    """
    if recipe not in RECIPES:
        raise ConfigError(f"unknown GGUF recipe {recipe!r} (choose from {', '.join(RECIPES)})")
    cfg: ModelConfig = source.config
    check_writable(cfg)
    tok_dir = Path(tokenizer_dir or source.tokenizer_dir)
    if generation is None and (tok_dir / "generation_config.json").is_file():
        generation = json.loads((tok_dir / "generation_config.json").read_text())
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plan = tensor_plan(source, recipe)
    need, free = plan_bytes(plan), shutil.disk_usage(out.parent).free
    if need > free:  # before the first byte, not at 90% of a file the disk cannot hold
        raise ConfigError(f"{out}: a {recipe} file of {cfg.num_hidden_layers} layers takes {need / 1e9:.1f} GB, and "
                          f"{out.parent} has {free / 1e9:.1f} GB free: write fewer layers (--layers) or elsewhere")

    writer = GGUFWriter(out, ARCHITECTURE)
    _add_model_metadata(writer, cfg, recipe, name or out.stem, generation or {})
    _add_tokenizer_metadata(writer, cfg, tok_dir)
    for g, _, shape, qtype in plan:
        nbytes = _nbytes(qtype, shape)
        writer.add_tensor_info(g, (*shape[:-1], nbytes // prod(shape[:-1])), np.dtype(np.uint8), nbytes,
                               raw_dtype=GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    values = _values(source, [(g, what, shape) for g, what, shape, _ in plan], device)
    with torch.no_grad():
        for i, ((_, _, _, qtype), w) in enumerate(zip(plan, values)):
            writer.write_tensor_data(_encode(w.float(), qtype))
            if progress:
                progress(i + 1, len(plan))
    writer.close()
    return out


def tensor_plan(source, recipe: str) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(GGUF name, what, shape, qtype) of each tensor of `source` in a `recipe` file, in file order."""
    return [(g, what, shape, tensor_qtype(recipe, g, shape, source.config)) for g, what, shape in layout(source)]


def plan_bytes(plan) -> int:
    return sum(_nbytes(qt, shape) for _, _, shape, qt in plan)


def gguf_bytes(source, recipe: str) -> int:
    """The tensor bytes of `source` written as a `recipe` file (its metadata aside)."""
    return plan_bytes(tensor_plan(source, recipe))


def _add_model_metadata(w: GGUFWriter, cfg: ModelConfig, recipe: str, name: str, generation: dict) -> None:
    w.add_type("model")
    w.add_name(name)
    for key, add in (("top_k", w.add_sampling_top_k), ("top_p", w.add_sampling_top_p),
                     ("temperature", w.add_sampling_temp)):
        if generation.get(key) is not None:
            add(generation[key])
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_file_type(RECIPES[recipe])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_tokenizer_metadata(w: GGUFWriter, cfg: ModelConfig, tok_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json -> llama.cpp's tokenizer.ggml.* keys and the template."""
    spec = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tc = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    _check_tokenizer(spec, tok_dir)
    text_of = {i: t for t, i in spec["model"]["vocab"].items()}
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    text_of |= {i: t["content"] for i, t in added.items()}
    V = cfg.vocab_size
    if max(text_of) >= V:
        raise ConfigError(f"{tok_dir}: the tokenizer has ids up to {max(text_of)}, beyond the {V} embedding rows")
    tokens, types = [], []
    for i in range(V):
        if i not in text_of:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            t = text_of[i]
            special = added[i].get("special") or (t.startswith("<|") and t.endswith("|>"))
            tokens.append(t)
            types.append(TokenType.CONTROL if special else TokenType.USER_DEFINED)
        else:
            tokens.append(text_of[i])
            types.append(TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    ids = {t: i for i, t in enumerate(tokens)}
    if cfg.eos_token_id:
        w.add_eos_token_id(cfg.eos_token_id[0])
    pad = tc.get("pad_token")
    pad = pad.get("content") if isinstance(pad, dict) else pad
    if pad in ids:
        w.add_pad_token_id(ids[pad])
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    w.add_add_bos_token(bool(tc.get("add_bos_token", False)))
    w.add_add_eos_token(bool(tc.get("add_eos_token", False)))
    jinja = tok_dir / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8") if jinja.is_file() else tc.get("chat_template")
    if template:
        w.add_chat_template(template)


def _check_tokenizer(spec: dict, tok_dir: Path) -> None:
    """A byte-level BPE with Qwen2's split, the one GGUF pre-tokenizer name we write."""
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre])
    split = next((p["pattern"].get("Regex") for p in parts if p.get("type") == "Split"), None)
    byte_level = any(p.get("type") == "ByteLevel" for p in parts)
    if spec["model"].get("type") != "BPE" or not byte_level or split != GGUF_PRE_TOKENIZERS["qwen2"]:
        raise ConfigError(f"{tok_dir}/tokenizer.json is not a byte-level BPE with Qwen2's pre-tokenizer split: "
                          "llama.cpp would tokenize differently, so it is not written to GGUF")
