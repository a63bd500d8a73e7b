"""GGUF experts kept in their block formats inside the engine: pools grouped by format, zero
slots of zero bytes, host copies in blocks, capacity in real bytes, and whole-model logits
against the same file's experts dequantized at load (`experts="bf16"`).

Tolerances. The GPU branch over quantized pools computes with the dequantized fp32 weights
and fp32 activations (on the CPU device: gpu_quant.slot_experts_quant_torch), the same math as
the dequantized bf16-mode pool up to summation order, so with every expert hot the logits agree
to 1e-4. The CPU branch's native kernels quantize each activation (x, and h after its bf16
rounding) to int8 per 32 values: a rounding error of at most d/2 = amax/254 per value, about
0.5% RMS of a block for Gaussian-like activations, so a cold expert's output is off by about
1% (cpu_experts' docstring); through two MoE layers into the logits (about 0.2% measured here) the test allows 1% of the
largest logit, while a wrong block layout or a wrong format gives errors of order one. The
torch reference of the CPU kernels (quant_reference: the same int8 steps) matches them to 2e-4
(fp32 summation order).

Legend: E experts per layer, K top-k, D hidden, F expert FFN.
"""
from __future__ import annotations

import pytest
import torch

from ostinato.config import ModelConfig
from ostinato.engine.placement import PlacementSettings
from ostinato.engine.residency import Residency, model_fingerprint
from ostinato.engine.runner import RunnerSettings
from ostinato.engine.sizes import expert_bytes, expert_sizes
from ostinato.kernels.cpu import build
from ostinato.layers.moe.gpu_quant import QUANT_QTYPES
from ostinato.layers.moe.pool import ExpertPool, ExpertPools, HostExperts
from ostinato.layers.moe.types import ExpertWeights, QuantExpertWeights
from ostinato.load import load_engine
from ostinato.loader.build import WeightFormats, expert_formats, load_quantized_experts
from ostinato.loader.gguf import GGUFSource
from ostinato.loader.source import CheckpointSource
from ostinato.planner.capacity import CapacitySettings, plan_capacity
from ostinato.quant import formats
from ostinato.synth.build import write_checkpoint
from ostinato.synth.gguf_writer import use_more_bits, write_gguf
from ostinato.synth.presets import PRESETS

PROMPT = list(range(5, 29))
DECODE = [7, 300, 1200]


@pytest.fixture(scope="module")
def tinyk_q4km(tmp_path_factory, _isolated_cache):
    """tiny-k (2 layers, D = F = 256) as Q4_K_M: layer 0 Q4_K/Q4_K, layer 1 Q4_K/Q6_K (use_more_bits)."""
    ckpt = write_checkpoint("tiny-k", tmp_path_factory.mktemp("tinyk"))
    return write_gguf(CheckpointSource(ckpt), tmp_path_factory.mktemp("gguf") / "tiny-k-Q4_K_M.gguf", "Q4_K_M",
                      device="cpu")


@pytest.fixture(scope="module")
def tiny_q8(tiny_dir, tmp_path_factory):
    """tiny as Q8_0: one format for every layer (one group)."""
    return write_gguf(CheckpointSource(tiny_dir), tmp_path_factory.mktemp("gguf8") / "tiny-Q8_0.gguf", "Q8_0",
                      device="cpu")


def _residency(source, fraction, seed=0) -> Residency:
    cfg = source.config
    g = torch.Generator().manual_seed(seed)
    n = round(fraction * cfg.num_experts)
    hot = {l: torch.randperm(cfg.num_experts, generator=g)[:n].tolist() for l in cfg.moe_layers}
    return Residency(model_fingerprint(source), cfg.num_experts, hot)


def _engine(path, residency_path, experts, cpu_backend="auto", threshold=None):
    settings = RunnerSettings(device="cpu", dtype="fp32", max_context=128, prefill_chunk=64)
    place = PlacementSettings(residency=str(residency_path), experts=experts, cpu_backend=cpu_backend,
                              upload_threshold=threshold)
    return load_engine(str(path), settings, place)


def _logits(loaded) -> torch.Tensor:
    """Prefill logits of PROMPT, then a few decode steps' logits (fixed tokens)."""
    r = loaded.runner
    rows = [r.forward(PROMPT, 0, all_logits=True)]
    for i, tok in enumerate(DECODE):
        rows.append(r.forward([tok], len(PROMPT) + i).reshape(1, -1))
    return torch.cat(rows)


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_q4_k_m_gives_two_pool_groups(tinyk_q4km, tmp_path):
    source = GGUFSource(tinyk_q4km)
    assert expert_formats(source) == {0: ("Q4_K", "Q4_K"), 1: ("Q4_K", "Q6_K")}
    assert set(expert_formats(source, "bf16").values()) == {None}
    assert use_more_bits(1, 2) and not use_more_bits(0, 2)
    _residency(source, 0.5).save(tmp_path / "r.json")
    h = _engine(tinyk_q4km, tmp_path / "r.json", "native").runner.experts
    pools = h.pools
    assert [p.qtypes for p in pools.groups] == [("Q4_K", "Q4_K"), ("Q4_K", "Q6_K")]
    assert pools.of(0).layers == [0] and pools.of(1).layers == [1]
    cfg = source.config
    D, F, K, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.num_experts
    for layer, p in ((0, pools.of(0)), (1, pools.of(1))):
        qt13, qt2 = p.qtypes
        assert p.w13.dtype == torch.uint8 and p.w13.shape[1:] == (2 * F, formats.row_bytes(qt13, D))
        assert p.w2.shape[1:] == (D, formats.row_bytes(qt2, F))
        assert p.num_hot == E // 2 and p.zero_hi - p.zero_lo == K and p.num_slots - p.flex_lo == E // 2
        assert p.expert_bytes == expert_sizes(cfg, torch.float32, expert_formats(source))[layer][1]
        assert not p.w13[p.zero_lo:p.zero_hi].any() and not p.w2[p.zero_lo:p.zero_hi].any()
        # the pool's hot slots and the host copies are the file's own blocks
        q = load_quantized_experts(source, layer)
        row = p.table_host[layer]
        hot = (row >= 0).nonzero().flatten()
        assert torch.equal(p.w13[row[hot].long()], q.w13[hot]) and torch.equal(p.w2[row[hot].long()], q.w2[hot])
        host = h.host.layers[layer]
        assert isinstance(host, QuantExpertWeights) and (host.qt13, host.qt2) == (qt13, qt2)
        cold = (h.host.compact[layer] >= 0).nonzero().flatten()
        assert torch.equal(host.w13, q.w13[cold]) and torch.equal(host.w2, q.w2[cold])
    bf = _engine(tinyk_q4km, tmp_path / "r.json", "bf16").runner.experts
    assert len(bf.pools.groups) == 1 and bf.pool.qtypes is None
    assert pools.nbytes * 3 < bf.pools.nbytes  # fp32 engine: about 7x fewer bytes in blocks
    with pytest.raises(Exception, match="one expert pool"):
        h.pool  # noqa: B018  several groups: no single pool


@pytest.mark.parametrize("qtype", QUANT_QTYPES)
def test_zero_slots_read_zero(qtype):
    """Zero bytes decode to 0 in every block format, and a pass over zero slots only is 0."""
    D, F, K, E = 256, 256, 4, 8
    assert not formats.dequantize(torch.zeros(3, formats.row_bytes(qtype, D), dtype=torch.uint8), qtype, D).any()
    pool = ExpertPool({0: [1, 5]}, 1, E, K, 2, (2 * F, D), (D, F), "cpu", torch.float32, (qtype, qtype))
    assert not pool.w13[pool.zero_lo:pool.zero_hi].any() and not pool.w2[pool.zero_lo:pool.zero_hi].any()
    pool.w13[:2] = torch.randint(0, 256, pool.w13[:2].shape, dtype=torch.uint8)  # garbage in the hot slots
    x = torch.randn(3, D)
    ids = torch.tensor([[0, 2, 3, 4]] * 3)  # all cold: every position reads its zero slot
    slots = pool.slots_for(0, ids)
    assert torch.equal(slots, pool.zero_of_position.expand(3, K))
    out = pool.forward(x, slots, torch.rand(3, K), out_dtype=torch.float32)
    assert torch.equal(out, torch.zeros(3, D))


def test_pool_forward_dispatches_by_format():
    """A quantized pool's forward equals a float pool holding its dequantized experts."""
    D, F, K, E = 256, 256, 2, 6
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * F, D, generator=g) / 16, torch.randn(E, D, F, generator=g) / 16
    q = QuantExpertWeights("Q4_K", formats.quantize(w13, "Q4_K"), "Q6_K", formats.quantize(w2, "Q6_K"))
    hot = {0: [0, 2, 3, 5]}
    qpools = ExpertPools.build(hot, 1, E, K, None, (2 * F, D), (D, F), "cpu", torch.float32, {0: ("Q4_K", "Q6_K")})
    fpools = ExpertPools.build(hot, 1, E, K, None, (2 * F, D), (D, F), "cpu", torch.float32)
    qpools.fill_layer(0, q)
    fpools.fill_layer(0, ExpertWeights(formats.dequantize(q.w13, "Q4_K", D), formats.dequantize(q.w2, "Q6_K", F)))
    ids = torch.randint(0, E, (5, K), generator=g)
    weights = torch.rand(5, K, generator=g)
    x = torch.randn(5, D, generator=g)
    qp, fp = qpools.of(0), fpools.of(0)
    a = qp.forward(x, qp.slots_for(0, ids), weights, out_dtype=torch.float32)
    b = fp.forward(x, fp.slots_for(0, ids), weights, out_dtype=torch.float32)
    assert a.abs().max() > 0 and _rel(a, b) < 1e-5
    host = HostExperts({0: [1, 4]}, E, (2 * F, D), (D, F), torch.float32, {0: ("Q4_K", "Q6_K")})
    host.fill_layer(0, q)
    assert torch.equal(host.layers[0].w13, q.w13[[1, 4]])
    nbytes = qp.upload([qp.flex_lo], host, 0, [4])  # a cold expert's blocks into a flex slot
    assert nbytes == qp.expert_bytes and torch.equal(qp.w13[qp.flex_lo], q.w13[4])
    # several in one call, in the order given; nothing for none; an expert without a host copy refused
    assert qp.upload([qp.flex_lo, qp.flex_lo + 1], host, 0, [4, 1]) == 2 * qp.expert_bytes
    for slot, e in ((qp.flex_lo, 4), (qp.flex_lo + 1, 1)):
        assert torch.equal(qp.w13[slot], q.w13[e]) and torch.equal(qp.w2[slot], q.w2[e])
    assert qp.upload([], host, 0, []) == 0
    with pytest.raises(ValueError, match=r"experts \[2\] have no host copy"):
        qp.upload([qp.flex_lo], host, 0, [2])


@pytest.mark.parametrize("amx_int8", [0, 2], ids=["row-kernels", "amx-int8"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_engine_logits_match_dequantized_experts(tinyk_q4km, tmp_path, fraction, amx_int8, monkeypatch):
    """Quantized pools and host copies against the same file's experts dequantized at load, over
    prefill and decode (split path); the CPU kernels against their torch reference; and with the
    prefill's experts of 2 routes or more on the AMX int8 tiles (OSTINATO_AMX_INT8), where the CPU has them."""
    monkeypatch.setenv("OSTINATO_AMX_INT8", str(amx_int8))
    if amx_int8 and not _amx_int8():
        pytest.skip("this CPU lacks AMX-INT8")
    source = GGUFSource(tinyk_q4km)
    _residency(source, fraction).save(tmp_path / "r.json")
    ref = _logits(_engine(tinyk_q4km, tmp_path / "r.json", "bf16", "torch"))
    native = _engine(tinyk_q4km, tmp_path / "r.json", "native")
    got = _logits(native)
    torch_ref = _logits(_engine(tinyk_q4km, tmp_path / "r.json", "native", "torch"))
    if fraction == 1.0:  # GPU branch only: the same fp32 math on the same values
        assert _rel(got, ref) < 1e-4
    else:  # the CPU branch quantizes its activations to int8 (module docstring)
        assert _rel(got, ref) < 1e-2
        assert native.runner.placement_stats()["cold_routes"] > 0
    # the CPU kernels against their torch reference, the same int8 activations: an h element within a
    # few fp32 ulps of a bf16 rounding midpoint may round the other way and, as its block's largest,
    # move the block's int8 scale (about 1e-3 of that route; tests/test_cpu_quant.py checks the bits)
    assert _rel(got, torch_ref) < 1e-3
    assert _rel(torch_ref, ref) < (1e-4 if fraction == 1.0 else 1e-2)
    if fraction < 1.0:  # the int8 step is visible, so the comparison above can fail
        assert _rel(got, ref) > 1e-6
    if amx_int8 and fraction < 1.0:  # the prefill's cold experts did go to the tiles
        native.runner.forward(PROMPT, 0)
        assert native.runner.experts.cpu.last_stats()["int8_experts"] > 0


def _amx_int8() -> bool:
    ext = build.load_cpu_extension()
    return ext is not None and ext.cpu_features()["amx_int8"]


def test_upload_path_copies_blocks(tinyk_q4km, tmp_path):
    """Np = 8: the prefill uploads each distinct cold expert's blocks into its group's flex slots."""
    source = GGUFSource(tinyk_q4km)
    _residency(source, 0.25).save(tmp_path / "r.json")
    ref = _logits(_engine(tinyk_q4km, tmp_path / "r.json", "bf16", "torch"))
    up = _engine(tinyk_q4km, tmp_path / "r.json", "native", threshold=8)
    got = _logits(up)
    stats = up.runner.placement_stats()
    assert stats["uploaded_experts"] > 0
    h = up.runner.experts
    cfg = source.config
    sizes = expert_sizes(cfg, torch.float32, expert_formats(source))
    assert stats["bytes_uploaded"] < stats["uploaded_experts"] * max(b for _, b in sizes.values()) + 1
    assert h.pools.of(1).expert_bytes > h.pools.of(0).expert_bytes  # Q6_K down projections
    assert _rel(got, ref) < 1e-2  # decode steps still go to the CPU kernels


def test_single_format_file_is_one_group(tiny_q8, tmp_path):
    source = GGUFSource(tiny_q8)
    _residency(source, 0.5).save(tmp_path / "r.json")
    native = _engine(tiny_q8, tmp_path / "r.json", "native")
    assert len(native.runner.experts.pools.groups) == 1 and native.runner.experts.pool.qtypes == ("Q8_0", "Q8_0")
    ref = _logits(_engine(tiny_q8, tmp_path / "r.json", "bf16", "torch"))
    assert _rel(_logits(native), ref) < 1e-2


def test_capacity_counts_quantized_bytes(dequant_from_512):
    """Qwen3-30B-A3B as Q4_K_M: 24 layers Q4_K/Q6_K, 24 Q4_K/Q4_K; the same budget holds
    about 3.3x the experts of bf16 (9.44 MB against 2.65 / 3.06 MB per expert), beside the dequantized
    path's scratch where a tuning takes that path from 512 tokens."""
    cfg = ModelConfig.from_dict(PRESETS["qwen3-30b-a3b"])
    L = cfg.num_hidden_layers
    fmts = {l: ("Q4_K", "Q6_K" if use_more_bits(l, L) else "Q4_K") for l in cfg.moe_layers}
    sizes = expert_sizes(cfg, torch.bfloat16, fmts)
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    assert sizes[0] == ("Q4_K/Q6_K", 2 * F * 144 * D // 256 + D * 210 * F // 256)
    assert {b for _, b in sizes.values()} == {2_654_208, 3_059_712}
    assert expert_bytes(cfg, torch.bfloat16) == 9_437_184
    g = torch.Generator().manual_seed(0)
    counts = {l: torch.rand(cfg.num_experts, generator=g) ** 4 for l in cfg.moe_layers}
    # no captured passes: a 512-row one would hold a dequantized scratch of its own (capacity.py pass_graph_bytes)
    s = CapacitySettings(prefill_chunk=512, pass_graph_rows=0)
    budget = 16 * 2**30
    bf = plan_capacity(cfg, counts, budget, 4096, torch.bfloat16, s)
    q = plan_capacity(cfg, counts, budget, 4096, torch.bfloat16, s, formats=WeightFormats(fmts))
    assert set(q.groups) == {"Q4_K/Q4_K", "Q4_K/Q6_K"} and all(v["layers"] == 24 for v in q.groups.values())
    assert list(bf.groups) == ["bfloat16"]
    # the same fixed part but the dequantized path's scratch (a 512-token pass is one it serves)
    scratch = q.activation_parts["dequant_scratch"]
    assert scratch > 0 and bf.activation_parts["dequant_scratch"] == 0 and q.fixed == bf.fixed + scratch
    assert q.pool_bytes <= budget - q.fixed and q.unused >= 0
    assert 3.0 < q.hot_slots / bf.hot_slots < 3.7, (q.hot_slots, bf.hot_slots)
    assert q.zero_slots == 2 * cfg.num_experts_per_tok and q.to_json()["groups"] == q.groups
    # one more hot expert would not fit: the bisection found the largest
    more = plan_capacity(cfg, counts, 2**45, 4096, torch.bfloat16, s, slots=q.hot_slots + 1, formats=WeightFormats(fmts))
    assert more.pool_bytes > budget - q.fixed


def test_captured_passes_below_the_dequantized_path_hold_no_scratch(dequant_from_512):
    """The default's largest captured pass (engine/graph.py STAGED_PASS_ROWS, 511) stays below the smallest
    threshold a tuning has set for the dequantized path (512, session 11's H200), so the graphs' own memory pool holds no dequantized scratch;
    a 512-row pass would hold one, on the Q4_K_M 30B shape about 200 MB."""
    from ostinato.engine.graph import STAGED_PASS_ROWS
    from ostinato.layers.moe.gpu_quant import fewest_dequant_tokens

    cfg = ModelConfig.from_dict(PRESETS["qwen3-30b-a3b"])
    fmts = WeightFormats({l: ("Q4_K", "Q6_K" if use_more_bits(l, cfg.num_hidden_layers) else "Q4_K")
                          for l in cfg.moe_layers})
    counts = {l: torch.ones(cfg.num_experts) for l in cfg.moe_layers}
    part = {rows: plan_capacity(cfg, counts, 16 * 2**30, 4096, torch.bfloat16, CapacitySettings(pass_graph_rows=rows),
                                formats=fmts).activation_parts["pass_graphs"] for rows in (STAGED_PASS_ROWS, 512)}
    assert STAGED_PASS_ROWS < fewest_dequant_tokens() <= 512
    assert 190e6 < part[512] - part[STAGED_PASS_ROWS] < 240e6, part


def test_captured_passes_stop_below_the_dequantized_path(tinyk_q4km, tmp_path, dequant_from_512):
    """Quantized experts in the compute dtype cap the rows of a captured pass below their device's
    dequant_min_tokens (that path finds a pass's distinct experts on the host: not capturable; session 46's
    OSTINATO_PASS_GRAPHS=1023 stopped with a capture error); float experts, or quantized ones computed in fp32
    (no dequantized path), do not. The runner reports the capped count."""
    from ostinato.layers.moe.gpu_quant import quant_tuning

    D, F, K, E = 256, 256, 2, 6
    hot = {0: [0, 2], 1: [1]}
    qt = {0: ("Q4_K", "Q6_K"), 1: ("Q4_K", "Q4_K")}
    build = lambda dtype, qtypes: ExpertPools.build(hot, 2, E, K, None, (2 * F, D), (D, F), "cpu", dtype, qtypes)  # noqa: E731
    limit = quant_tuning(torch.device("cpu"))["dequant_min_tokens"]
    assert build(torch.bfloat16, qt).graph_rows() == limit - 1
    assert build(torch.bfloat16, None).graph_rows() == float("inf")
    assert build(torch.float32, qt).graph_rows() == float("inf")

    _residency(GGUFSource(tinyk_q4km), 0.5).save(tmp_path / "half.json")
    place = lambda experts: PlacementSettings(residency=str(tmp_path / "half.json"), experts=experts)  # noqa: E731
    settings = RunnerSettings(device="cpu", dtype="bf16", max_context=2048, pass_graphs=1023)
    rows = {experts: load_engine(str(tinyk_q4km), settings, place(experts)).runner.pass_graph_rows()
            for experts in ("native", "bf16")}
    assert rows == {"native": limit - 1, "bf16": 1023}


def test_no_dequantized_path_leaves_captured_passes_uncapped():
    """Under the default tuning (no dequantized path: gpu_quant.DEFAULT_QUANT_TUNING) quantized experts in
    the compute dtype cap no captured pass, as float experts do not."""
    from ostinato.layers.moe.gpu_quant import quant_tuning

    assert quant_tuning(torch.device("cpu"))["dequant_min_tokens"] is None
    pools = ExpertPools.build({0: [0, 2], 1: [1]}, 2, 6, 2, None, (512, 256), (256, 256), "cpu", torch.bfloat16,
                              {0: ("Q4_K", "Q6_K"), 1: ("Q4_K", "Q4_K")})
    assert pools.graph_rows() == float("inf")


@pytest.mark.gpu
def test_graph_replay_with_quantized_pools_bitwise(tinyk_q4km, tmp_path):
    """CUDA: the decode graph over two quantized pools (Triton kernels, the handshake with the
    native CPU worker over block host copies) equals the synchronous path bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from ostinato.layers.moe.graph_hybrid import GraphHybridExperts
    from tests.test_graph import replay_vs_eager

    _residency(GGUFSource(tinyk_q4km), 0.5).save(tmp_path / "half.json")
    place = PlacementSettings(residency=str(tmp_path / "half.json"))
    graphed = load_engine(str(tinyk_q4km), RunnerSettings(device="cuda", dtype="bf16", max_context=2048), place)
    sync = load_engine(str(tinyk_q4km), RunnerSettings(device="cuda", dtype="bf16", max_context=2048,
                                                       cuda_graph=False), place)
    assert isinstance(graphed.runner.experts, GraphHybridExperts) and graphed.runner.graphs is not None
    assert len(graphed.runner.experts.hybrid.pools.groups) == 2
    replay_vs_eager(graphed, sync, steps=64)
    assert graphed.runner.placement_stats()["graph_cold_routes"] > 0
    graphed.runner.experts.close()


@pytest.mark.gpu
def test_warm_up_leaves_no_compile_to_the_turns(tinyk_q4km, tmp_path):
    """CUDA: after load.warm_up, passes of any size (each prefill tile-config bucket, odd and even,
    a few tokens to a long one) compile no triton kernel: a compile in a measured turn costs it up
    to seconds (results/2026-12-04-h200-s23)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from ostinato.engine.sampling import SamplingParams
    from ostinato.kernels.triton import compiles
    from ostinato.load import warm_up

    _residency(GGUFSource(tinyk_q4km), 0.5).save(tmp_path / "half.json")
    place = PlacementSettings(residency=str(tmp_path / "half.json"))
    loaded = load_engine(str(tinyk_q4km), RunnerSettings(device="cuda", dtype="bf16", max_context=2048), place)
    warm_up(loaded)
    torch.cuda.synchronize()
    before, g = compiles.count, torch.Generator().manual_seed(0)
    for n in (3, 17, 31, 50, 81, 200, 283, 333, 492, 700, 1100, 1500):
        prompt = torch.randint(5, 200, (n,), generator=g).tolist()
        for _ in loaded.engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0)):
            pass
        loaded.engine.reset()
    torch.cuda.synchronize()
    assert compiles.count == before, compiles.recent[-(compiles.count - before):]



def test_layers_loaded_on_worker_threads_fill_the_same_pools(tinyk_q4km, tmp_path, monkeypatch):
    """A GPU run loads with torch at one thread on the host's core (claim_host_thread), so its layers
    are copied on the workers' threads (threads.on_workers): the pools and host copies are the same
    bytes as a load in the calling thread, and each layer was loaded once, off the calling thread."""
    import threading

    from ostinato.engine import experts as experts_mod

    _residency(GGUFSource(tinyk_q4km), 0.5).save(tmp_path / "r.json")
    serial = _engine(tinyk_q4km, tmp_path / "r.json", "native").runner.experts
    seen = []
    load = experts_mod.load_layer_experts

    def spy(source, layer, *args):
        seen.append((layer, threading.current_thread() is threading.main_thread()))
        return load(source, layer, *args)

    monkeypatch.setattr(experts_mod, "load_layer_experts", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        settings = RunnerSettings(device="cpu", dtype="fp32", max_context=128, prefill_chunk=64, cpu_threads=4)
        place = PlacementSettings(residency=str(tmp_path / "r.json"), experts="native")
        threaded = load_engine(str(tinyk_q4km), settings, place).runner.experts
    finally:
        torch.set_num_threads(before)
    assert sorted(seen) == [(0, False), (1, False)]
    for a, b in zip(serial.pools.groups, threaded.pools.groups):  # hot and zero slots (flex ones: not yet filled)
        n = a.flex_lo
        assert torch.equal(a.w13[:n], b.w13[:n]) and torch.equal(a.w2[:n], b.w2[:n])
        assert torch.equal(a.table_host, b.table_host)
    for layer in (0, 1):
        a, b = serial.host.layers[layer], threaded.host.layers[layer]
        assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
