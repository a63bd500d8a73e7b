"""Whole-model oracle: Ostinato's Qwen3-MoE against transformers on the same checkpoint."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from ostinato.config import ConfigError
from ostinato.engine.runner import ModelRunner, RunnerSettings
from ostinato.loader.build import build_model
from ostinato.loader.source import CheckpointSource

transformers = pytest.importorskip("transformers")


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _ours(path, chunk=2048):
    return ModelRunner(CheckpointSource(path), RunnerSettings(device="cpu", dtype="fp32", max_context=256,
                                                              prefill_chunk=chunk))


def _variant(tiny_dir, tmp_path, **changes):
    """A copy of tiny with config changes that keep the tensor set (rope variants, norm_topk_prob)."""
    d = tmp_path / "variant"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text()) | changes
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _prompt(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4000, (n,), generator=g).tolist()


@pytest.mark.parametrize("changes", [
    {},
    {"norm_topk_prob": False},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}},
    {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 48},
], ids=["default", "no-norm-topk", "yarn", "linear", "llama3", "dynamic"])
def test_logits_and_greedy_match_transformers(tiny_dir, tmp_path, changes):
    path = _variant(tiny_dir, tmp_path, **changes) if changes else tiny_dir
    # chunked prefill must not change anything, except under dynamic NTK, whose frequencies
    # depend on the length of the pass (transformers' own cached generation behaves alike)
    dynamic = "dynamic" in json.dumps(changes)
    hf, ours = _hf(path), _ours(path, chunk=2048 if dynamic else 24)
    ids = _prompt()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = ours.forward(ids, 0, all_logits=True)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-3
    want = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(ids):].tolist()
    seq, logits = list(ids), ours.forward(ids, 0)
    mine = []
    for _ in range(32):
        t = int(logits.argmax())
        mine.append(t)
        logits = ours.forward([t], len(seq))
        seq.append(t)
    assert mine == want


def test_dense_layers_and_tied_head(tmp_path):
    """mlp_only_layers, decoder_sparse_step and tied embeddings, on a checkpoint with those tensors."""
    from safetensors.torch import save_file

    from ostinato.synth import presets
    from ostinato.synth.weights import SynthSpec

    cfg = dict(presets.TINY, mlp_only_layers=[1], decoder_sparse_step=2, tie_word_embeddings=True,
               bos_token_id=0, eos_token_id=1)
    presets.PRESETS["_test_dense"] = cfg
    try:
        spec = SynthSpec("_test_dense", skew=1.0)
        save_file({n: spec.tensor(n) for n in spec.shapes}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    finally:
        del presets.PRESETS["_test_dense"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = _ours(tmp_path)
    assert ours.config.moe_layers == [3]
    ids = _prompt(40, seed=1)
    with torch.no_grad():
        ref = _hf(tmp_path)(torch.tensor([ids])).logits[0]
    got = ours.forward(ids, 0, all_logits=True)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-3


def test_clear_errors(tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match="no such model directory"):
        CheckpointSource(tmp_path / "nope")
    bad = _variant(tiny_dir, tmp_path, architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError, match="unsupported architecture"):
        CheckpointSource(bad)
    shutil.rmtree(bad)
    wrong = _variant(tiny_dir, tmp_path, hidden_size=96)
    with pytest.raises(ConfigError, match="has shape"):
        _ours(wrong)
    shutil.rmtree(wrong)
    missing = _variant(tiny_dir, tmp_path)
    (missing / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        CheckpointSource(missing)


def test_rows_looked_up_elsewhere_give_the_same_pass(tiny_dir):
    """The runner may look the embedding's rows up itself (host_embedding: the table in pinned host
    memory, the rows copied to the GPU): the pass given those rows is the pass that looks them up."""
    from ostinato.loader.build import host_embedding

    r = ModelRunner(CheckpointSource(tiny_dir), RunnerSettings(device="cpu", max_context=64))
    assert r.host_rows is None and not host_embedding(r.config, "cpu") and host_embedding(r.config, "cuda")
    ids = torch.tensor([5, 17, 301, 2])
    pos = torch.arange(4)
    with torch.inference_mode():
        plain = r.model(ids, pos, r.kv.layers, 0)
        given = r.model(ids, pos, r.kv.layers, 0, rows=r.model.model.embed_tokens.weight[ids])
    assert torch.equal(plain, given)


@pytest.mark.gpu
def test_a_cuda_runner_keeps_the_embedding_in_pinned_host_memory(tiny_dir, tmp_path):
    """Only the head and the layers take GPU memory; the graph's greedy tokens are the host-driven
    steps', and the prompt's logits the CPU's within fp32 rounding (the rows cross per pass)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()  # the model alone (a runner adds its KV cache and buffers)
    model = build_model(CheckpointSource(tiny_dir), "cuda", torch.float32)
    grown = torch.cuda.memory_allocated() - before
    table = model.model.embed_tokens.weight
    assert table.device.type == "cpu" and table.is_pinned()
    on_gpu = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_cuda)
    assert on_gpu == sum(p.numel() * p.element_size() for p in model.parameters()) - table.numel() * table.element_size()
    assert grown < on_gpu + table.numel() * table.element_size() // 2  # no copy of the table on the GPU
    del model, table
    # the decode graph needs a capturable placement: every expert resident in the pool
    from ostinato.engine.placement import PlacementSettings
    from ostinato.load import load_engine
    from tests.test_hybrid import _residency_for

    _residency_for(CheckpointSource(tiny_dir), 1.0).save(tmp_path / "all.json")
    placed = PlacementSettings(residency=str(tmp_path / "all.json"))
    r = load_engine(str(tiny_dir), RunnerSettings(device="cuda", dtype="fp32", max_context=256), placed).runner
    w = r.host_rows
    assert w is not None and w.is_pinned() and w.device.type == "cpu"
    sync = load_engine(str(tiny_dir), RunnerSettings(device="cuda", dtype="fp32", max_context=256, cuda_graph=False),
                       placed).runner
    cpu = ModelRunner(CheckpointSource(tiny_dir), RunnerSettings(device="cpu", dtype="fp32", max_context=256))
    prompt = [3, 99, 1000, 7, 42]
    want = cpu.forward(prompt, 0, all_logits=True)
    assert torch.allclose(sync.forward(prompt, 0, all_logits=True).cpu(), want, rtol=1e-3, atol=1e-3)
    outs = []
    for runner in (r, sync):
        logits, toks = runner.forward(prompt, 0), []
        for i in range(8):
            toks.append(int(logits.argmax()))
            logits = runner.forward([toks[-1]], len(prompt) + i)
        outs.append(toks)
    assert r.graphs is not None and sync.graphs is None and outs[0] == outs[1]


def test_fused_projections_are_the_three_linears(tiny_dir):
    """The runner's model computes q, k and v as one matmul (FusedProjections): the same outputs
    within fp32 rounding as three, the three parameters views of the one weight (no second copy),
    the checkpoint's names and byte counts unchanged."""
    from ostinato.loader.build import build_model

    src = CheckpointSource(tiny_dir)
    plain, fused = build_model(src, "cpu", torch.float32), build_model(src, "cpu", torch.float32)
    names = [n for n, _ in fused.named_parameters()]
    nbytes = sum(p.numel() for p in fused.parameters())
    fused.fuse_projections()
    assert [n for n, _ in fused.named_parameters()] == names and sum(p.numel() for p in fused.parameters()) == nbytes
    attn = fused.model.layers[0].self_attn
    w = attn.qkv.weight
    start, end = w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()
    assert all(start <= m.weight.data_ptr() < end for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    r = ModelRunner(src, RunnerSettings(device="cpu", dtype="fp32", max_context=64))
    assert r.model.model.layers[0].self_attn.qkv is not None  # the runner fuses
    ids, pos = torch.tensor([5, 17, 301, 2, 9]), torch.arange(5)
    plain.set_experts(r.experts)
    fused.set_experts(r.experts)
    with torch.inference_mode():
        a = plain(ids, pos, r.kv.layers, 0)
        b = fused(ids, pos, r.kv.layers, 0)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_layer_staged_on_the_gpu_falls_back_to_host_memory_when_the_cap_is_full(monkeypatch):
    """A synthetic source generates a layer where it will live; when a pool that fills the cap
    leaves no room for that transient layer, it is staged in host memory instead of failing."""
    from types import SimpleNamespace

    from ostinato.loader import build

    tried = []

    def load(source, layer, device="cpu", dtype=None, pin=False):
        tried.append(torch.device(device).type)
        if torch.device(device).type != "cpu":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 384.00 MiB")
        return "staged in host memory"

    monkeypatch.setattr(build, "load_experts", load)
    source = SimpleNamespace(generate_on="meta")
    assert build.load_experts_staged(source, 3, "meta") == "staged in host memory"
    assert tried == ["meta", "cpu"]
    tried.clear()
    assert build.load_experts_staged(SimpleNamespace(), 3, "meta") == "staged in host memory"
    assert tried == ["cpu"]  # a source that does not generate on the device stages on the host at once


def test_quantized_experts_are_staged_where_the_source_makes_them(monkeypatch):
    """A layer of block-format experts (a synthetic gpt-oss's MXFP4) is staged on the device the source
    generates on, as float experts are, and in host memory where that device has no room for it."""
    from types import SimpleNamespace

    from ostinato.loader import build

    tried = []

    def load(source, layer, device="cpu", pin=False):
        tried.append(torch.device(device).type)
        if torch.device(device).type != "cpu":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.66 GiB")
        return SimpleNamespace(qt13="MXFP4", qt2="MXFP4", where="host memory")

    monkeypatch.setattr(build, "load_quantized_experts", load)
    qtypes = ("MXFP4", "MXFP4")
    assert build.load_layer_experts(SimpleNamespace(generate_on="meta"), 3, qtypes, "meta").where == "host memory"
    assert tried == ["meta", "cpu"]
    tried.clear()
    assert build.load_layer_experts(SimpleNamespace(), 3, qtypes, "meta").where == "host memory"
    assert tried == ["cpu"]  # a file is read into host memory at once
    with pytest.raises(ConfigError, match="experts are MXFP4/MXFP4, the placement expected Q4_K/Q6_K"):
        build.load_layer_experts(SimpleNamespace(), 3, ("Q4_K", "Q6_K"), "meta")


def test_a_load_out_of_gpu_memory_says_which_step_and_what_did_not_fit():
    """The load's error names its step and keeps the allocator's account (session 49: a DeepSeek-V3-shaped
    load ran out of GPU memory after 172 s, and the message said nothing more)."""
    from ostinato.load import load_engine

    def experts(source, settings):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 21.00 GiB. GPU 0 has a total capacity "
                                     "of 79.19 GiB of which 3.10 GiB is free. If reserved but unallocated memory "
                                     "is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\nmore")

    with pytest.raises(ConfigError, match=r"loading its experts \(CUDA out of memory\. Tried to allocate 21\.00 GiB\. "
                                          r"GPU 0 has a total capacity of 79\.19 GiB of which 3\.10 GiB is free\.\);"):
        load_engine("synth:tiny", experts_factory=experts, announce=False)
