"""A GGUF file as a weight source: llama.cpp's qwen3moe files, read in place through a memory map.

The source speaks the loader's interface (loader/source.py) in Hugging Face names, so the
model builds from a GGUF file as it does from a checkpoint directory: the dense tensors
(attention, norms, router, embeddings) are dequantized to the caller's dtype as they load.
The routed experts come two ways: `load_experts_` dequantizes them (the bf16 path, so the
reference model runs on any file this module accepts), and `load_quantized_experts_` copies
their blocks untouched, as the quantized kernels read them (ostinato/quant/formats.py); a
dense tensor's blocks come untouched too (`load_quantized_`) where a GPU keeps them
(layers/quant_linear.py).

GGUF lists a tensor's dimensions innermost first, and its bytes are those of the row-major
PyTorch tensor of the reversed shape: `blk.N.attn_q.weight` of ggml shape [D, H*Hd] is
q_proj.weight [H*Hd, D], `ffn_gate_exps` [D, F, E] is the gate rows [E, F, D], and blocks
run along the input dimension. llama.cpp's converter permutes the q/k rows for its `llama`
architecture (whose rope pairs adjacent dimensions); for qwen3moe it writes them unchanged
(NeoX rope, as in transformers), so nothing is undone here, and other architectures are
refused rather than guessed at.

What is accepted is what can be read exactly: experts in the formats the expert kernels
read (formats.QTYPES), other tensors also in llama.cpp's fallbacks for rows that are not a
multiple of 256 values (Q4_0/1, Q5_0/1, dequantized with gguf.quants). Anything else, and
any tensor this model would not use, is refused with a ConfigError naming it.

Legend: E experts, F expert FFN size, D hidden, V vocabulary, B bytes of a row.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from ostinato.config import ConfigError, ModelConfig
from ostinato.quant import formats
from ostinato.quant.formats import row_bytes

ARCHITECTURE = "qwen3moe"

# Hugging Face names -> llama.cpp's (gguf.TensorNameMap for MODEL_ARCH.QWEN3MOE).
MODEL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
EXPERT_TENSORS = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
                  "down_proj": "ffn_down_exps.weight"}

# llama.cpp's fallbacks for rows that are not a multiple of 256 (src/llama-quant.cpp): read
# for dense tensors only, which are dequantized at load anyway.
DENSE_ONLY_QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1")

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_NAME = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_EXPERT_STEP = 8  # experts dequantized at a time: bounds the fp32 temporaries
_GPU_DECODE_VALUES = 1 << 24  # values a dense tensor decodes on the GPU at a time (64 MiB of fp32)


def gguf_name(hf_name: str) -> str:
    """A dense tensor's Hugging Face name -> its GGUF name; KeyError for experts and unknowns."""
    if hf_name in MODEL_TENSORS:
        return MODEL_TENSORS[hf_name]
    m = _LAYER_NAME.fullmatch(hf_name)
    if m is None or m.group(2) not in LAYER_TENSORS:
        raise KeyError(hf_name)
    return f"blk.{m.group(1)}.{LAYER_TENSORS[m.group(2)]}"


def expert_tensor_name(layer: int, proj: str) -> str:
    """'gate_proj' of layer 3 -> 'blk.3.ffn_gate_exps.weight' (all experts of the layer, stacked)."""
    return f"blk.{layer}.{EXPERT_TENSORS[proj]}"


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file a model argument names: a .gguf file, or a directory that holds one."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    files = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(files) > 1:
        raise ConfigError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files[:4])}): "
                          "give the file itself as --model (a split model must be merged first, "
                          "with llama-gguf-split --merge)")
    return files[0] if files else None


def read_metadata(reader: GGUFReader) -> dict:
    """The key-value metadata of a GGUF file as Python values (GGUF.* header fields left out)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


_METADATA: dict[tuple, dict] = {}  # file metadata read this process, by (path, size, mtime)


def file_metadata(path: str | Path, reader: GGUFReader | None = None) -> dict:
    """read_metadata of the file at `path` (of `reader`, if given, opened on it), parsed once per
    process: a file's source and its tokenizer both need it, and a 151936-token vocabulary takes
    seconds to parse."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _METADATA:
        _METADATA.clear()  # one file at a time: a vocabulary's metadata is tens of MB
        _METADATA[key] = read_metadata(reader or GGUFReader(path))
    return _METADATA[key]


def f32_value(x: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (1e-06, not
    9.99999997e-07): so a config read from GGUF equals the config.json it was written from."""
    return float(str(np.float32(x)))


class GGUFSource:
    """A qwen3moe GGUF file (one file, not split), memory-mapped; tensors in Hugging Face names."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            # copy-on-write mapping: writable arrays for torch.from_numpy, the file never changes
            self.reader = GGUFReader(self.path, "c")
        except (ValueError, OSError) as e:
            raise ConfigError(f"{self.path}: not a readable GGUF file ({e})") from None
        self.metadata = file_metadata(self.path, self.reader)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._check_file()
        self.config = ModelConfig.from_dict(self._config_dict())
        self._dense = {hf: gguf_name(hf) for hf in self._dense_names()}
        self._check_tensors()

    @property
    def tokenizer_dir(self) -> Path:
        """The tokenizer lives in the file's metadata: ChatTokenizer.from_dir reads a .gguf path."""
        return self.path

    def names(self) -> list[str]:
        experts = [f"model.layers.{i}.mlp.experts.{e}.{p}.weight"
                   for i in self.config.moe_layers for e in range(self.config.num_experts) for p in EXPERT_TENSORS]
        return [*self._dense, *experts]

    def shape(self, name: str) -> tuple[int, ...]:
        tensor, expert = self._locate(name)
        shape = self._hf_shape(tensor)
        return shape if expert is None else shape[1:]

    def load_(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Tensor `name`, dequantized, into `out` (any device and float dtype)."""
        tensor, expert = self._locate(name)
        shape = self.shape(name)
        if shape != tuple(out.shape):
            raise ConfigError(f"{self.path}: tensor {name!r} has shape {list(shape)}, "
                              f"but the metadata implies {list(out.shape)}")
        data = tensor.data if expert is None else tensor.data[expert]
        where = _decode_device(out)
        if where is None or not out.is_contiguous() or tensor.tensor_type.name not in formats.QTYPES:
            return out.copy_(_decode(data, tensor.tensor_type, shape[-1]))
        # decoded on the GPU, rows at a time: the runner's layout leaves the load one host thread, and a
        # 235B-shaped file holds 3.5 G dense values in block formats (its load took 166 s, session 18)
        raw = torch.from_numpy(_row_bytes_view(data)).reshape(-1, row_bytes(tensor.tensor_type.name, shape[-1]))
        rows, step = out.view(-1, shape[-1]), max(1, _GPU_DECODE_VALUES // shape[-1])
        for r in range(0, raw.shape[0], step):
            part = raw[r:r + step].to(where)
            rows[r:r + step].copy_(formats.dequantize(part, tensor.tensor_type.name, shape[-1]))
        return out

    def dense_qtype(self, name: str) -> str:
        """The GGUF type of dense tensor `name` ("Q4_K", "F32", ...)."""
        return self._dense_tensor(name).tensor_type.name

    def load_quantized_(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Dense tensor `name`'s blocks as they are in the file, into uint8 out [rows, bytes of a row]."""
        raw = torch.from_numpy(_row_bytes_view(self._dense_tensor(name).data))
        raw = raw.reshape(-1, raw.shape[-1])
        if tuple(raw.shape) != tuple(out.shape):
            raise ConfigError(f"{self.path}: tensor {name!r} holds uint8 {list(raw.shape)}, expected {list(out.shape)}")
        return out.copy_(raw)

    def load_experts_(self, layer: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """All experts of a layer, dequantized, into w13 [E, 2F, D] and w2 [E, D, F]."""
        F = w2.shape[-1]
        for proj, out in (("gate_proj", w13[:, :F]), ("up_proj", w13[:, F:]), ("down_proj", w2)):
            tensor = self.tensors[expert_tensor_name(layer, proj)]
            if self._hf_shape(tensor) != tuple(out.shape):
                raise ConfigError(f"{self.path}: {tensor.name} has shape {list(self._hf_shape(tensor))}, "
                                  f"expected {list(out.shape)}")
            for e in range(0, out.shape[0], _EXPERT_STEP):
                part = tensor.data[e:e + _EXPERT_STEP]
                out[e:e + _EXPERT_STEP].copy_(_decode(part, tensor.tensor_type, out.shape[-1]))

    def expert_qtypes(self, layer: int) -> tuple[str, str]:
        """(qt13, qt2): the block formats of a layer's gate/up and down projections."""
        return (self.tensors[expert_tensor_name(layer, "gate_proj")].tensor_type.name,
                self.tensors[expert_tensor_name(layer, "down_proj")].tensor_type.name)

    def load_quantized_experts_(self, layer: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """A layer's expert blocks as they are in the file, into uint8 w13 [E, 2F, B13], w2 [E, D, B2]
        (allocate them with build.alloc_quantized_experts)."""
        F = w13.shape[1] // 2
        for proj, out in (("gate_proj", w13[:, :F]), ("up_proj", w13[:, F:]), ("down_proj", w2)):
            raw = torch.from_numpy(_row_bytes_view(self.tensors[expert_tensor_name(layer, proj)].data))
            if tuple(raw.shape) != tuple(out.shape):
                raise ConfigError(f"{self.path}: {expert_tensor_name(layer, proj)} holds uint8 {list(raw.shape)}, "
                                  f"expected {list(out.shape)}")
            out.copy_(raw)

    def _dense_tensor(self, name: str):
        if name not in self._dense:
            raise ConfigError(f"{self.path}: the GGUF file has no dense tensor {name!r}")
        return self.tensors[self._dense[name]]

    def _locate(self, name: str):
        """HF name -> (GGUF tensor, expert index or None)."""
        if name in self._dense:
            return self.tensors[self._dense[name]], None
        m = _LAYER_NAME.fullmatch(name)
        e = _EXPERT_NAME.fullmatch(m.group(2)) if m else None
        if e is None or int(m.group(1)) not in self.config.moe_layers or int(e.group(1)) >= self.config.num_experts:
            raise ConfigError(f"{self.path}: the GGUF file has no tensor {name!r}")
        return self.tensors[expert_tensor_name(int(m.group(1)), e.group(2))], int(e.group(1))

    @staticmethod
    def _hf_shape(tensor) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(tensor.shape))

    def _meta(self, key: str, default=None):
        value = self.metadata.get(f"{ARCHITECTURE}.{key}", default)
        if value is None:
            raise ConfigError(f"{self.path}: the GGUF metadata lacks {ARCHITECTURE}.{key}")
        if isinstance(value, list):  # per-layer values (some files store head counts so)
            if len(set(value)) != 1:
                raise ConfigError(f"{self.path}: {ARCHITECTURE}.{key} varies by layer ({value[:8]}...): "
                                  "Ostinato's Qwen3-MoE has one value for all layers")
            value = value[0]
        return value

    def _check_file(self) -> None:
        arch = self.metadata.get("general.architecture")
        if arch != ARCHITECTURE:
            raise ConfigError(f"{self.path}: GGUF architecture {arch!r} is not supported: Ostinato reads "
                              f"{ARCHITECTURE} (Qwen3-MoE) GGUF files")
        if int(self.metadata.get("split.count", 1)) > 1:
            raise ConfigError(f"{self.path} is part of a split GGUF model: merge it first "
                              "(llama-gguf-split --merge FIRST-PART OUT.gguf)")
        scaling = self.metadata.get(f"{ARCHITECTURE}.rope.scaling.type", "none")
        if scaling != "none":
            raise ConfigError(f"{self.path}: rope scaling {scaling!r} in a GGUF file is not supported yet "
                              "(use the Hugging Face checkpoint, whose config.json states it fully)")
        k, v = (self.metadata.get(f"{ARCHITECTURE}.attention.{n}_length") for n in ("key", "value"))
        if None not in (k, v) and k != v:
            raise ConfigError(f"{self.path}: key and value heads differ in size ({k}, {v}); Qwen3-MoE has one")
        if "token_embd.weight" not in self.tensors:
            raise ConfigError(f"{self.path}: the GGUF file has no token_embd.weight")

    def _config_dict(self) -> dict:
        """The metadata as the config.json of the same model (transformers' qwen3_moe keys)."""
        heads = self._meta("attention.head_count")
        hidden = self._meta("embedding_length")
        experts = self._meta("expert_count")
        cfg = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": int(self.tensors["token_embd.weight"].shape[1]),
            "hidden_size": hidden,
            "intermediate_size": self._meta("feed_forward_length", 0),
            "moe_intermediate_size": self._meta("expert_feed_forward_length"),
            "num_hidden_layers": self._meta("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._meta("attention.head_count_kv", heads),
            "head_dim": self._meta("attention.key_length", hidden // heads),
            "num_experts": experts,
            "num_experts_per_tok": self._meta("expert_used_count"),
            "norm_topk_prob": True,  # llama.cpp's qwen3moe always renormalises the top-k weights
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rms_norm_eps": f32_value(self._meta("attention.layer_norm_rms_epsilon")),
            "rope_theta": f32_value(self._meta("rope.freq_base", 10000.0)),
            "rope_scaling": None,
            "max_position_embeddings": self._meta("context_length"),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": False,
            "torch_dtype": "bfloat16",
        }
        bos, eos = self.metadata.get("tokenizer.ggml.bos_token_id"), self.metadata.get("tokenizer.ggml.eos_token_id")
        cfg |= {"bos_token_id": bos, "eos_token_id": eos}
        return cfg

    def _dense_names(self) -> list[str]:
        cfg = self.config
        names = ["model.embed_tokens.weight"]
        for i in range(cfg.num_hidden_layers):
            names += [f"model.layers.{i}.{n}" for n in LAYER_TENSORS]
        names.append("model.norm.weight")
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

    def _check_tensors(self) -> None:
        """Every tensor expected is there, no tensor is left unread, every type is one we read."""
        experts = {expert_tensor_name(i, p): i for i in range(self.config.num_hidden_layers) for p in EXPERT_TENSORS}
        missing = [n for n in [*self._dense.values(), *experts] if n not in self.tensors]
        if missing:
            raise ConfigError(f"{self.path}: the GGUF file lacks {len(missing)} tensor(s) a qwen3moe model needs, "
                              f"e.g. {', '.join(missing[:3])} (a layer without routed experts is not supported)")
        known = {*self._dense.values(), *experts}
        unknown = [n for n in self.tensors if n not in known]
        if unknown:
            raise ConfigError(f"{self.path}: the GGUF file has tensor(s) Ostinato's Qwen3-MoE does not use, "
                              f"e.g. {', '.join(unknown[:3])}: refusing rather than ignoring them")
        for name, t in self.tensors.items():
            allowed = formats.QTYPES if name in experts else (*formats.QTYPES, *DENSE_ONLY_QTYPES)
            if t.tensor_type.name not in allowed:
                what = "routed experts" if name in experts else "tensors"
                raise ConfigError(f"{self.path}: tensor {name} is {t.tensor_type.name}, which Ostinato does not "
                                  f"read ({what}: {', '.join(allowed)}); requantize the model with llama-quantize, "
                                  "e.g. to Q4_K_M or MXFP4_MOE")
        for i in self.config.moe_layers:
            gate, up = (self.tensors[expert_tensor_name(i, p)].tensor_type.name for p in ("gate_proj", "up_proj"))
            if gate != up:
                raise ConfigError(f"{self.path}: layer {i} stores gate and up experts as {gate} and {up}: "
                                  "Ostinato's expert kernels need one format for both")


def _row_bytes_view(data: np.ndarray) -> np.ndarray:
    """A tensor's data as uint8 [..., bytes of a row] (GGUFReader gives float types as floats)."""
    return data if data.dtype == np.uint8 else data.view(np.uint8)


def _decode_device(out: torch.Tensor) -> torch.device | None:
    """Where a dense tensor bound for `out` is decoded, if not on the CPU: its GPU, or the current
    one for page-locked host memory (the embedding a CUDA runner keeps on the host)."""
    if out.is_cuda:
        return out.device
    if out.is_pinned() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _decode(data: np.ndarray, ggml_type: GGMLQuantizationType, n: int) -> torch.Tensor:
    """GGUF data with rows of n values -> a float tensor [..., n] (a view for F32/F16/BF16)."""
    qtype = ggml_type.name
    if qtype in formats.QTYPES:
        raw = torch.from_numpy(_row_bytes_view(data))
        if qtype in ("F32", "F16", "BF16"):
            return raw.view({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype])
        return formats.dequantize(raw, qtype, n)
    return torch.from_numpy(gguf_dequantize(data, ggml_type))
