"""GGUF files: the writer's recipes, the source that reads them back, their tokenizer, and refusals.

Oracles: the Hugging Face checkpoint the file was written from (config, tensors within each
format's error, tokenizer), gguf.quants (dequantize for every type, quantize for Q8_0 and
MXFP4), transformers loading the same GGUF file (whole-model logits against our reference
model on it), and, where ../shared/llama is beside the checkout, llama.cpp's own converter.
tiny's rows (128, 64) are not multiples of 256, so its Q4_K_M file falls back to Q5_0 and
is refused; tiny-k has K-quant-sized rows.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from ostinato.cli import main
from ostinato.config import ConfigError
from ostinato.engine.runner import ModelRunner, RunnerSettings
from ostinato.loader.build import dense_formats, load_experts, load_quantized_experts
from ostinato.loader.gguf import GGUFSource, gguf_name
from ostinato.loader.source import CheckpointSource
from ostinato.sources import open_source
from ostinato.loader.tokenizer import ChatTokenizer, TokenizerDirError
from ostinato.quant import formats
from ostinato.synth.build import write_checkpoint
from ostinato.synth.gguf_writer import use_more_bits, write_gguf

transformers = pytest.importorskip("transformers")

# relative RMS error of a dequantized tensor against the bf16 original (formats' own bounds
# are tested in test_quant_formats.py; these only catch a wrong layout or a wrong tensor)
MAX_ERROR = {"F32": 0.0, "BF16": 0.0, "Q8_0": 0.01, "Q6_K": 0.03, "Q5_0": 0.06, "Q4_K": 0.12, "MXFP4": 0.2}
EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


@pytest.fixture(scope="module")
def tiny_files(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    src = CheckpointSource(tiny_dir)
    return {r: write_gguf(src, out / f"tiny-{r}.gguf", r, device="cpu") for r in ("BF16", "Q8_0", "MXFP4_MOE", "Q4_K_M")}


@pytest.fixture(scope="module")
def tinyk_dir(tmp_path_factory, _isolated_cache):
    return write_checkpoint("tiny-k", tmp_path_factory.mktemp("tinyk"))


@pytest.fixture(scope="module")
def tinyk_file(tinyk_dir, tmp_path_factory):
    return write_gguf(CheckpointSource(tinyk_dir), tmp_path_factory.mktemp("gguf") / "tiny-k-Q4_K_M.gguf", "Q4_K_M",
                      device="cpu")


@pytest.fixture(scope="module")
def cases(tiny_dir, tiny_files, tinyk_dir, tinyk_file):
    """(checkpoint directory, GGUF file) for every readable recipe."""
    return {"BF16": (tiny_dir, tiny_files["BF16"]), "Q8_0": (tiny_dir, tiny_files["Q8_0"]),
            "MXFP4_MOE": (tiny_dir, tiny_files["MXFP4_MOE"]), "Q4_K_M": (tinyk_dir, tinyk_file)}


RECIPES = ["BF16", "Q8_0", "MXFP4_MOE", "Q4_K_M"]


def _gguf_tensor(reader: GGUFReader, hf: str):
    """The GGUF tensor holding HF tensor `hf`, and the expert index (None for dense tensors)."""
    tensors = {t.name: t for t in reader.tensors}
    parts = hf.split(".")
    if ".mlp.experts." in hf:
        return tensors[f"blk.{parts[2]}.{EXPERT_NAMES[parts[6]]}.weight"], int(parts[5])
    return tensors[gguf_name(hf)], None


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


@pytest.mark.parametrize("recipe", RECIPES)
def test_config_equals_the_checkpoints(cases, recipe):
    hf_dir, path = cases[recipe]
    assert GGUFSource(path).config == CheckpointSource(hf_dir).config


@pytest.mark.parametrize("recipe", RECIPES)
def test_tensors_read_back(cases, recipe):
    """Every tensor: ours == gguf.quants.dequantize of the file's bytes, close to the original;
    Q8_0/MXFP4 bytes are exactly what gguf.quants.quantize makes of the original."""
    hf_dir, path = cases[recipe]
    hf, ours = CheckpointSource(hf_dir), GGUFSource(path)
    reader = GGUFReader(path)
    assert sorted(ours.names()) == sorted(hf.names())
    for name in hf.names():
        want = torch.empty(hf.shape(name))
        hf.load_(name, want)
        got = ours.load_(name, torch.empty(ours.shape(name)))
        tensor, expert = _gguf_tensor(reader, name)
        data = tensor.data if expert is None else tensor.data[expert]
        oracle = torch.from_numpy(gguf.quants.dequantize(data, tensor.tensor_type).astype(np.float32))
        assert torch.equal(got, oracle.view(got.shape)), name
        qtype = tensor.tensor_type.name
        assert _rel_rms(got, want) <= MAX_ERROR[qtype], (name, qtype, _rel_rms(got, want))
        if qtype in ("Q8_0", "MXFP4"):
            mine = np.asarray(data).view(np.uint8)
            assert np.array_equal(mine, gguf.quants.quantize(want.numpy(), tensor.tensor_type)), name


def test_q4_k_m_recipe(tinyk_file):
    """llama.cpp's Q4_K_M on two layers: use_more_bits(1, 2) holds, so layer 1's down
    projections and attn_v are Q6_K; output Q6_K; norms and router F32; the rest Q4_K."""
    types = {t.name: t.tensor_type.name for t in GGUFReader(tinyk_file).tensors}
    for name, qtype in types.items():
        if name.endswith(("_norm.weight", "ffn_gate_inp.weight")):
            assert qtype == "F32", name
        elif name == "output.weight" or name.startswith("blk.1.") and name.endswith(("attn_v.weight", "down_exps.weight")):
            assert qtype == "Q6_K", name
        else:
            assert qtype == "Q4_K", name


def test_use_more_bits_matches_the_published_counts():
    """research/quantization.md: Qwen3-30B-A3B gets Q6_K down projections on 24 of 48 layers,
    Qwen3-235B-A22B on 46 of 94."""
    assert sum(use_more_bits(i, 48) for i in range(48)) == 24
    assert sum(use_more_bits(i, 94) for i in range(94)) == 46


def test_quantized_experts_are_the_files_blocks(tinyk_file):
    source = GGUFSource(tinyk_file)
    tensors = {t.name: t for t in GGUFReader(tinyk_file).tensors}
    cfg = source.config
    for layer, down in ((0, "Q4_K"), (1, "Q6_K")):
        q = load_quantized_experts(source, layer)
        assert (q.qt13, q.qt2) == ("Q4_K", down)
        gate, up, w2 = (torch.from_numpy(np.asarray(tensors[f"blk.{layer}.ffn_{p}_exps.weight"].data).copy())
                        for p in ("gate", "up", "down"))
        assert torch.equal(q.w13, torch.cat([gate, up], dim=1)) and torch.equal(q.w2, w2)
        bf = load_experts(source, layer, dtype=torch.float32)  # the dequantizing path agrees with the blocks
        assert torch.equal(bf.w13, formats.dequantize(q.w13, q.qt13, cfg.hidden_size))
        assert torch.equal(bf.w2, formats.dequantize(q.w2, q.qt2, cfg.moe_intermediate_size))


def test_every_expert_resident_counts_the_files_bytes(tinyk_file):
    """Without a residency every expert is resident: a plan of them all in the pool, and the fit
    under a cap counted in the file's block bytes (dequantized, the same pool would be 3.5x)."""
    from ostinato.engine.sizes import expert_sizes
    from ostinato.load import all_resident, all_resident_fit

    source = GGUFSource(tinyk_file)
    cfg = source.config
    # passes below the dequantized path's threshold: no scratch (of 10 bf16 experts, more than this
    # 16-expert model saves in blocks) beside the pool
    settings = RunnerSettings(device="cpu", dtype="bf16", max_context=1024, prefill_chunk=256)
    res = all_resident(source, settings)
    assert res.hot_count == len(cfg.moe_layers) * cfg.num_experts
    assert all(sorted(res.hot[l]) == list(range(cfg.num_experts)) for l in cfg.moe_layers)
    native = sum(b for _, b in expert_sizes(cfg, torch.bfloat16, {l: source.expert_qtypes(l) for l in cfg.moe_layers}).values())
    dense = sum(b for _, b in expert_sizes(cfg, torch.bfloat16, None).values())
    assert dense > 3 * native
    # the smallest cap that holds them all in blocks does not hold them dequantized
    lo, hi = 2**20, 2**36
    while hi - lo > 2**16:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if all_resident_fit(source, settings, mid) else (mid, hi)
    assert all_resident_fit(source, settings, hi) and not all_resident_fit(source, settings, hi, experts="bf16")


@pytest.mark.gpu
def test_dense_tensors_decode_on_the_gpu_as_on_the_cpu(tinyk_file, monkeypatch):
    """A CUDA runner's dense tensors (and its page-locked host embedding) are decoded on the GPU,
    a few rows at a time: the same values as the CPU's decode, which equals gguf's."""
    import ostinato.loader.gguf as gguf_loader

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(gguf_loader, "_GPU_DECODE_VALUES", 3 * 256)  # several chunks, one ending short
    src = GGUFSource(tinyk_file)
    for name in src.names():
        if ".experts." in name:
            continue
        want = src.load_(name, torch.empty(src.shape(name)))
        on_gpu = src.load_(name, torch.empty(src.shape(name), device="cuda"))
        pinned = src.load_(name, torch.empty(src.shape(name), pin_memory=True))
        assert torch.equal(on_gpu.cpu(), want) and torch.equal(pinned, want), name


def test_dense_tensors_decoded_rows_at_a_time_are_the_whole_tensors(tinyk_file, monkeypatch):
    """The GPU's row-chunked decode, run here on the CPU: the same values as the whole tensor's."""
    import ostinato.loader.gguf as gguf_loader

    src = GGUFSource(tinyk_file)
    names = [n for n in src.names() if ".experts." not in n]
    want = {n: src.load_(n, torch.empty(src.shape(n))) for n in names}
    monkeypatch.setattr(gguf_loader, "_GPU_DECODE_VALUES", 3 * 256)
    monkeypatch.setattr(gguf_loader, "_decode_device", lambda out: torch.device("cpu"))
    for n in names:
        assert torch.equal(src.load_(n, torch.empty(src.shape(n))), want[n]), n


@pytest.mark.gpu
def test_every_expert_resident_on_the_gpu_keeps_the_blocks(tinyk_file):
    """load_engine with no residency on CUDA: the pool executor with every expert in its file's
    blocks (not the oracle's dequantized copy), and from the decode graph the oracle's greedy tokens wherever
    the oracle's top two logits stand apart."""
    from ostinato.engine.sampling import SamplingParams
    from ostinato.layers.moe.hybrid import HybridExperts
    from ostinato.layers.moe.reference import ReferenceExperts
    from ostinato.load import load_engine

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    loaded = load_engine(str(tinyk_file), RunnerSettings(device="cuda", dtype="bf16", max_context=512),
                         announce=False)
    hybrid = loaded.runner.experts.unwrapped  # inside the decode graph's wrapper
    assert isinstance(hybrid, HybridExperts)
    assert all(g.qtypes is not None for g in hybrid.pools.groups), "the pool holds the file's blocks"
    prompt = loaded.tokenizer.render_ids([{"role": "user", "content": "check order #W2378156"}])
    ids = list(loaded.engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    src = GGUFSource(tinyk_file)
    oracle = ModelRunner(src, RunnerSettings(device="cuda", dtype="bf16", max_context=512, cuda_graph=False),
                         quantized=dense_formats(src))  # attention and head in blocks, as the engine keeps them
    assert isinstance(oracle.experts, ReferenceExperts)
    checked = 0
    for i in range(len(ids)):  # the oracle's next token on the engine's sequence, the whole sequence again
        top = oracle.forward(prompt + ids[:i], 0).topk(2)
        if (top.values[0] - top.values[1]).item() > 0.05 * top.values[0].abs().item():  # else rounding may pick either
            assert ids[i] == top.indices[0].item(), i
            checked += 1
    assert checked >= 3  # 5 of the 8 stand apart on this prompt (bf16 on the CPU)


@pytest.mark.parametrize("recipe", RECIPES)
def test_logits_match_transformers_on_the_same_file(cases, recipe):
    """transformers dequantizes the GGUF file on load; our reference model reads the same file.
    transformers 5.24 does not map qwen3moe.expert_feed_forward_length (its config would keep
    Qwen3MoeConfig's default 768), so that one value is passed to it by hand."""
    _, path = cases[recipe]
    ours = ModelRunner(open_source(path), RunnerSettings(device="cpu", dtype="fp32", max_context=64))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32,
        moe_intermediate_size=ours.config.moe_intermediate_size).eval()
    ids = torch.randint(0, 4000, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = ours.forward(ids, 0, all_logits=True)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_bf16_file_is_the_checkpoint(tiny_dir, tiny_files):
    ids = list(range(300, 332))
    a = ModelRunner(open_source(tiny_files["BF16"]), RunnerSettings(device="cpu", dtype="fp32", max_context=64))
    b = ModelRunner(CheckpointSource(tiny_dir), RunnerSettings(device="cpu", dtype="fp32", max_context=64))
    assert torch.equal(a.forward(ids, 0, all_logits=True), b.forward(ids, 0, all_logits=True))


@pytest.fixture(scope="module")
def tokenizers(tiny_dir, tiny_files):
    return ChatTokenizer.from_dir(tiny_dir), ChatTokenizer.from_dir(tiny_files["Q8_0"])


TEXTS = ["Hello world, <|im_start|>user\n def f(x):\n    return 333 + x  \n\n ünïcödé 🚀",
         "<tool_call>\n{\"name\": \"read\", \"arguments\": {}}\n</tool_call><|im_end|>\n\t\r\n  x",
         "日本語のテキスト données Größe 3.14159 ''' ``` !!!???"]


def test_tokenizer_and_template_round_trip(tokenizers, tiny_dir, tiny_files):
    hf_tok, ours = tokenizers
    assert ours.vocab_size == hf_tok.vocab_size and ours.eos_ids == hf_tok.eos_ids
    assert ours.templates == hf_tok.templates
    for text in TEXTS:
        ids = hf_tok.encode(text)
        assert ours.encode(text) == ids and ours.decode(ids) == hf_tok.decode(ids) == text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[0]}]
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    assert ours.apply_chat_template(chat, tools) == hf_tok.apply_chat_template(chat, tools)
    # transformers' own GGUF tokenizer agrees too (5.24 does; 5.17, on the GPU machine, splits
    # the same file's text into other pieces: its GGUF tokenizer conversion, not the file)
    if tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 24):
        return
    hf_gguf = transformers.AutoTokenizer.from_pretrained(tiny_files["Q8_0"].parent, gguf_file=tiny_files["Q8_0"].name)
    hf_ref = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert hf_gguf.chat_template == hf_ref.chat_template
    for text in TEXTS:
        assert hf_gguf.encode(text, add_special_tokens=False) == hf_ref.encode(text, add_special_tokens=False)


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=120))
def test_tokenizer_encodes_any_text_alike(tokenizers, text):
    hf_tok, ours = tokenizers
    assert ours.encode(text) == hf_tok.encode(text)


def test_model_arguments(tiny_files, tmp_path):
    d = tmp_path / "one"
    d.mkdir()
    shutil.copy(tiny_files["Q8_0"], d / "m.gguf")
    assert isinstance(open_source(d), GGUFSource) and isinstance(open_source(d / "m.gguf"), GGUFSource)
    shutil.copy(tiny_files["BF16"], d / "n.gguf")
    with pytest.raises(ConfigError, match="2 GGUF files"):
        open_source(d)


def _same_file(a: Path, b: Path, ignore=("general.name",)) -> None:
    """Two GGUF files with the same metadata (but `ignore`) and byte-identical tensors."""
    ra, rb = GGUFReader(a), GGUFReader(b)
    meta = [{k: (f.types, f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.") and k not in ignore}
            for r in (ra, rb)]
    assert meta[0] == meta[1]
    ta, tb = {t.name: t for t in ra.tensors}, {t.name: t for t in rb.tensors}
    assert ta.keys() == tb.keys()
    for name, t in ta.items():
        assert t.tensor_type == tb[name].tensor_type and list(t.shape) == list(tb[name].shape), name
        a, b = np.asarray(t.data).view(np.uint8), np.asarray(tb[name].data).view(np.uint8)
        if not np.array_equal(a, b):  # say how far apart they are, not only that they differ
            qt = t.tensor_type
            blocks = (a != b).reshape(-1, gguf.GGML_QUANT_SIZES[qt][1]).any(1)
            va, vb = gguf.quants.dequantize(a, qt), gguf.quants.dequantize(b, qt)
            pytest.fail(f"{name} ({qt.name}): {int(blocks.sum())} of {blocks.size} blocks differ, "
                        f"values at most {float(np.abs(va - vb).max()):.3g} apart")


def test_synth_command_writes_the_same_file(tiny_files, tmp_path):
    """`ostinato synth --format gguf` generates the model straight into the writer: the same
    file as writing the Hugging Face checkpoint first and converting it."""
    assert main(["synth", "--preset", "tiny", "--format", "gguf", "--quant", "Q8_0", "--out", str(tmp_path)]) == 0
    _same_file(tmp_path / "tiny-Q8_0.gguf", tiny_files["Q8_0"])
    assert main(["synth", "--preset", "tiny", "--quant", "Q8_0", "--out", str(tmp_path / "hf")]) == 2


def test_metadata_is_parsed_once_per_file_and_again_when_it_changes(tiny_files, tmp_path, monkeypatch):
    """A file's source and its tokenizer share one parse of its metadata; a file written again
    at the same path (same size, later mtime) is read again."""
    import ostinato.loader.gguf as gguf_loader
    from ostinato.loader.gguf import file_metadata

    path = tmp_path / "m.gguf"
    _rewrite(tiny_files["Q8_0"], path)
    src = GGUFSource(path)
    assert file_metadata(path) is src.metadata
    _rewrite(tiny_files["Q8_0"], path, meta={"qwen3moe.context_length": 4321})
    os.utime(path, ns=(0, src.path.stat().st_mtime_ns + 10**9))  # a later write, whatever the clock's grain
    assert file_metadata(path) is not src.metadata
    again = GGUFSource(path)
    assert again.config.max_position_embeddings == 4321
    opened = []

    class Counting(gguf_loader.GGUFReader):
        def __init__(self, *a, **k):
            opened.append(a[0])
            super().__init__(*a, **k)

    monkeypatch.setattr(gguf_loader, "GGUFReader", Counting)
    assert ChatTokenizer.from_dir(path).vocab_size == ChatTokenizer.from_dir(tiny_files["Q8_0"]).vocab_size
    assert opened == [tiny_files["Q8_0"]]  # the tokenizer of the file already open read no file again


# ---- refusals


def _rewrite(src: Path, dst: Path, arch: str | None = None, meta: dict | None = None,
             retype: dict | None = None, requantize: dict | None = None, extra: str | None = None) -> Path:
    """A copy of a GGUF file with another architecture, metadata values, tensor types (`retype`:
    random bytes of the new type's size; `requantize`: the values quantized again with
    gguf.quants) or one extra tensor."""
    reader = GGUFReader(src)
    w = GGUFWriter(dst, arch or reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (meta or {}).get(key, f.contents())
        w.add_key_value(key, value, f.types[0], sub_type=f.types[1] if len(f.types) > 1 else None)
    rng = np.random.default_rng(0)
    for t in reader.tensors:
        data, qtype = np.asarray(t.data), t.tensor_type
        if t.name in (retype or {}):
            qtype = GGMLQuantizationType[retype[t.name]]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            rows = [int(n) for n in reversed(t.shape)]
            data = rng.integers(0, 256, (*rows[:-1], rows[-1] // block * size), dtype=np.uint8)
        if t.name in (requantize or {}):
            qtype = GGMLQuantizationType[requantize[t.name]]
            data = gguf.quants.quantize(gguf.quants.dequantize(data, t.tensor_type), qtype)
        w.add_tensor(t.name, data, raw_dtype=qtype)
    if extra:
        w.add_tensor(extra, np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_refuses_fallback_experts(tiny_files):
    """tiny in Q4_K_M: rows of 128 values fall back to Q5_0, which the expert kernels do not read."""
    with pytest.raises(ConfigError, match=r"ffn_\w+_exps.weight is Q5_0.*requantize"):
        GGUFSource(tiny_files["Q4_K_M"])


def test_refusals_of_gguf_files(tiny_files, tmp_path):
    src = tiny_files["Q8_0"]
    with pytest.raises(ConfigError, match="architecture 'llama' is not supported"):
        GGUFSource(_rewrite(src, tmp_path / "a.gguf", arch="llama"))
    with pytest.raises(ConfigError, match="blk.0.attn_q.weight is Q2_K"):
        GGUFSource(_rewrite(src, tmp_path / "b.gguf", retype={"blk.0.attn_q.weight": "Q2_K"}))
    with pytest.raises(ConfigError, match="blk.1.ffn_down_exps.weight is Q5_0"):
        GGUFSource(_rewrite(src, tmp_path / "c.gguf", retype={"blk.1.ffn_down_exps.weight": "Q5_0"}))
    with pytest.raises(ConfigError, match="gate and up experts as Q8_0 and F16"):
        GGUFSource(_rewrite(src, tmp_path / "d.gguf", retype={"blk.2.ffn_up_exps.weight": "F16"}))
    with pytest.raises(ConfigError, match="does not use, e.g. blk.0.attn_q.bias"):
        GGUFSource(_rewrite(src, tmp_path / "e.gguf", extra="blk.0.attn_q.bias"))
    with pytest.raises(TokenizerDirError, match="pre-tokenizer 'llama-bpe' is not supported"):
        ChatTokenizer.from_dir(_rewrite(src, tmp_path / "f.gguf", meta={"tokenizer.ggml.pre": "llama-bpe"}))


def test_dense_fallback_types_are_read(tiny_dir, tiny_files, tmp_path):
    """A dense tensor in Q5_0 (llama.cpp's fallback for short rows) is dequantized with gguf.quants."""
    path = _rewrite(tiny_files["BF16"], tmp_path / "q5.gguf", requantize={"blk.0.attn_q.weight": "Q5_0"})
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    name = "model.layers.0.self_attn.q_proj.weight"
    got = GGUFSource(path).load_(name, torch.empty(128, 128))
    assert tensor.tensor_type.name == "Q5_0"
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)))
    want = CheckpointSource(tiny_dir).load_(name, torch.empty(128, 128))
    assert _rel_rms(got, want) <= MAX_ERROR["Q5_0"]


@pytest.mark.parametrize("method,named", [("fp8", "FP8"), ("gptq", "GPTQ"), ("awq", "AWQ"),
                                          ("bitsandbytes", "bitsandbytes"), ("compressed-tensors", "compressed-tensors"),
                                          ("nvfp4-magic", "quant_method 'nvfp4-magic'"), (None, "an unnamed format")])
def test_refuses_quantized_safetensors(tiny_dir, tmp_path, method, named):
    d = tmp_path / "q"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method} if method else {"bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=rf"quantized \({named}; quantization_config"):
        CheckpointSource(d)


def test_refuses_low_precision_tensors_without_a_config(tiny_dir, tmp_path):
    d = tmp_path / "fp8"
    shutil.copytree(tiny_dir, d)
    shard = next(d.glob("*.safetensors"))
    tensors = load_file(shard)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"{name}' is stored as F8_E4M3"):
        ModelRunner(CheckpointSource(d), RunnerSettings(device="cpu", dtype="fp32", max_context=16))


def _llama_src() -> Path | None:
    here = Path(__file__).resolve()
    return next((p / "shared" / "llama" for p in here.parents if (p / "shared" / "llama" / "convert.py").is_file()), None)


@pytest.mark.skipif(_llama_src() is None, reason="llama.cpp's converter (../shared/llama) is not beside the checkout")
def test_same_file_as_llama_cpps_converter(tiny_dir, tiny_files, tmp_path):
    """convert_hf_to_gguf.py --outtype q8_0 on the same checkpoint: the same metadata (but the
    size label it derives) and byte-identical tensors."""
    llama = _llama_src()
    ref = tmp_path / "ref.gguf"
    subprocess.run([sys.executable, str(llama / "convert.py"), str(llama / "src"), str(tiny_dir), "--outtype", "q8_0",
                    "--outfile", str(ref)], check=True, capture_output=True)
    _same_file(tiny_files["Q8_0"], ref, ignore=("general.name", "general.size_label"))


def test_qwen3_235b_shaped_file_sizes():
    """The 235B-shaped preset has Qwen3-235B-A22B's dimensions; as Q4_K_M its 32 layers the GPU
    machine takes (presets.QWEN3_235B_A22B) fit its 64 GiB disk, all 94 do not."""
    from ostinato.synth.gguf_writer import gguf_bytes

    cut = open_source("synth:qwen3-235b-a22b?layers=32")
    cfg = cut.config
    assert (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4096, 128, 8, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 128)
    assert gguf_bytes(cut, "Q4_K_M") < 50e9
    assert gguf_bytes(open_source("synth:qwen3-235b-a22b"), "Q4_K_M") > 64 * 2**30


def test_synth_refuses_a_file_the_disk_cannot_hold(tiny_dir, tmp_path, monkeypatch):
    import shutil as sh

    from ostinato.synth import gguf_writer

    monkeypatch.setattr(gguf_writer.shutil, "disk_usage", lambda p: sh._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(ConfigError, match="GB free: write fewer layers"):
        write_gguf(CheckpointSource(tiny_dir), tmp_path / "t.gguf", "Q8_0", device="cpu")
    assert not (tmp_path / "t.gguf").exists()
