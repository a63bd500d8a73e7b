"""Synthetic checkpoints: tokenizer + config + weights, on disk or in memory.

`write_checkpoint` writes exactly the Hugging Face layout of the preset's family (config.json,
sharded safetensors with an index, tokenizer.json, tokenizer_config.json with the chat
template, generation_config.json). `write_gguf_file` writes the same model as one
llama.cpp qwen3moe GGUF file in a quantization recipe (synth/gguf_writer.py). `synth_source`
gives the same model without the disk: the tokenizer is trained once and cached, the
weights are generated on demand.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from ostinato.config import cache_root
from ostinato.synth.gguf_writer import write_gguf
from ostinato.synth.presets import TOKENIZER_VOCAB, Regime, preset_config
from ostinato.synth.source import SynthSource
from ostinato.synth.weights import SynthSpec

SHARD_BYTES = 4 * 2**30


def find_workloads() -> Path | None:
    """The recorded sessions, if this checkout sits beside them (../shared/workloads)."""
    env = os.environ.get("OSTINATO_WORKLOADS")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    candidates += [p / "shared" / "workloads" for p in (Path.cwd().parent, *here.parents)]
    return next((p for p in candidates if p.is_dir()), None)


def training_texts(max_chars: int = 24_000_000) -> tuple[list[str], str]:
    """Agent-like text for the tokenizer: the recorded workloads, else generated sessions."""
    from ostinato.sessions.read import load_sessions
    from ostinato.sessions.text import session_texts

    workloads = find_workloads()
    sessions = load_sessions(str(workloads) if workloads else "embedded")
    texts, total = [], 0
    for t in session_texts(sessions):
        texts.append(t)
        total += len(t)
        if total >= max_chars:
            break
    return texts, text_origin()


def text_origin() -> str:
    workloads = find_workloads()
    return f"workloads:{workloads.resolve()}" if workloads else "embedded"


def train_for(preset: str, out_dir: Path):
    from ostinato.synth.tokenizer import train_tokenizer

    texts, _ = training_texts()
    return train_tokenizer(texts, TOKENIZER_VOCAB[preset], out_dir)


def cached_tokenizer(preset: str) -> Path:
    """Train the preset's tokenizer once per vocabulary size and text origin (presets of one
    size share it); later calls reuse it."""
    here = Path(__file__).parent
    trainer = (here / "tokenizer.py").read_bytes() + (here / "chat_template.py").read_bytes()
    vocab = TOKENIZER_VOCAB[preset]
    key = hashlib.sha1(f"{vocab}:{text_origin()}".encode() + trainer).hexdigest()[:12]
    d = cache_root() / "tokenizers" / f"bpe{vocab}-{key}"
    if not (d / "tokenizer.json").is_file():
        tmp = d.with_name(d.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        train_for(preset, tmp)
        tmp.rename(d) if not d.exists() else None
    return d


def model_config(spec: SynthSpec, tok_dir: Path) -> dict:
    tc = json.loads((tok_dir / "tokenizer_config.json").read_text())
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    cfg = dict(spec.config)
    cfg["bos_token_id"] = specials["<|endoftext|>"]
    cfg["eos_token_id"] = specials[tc.get("eos_token", "<|im_end|>")]
    return cfg


def tokenizer_vocab_size(tok_dir: Path) -> int:
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())
    ids = list(vocab["model"]["vocab"].values()) + [t["id"] for t in vocab["added_tokens"]]
    return max(ids) + 1


def synth_spec(preset: str, tok: Path, seed: int = 0, layers: int | None = None, skew: float | None = None,
               regime: Regime | None = None) -> SynthSpec:
    return SynthSpec(preset, layers, seed, skew, active_vocab=tokenizer_vocab_size(tok), regime=regime or Regime(),
                     tokenizer_dir=tok)


def synth_source(preset: str, seed: int = 0, layers: int | None = None, skew: float | None = None,
                 regime: Regime | None = None):
    preset_config(preset, layers)  # a clear error for an unknown preset or layer count, before training
    tok = cached_tokenizer(preset)
    spec = synth_spec(preset, tok, seed, layers, skew, regime)
    return SynthSource(spec, tok, model_config(spec, tok))


def generation_config(cfg: dict) -> dict:
    return {"bos_token_id": cfg["bos_token_id"], "eos_token_id": [cfg["eos_token_id"], cfg["bos_token_id"]],
            "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
            "transformers_version": cfg["transformers_version"]}


def write_checkpoint(preset: str, out: Path, seed: int = 0, layers: int | None = None,
                     skew: float | None = None, progress=None, regime: Regime | None = None) -> Path:
    """Write a synthetic checkpoint directory; returns it."""
    import shutil

    preset_config(preset, layers)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = cached_tokenizer(preset)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, out / f)
    spec = synth_spec(preset, tok, seed, layers, skew, regime)
    cfg = model_config(spec, tok)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(cfg), indent=2) + "\n")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shards, cur, size = [], [], 0
    for name, shape in spec.shapes.items():
        nbytes = spec.dtype_of(name).itemsize * int(torch.Size(shape).numel())
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nbytes
    shards.append(cur)
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: spec.tensor(n, device=device, dtype=spec.dtype_of(n)).cpu() for n in names}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, out / fname, metadata={"format": "pt"})
        weight_map |= {n: fname for n in names}
        if progress:
            progress(i + 1, len(shards))
    synth = {"preset": preset, "seed": seed, "layers": layers, "skew": skew}
    if not spec.regime.is_flat:  # a flat model's files stay as they were
        synth["regime"] = dataclasses.asdict(spec.regime)
    index = {"metadata": {"total_size": total, "ostinato_synth": synth}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def write_gguf_file(preset: str, out: Path, quant: str = "BF16", seed: int = 0, layers: int | None = None,
                    skew: float | None = None, progress=None, regime: Regime | None = None) -> Path:
    """Write a synthetic model as OUT/{preset}-{quant}.gguf, generated straight into the writer
    (no Hugging Face copy on disk); the same values as `write_checkpoint`. Returns the file."""
    source = synth_source(preset, seed, layers, skew, regime)
    return write_gguf(source, Path(out) / f"{preset}-{quant}.gguf", quant, name=preset,
                      generation=generation_config(source.config.raw), progress=progress)
