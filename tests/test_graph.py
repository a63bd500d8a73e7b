"""Decode with a device-side position (the captured step's computation) and CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

from ostinato.config import ConfigError
from ostinato.engine.graph import PassGraphs, pass_sizes, window_sizes
from ostinato.engine.runner import ModelRunner, RunnerSettings
from ostinato.loader.source import CheckpointSource
from ostinato.models.common import DecodeWindow


def test_window_sizes():
    assert window_sizes(16384) == [1024, 2048, 4096, 8192, 16384]
    assert window_sizes(3000) == [1024, 2048, 3000]
    assert window_sizes(512) == [512]


def test_windowed_decode_matches_prefill(tiny_dir):
    """One window object reused for every position, as a captured graph reuses it."""
    r = ModelRunner(CheckpointSource(tiny_dir), RunnerSettings(device="cpu", dtype="fp32", max_context=2048))
    ids = list(range(10, 70))
    ref = r.forward(ids, 0, all_logits=True)
    r.forward(ids[:40], 0)
    pos = torch.zeros(1, dtype=torch.long)
    window = DecodeWindow(pos, 1024)
    got = []
    with torch.inference_mode():
        for p in range(40, 60):
            pos.fill_(p)
            got.append(r.model.logits(r.model(torch.tensor([ids[p]]), pos, r.kv.layers, 0, window))[0])
            assert torch.equal(got[-1], r.decode_windowed(ids[p], p)) or p == 40
    err = (torch.stack(got) - ref[40:60]).abs().max() / ref.abs().max()
    assert err < 1e-5


def test_pass_sizes():
    assert pass_sizes(256) == [8, 16, 32, 64, 128, 256]
    assert pass_sizes(100) == [8, 16, 32, 64, 100]
    assert pass_sizes(8) == [8] and pass_sizes(5) == [5] and pass_sizes(1) == pass_sizes(0) == []
    assert pass_sizes(511, midpoints=128) == [8, 16, 32, 64, 128, 192, 256, 383, 511]
    assert pass_sizes(100, midpoints=8) == [8, 12, 16, 24, 32, 48, 64, 82, 100]
    assert pass_sizes(256, midpoints=512) == pass_sizes(256, midpoints=0) == pass_sizes(256)


def test_pass_midpoints_from_the_environment(monkeypatch):
    monkeypatch.setenv("OSTINATO_PASS_MIDPOINTS", "128")
    assert pass_sizes(511) == [8, 16, 32, 64, 128, 192, 256, 383, 511]
    monkeypatch.setenv("OSTINATO_PASS_MIDPOINTS", "half")
    with pytest.raises(ConfigError, match="OSTINATO_PASS_MIDPOINTS must be a count of rows"):
        pass_sizes(511)


def test_pass_rows_setting(monkeypatch):
    """The captured pass rows: the setting, else OSTINATO_PASS_GRAPHS, else 511 where captured passes stage
    their cold experts (the default) and 256 where they do not; at most the context; none on a split model;
    a value that is not a count is refused with a message."""
    from ostinato.engine.graph import pass_rows

    monkeypatch.delenv("OSTINATO_PASS_GRAPHS", raising=False)
    monkeypatch.delenv("OSTINATO_STAGE_ROUTES", raising=False)
    assert pass_rows(None, False, 8192) == 511 and pass_rows(None, False, 100) == 100
    monkeypatch.setenv("OSTINATO_STAGE_ROUTES", "0")
    assert pass_rows(None, False, 8192) == 256
    assert pass_rows(64, False, 8192) == 64 and pass_rows(None, True, 8192) == pass_rows(64, True, 8192) == 0
    monkeypatch.setenv("OSTINATO_PASS_GRAPHS", "0")
    assert pass_rows(None, False, 8192) == 0
    for bad in ("-1", "lots", "32.5"):
        monkeypatch.setenv("OSTINATO_PASS_GRAPHS", bad)
        with pytest.raises(ConfigError, match=f"OSTINATO_PASS_GRAPHS must be a count of tokens .*{bad!r}"):
            pass_rows(None, False, 8192)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_windowed_pass_matches_prefill(tiny_dir, device):
    """windowed_passes_vs_prefill on the tiny Qwen3 (tests/test_gpt_oss.py and test_deepseek_v3.py: theirs)."""
    windowed_passes_vs_prefill(tiny_dir, device)


def windowed_passes_vs_prefill(ckpt, device: str) -> None:
    """Short prefill passes of the checkpoint ckpt through a window of B rows, the first position on the
    device (the computation PassGraphs captures; on CUDA the split-K kernel), fp32: the real rows' logits
    and the cache rows they write equal the host-driven prefill's; the padding rows past n change no real
    row."""
    r = ModelRunner(CheckpointSource(ckpt), RunnerSettings(device=device, dtype="fp32", max_context=256,
                                                           cuda_graph=False))
    ids = torch.randint(0, 4000, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = r.forward(ids, 0, all_logits=True)
    kv_ref = [{name: t[:60].clone() for name, t in layer.tensors.items()} for layer in r.kv.layers]
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    for B, start, n in ((16, 3, 13), (16, 40, 16), (16, 50, 10), (2, 5, 2), (2, 58, 1)):
        pos = torch.tensor([start], device=device)
        window = DecodeWindow(pos, 128, B)
        r.forward(ids[:start], 0)
        tokens = torch.tensor(ids[start:start + n] + [0] * (B - n))
        with torch.inference_mode():
            got = r.model.logits(r._hidden(tokens, pos, 0, window))[:n]
        end = start + n
        assert rel(got, ref[start:end]) < (1e-5 if device == "cpu" else 1e-4), (B, start, n)
        for want, layer in zip(kv_ref, r.kv.layers):
            for name, t in want.items():
                assert rel(layer.tensors[name][start:end], t[start:end]) < 1e-5, (name, B, start, n)


def test_pass_buffers_match_host_driven_pass(tiny_dir):
    """PassGraphs' static buffers stepped eagerly on the CPU (the computation a capture records): the
    padded pass's last logits equal the host-driven pass's, and the route tally counts its real rows
    alone, as prefill."""
    r = ModelRunner(CheckpointSource(tiny_dir), RunnerSettings(device="cpu", dtype="fp32", max_context=2048,
                                                                count_routes=True))
    passes = PassGraphs(r, pass_sizes(16, midpoints=8))
    assert passes.sizes == [8, 12, 16] and passes.size_for(10, 0) == passes.size_for(12, 0) is None
    ids = list(range(10, 70))
    for start, n, B in ((40, 13, 16), (45, 10, 12), (53, 5, 8), (58, 2, 8)):
        r.forward(ids[:start], 0)
        r.routes.reset()
        want = r.forward(ids[start:start + n], start)
        counts = r.routes.take()
        r.forward(ids[:start], 0)
        r.routes.reset()
        got = passes.run(B, ids[start:start + n], start)
        counted = r.routes.take()
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (start, n)
        assert counted.tokens == {"prefill": n, "decode": 0} == counts.tokens
        assert all(torch.equal(counted.prefill[l], counts.prefill[l]) for l in counts.prefill)
    assert passes.size_for(5, 0) is None  # the reference backend captures no pass


@pytest.mark.gpu
def test_graph_replay_bitwise_equals_eager_all_gpu(tiny_dir, tmp_path):
    """All experts resident: the captured step equals the same step run eagerly, bit for bit,
    over 256 decode steps."""
    from ostinato.engine.placement import PlacementSettings
    from ostinato.load import load_engine
    from tests.test_hybrid import _residency_for

    settings = RunnerSettings(device="cuda", dtype="bf16", max_context=2048)
    plain = load_engine(str(tiny_dir), RunnerSettings(device="cuda", dtype="bf16", max_context=2048,
                                                      cuda_graph=False))
    res = _residency_for(plain.source, 1.0)
    res.save(tmp_path / "all.json")
    del plain
    graphed = load_engine(str(tiny_dir), settings, PlacementSettings(residency=str(tmp_path / "all.json")))
    eager = load_engine(str(tiny_dir), RunnerSettings(device="cuda", dtype="bf16", max_context=2048, cuda_graph=False),
                        PlacementSettings(residency=str(tmp_path / "all.json")))
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    replay_vs_eager(graphed, eager, steps=256)


@pytest.mark.gpu
@pytest.mark.parametrize("borrow", [False, True])
def test_graph_with_cpu_worker_bitwise_equals_synchronous_path(tiny_dir, tmp_path, borrow):
    """Half the experts cold: the graph step (mapped-memory handshake with the native worker)
    equals the host-driven synchronous path under the same placement, over 256 steps, with
    and without borrowed experts (copies applied at the boundary they start, so both engines
    switch at the same token)."""
    from ostinato.engine.placement import PlacementSettings
    from ostinato.layers.moe.graph_hybrid import GraphHybridExperts
    from ostinato.load import load_engine
    from ostinato.loader.source import CheckpointSource
    from tests.test_hybrid import _residency_for

    _residency_for(CheckpointSource(tiny_dir), 0.5).save(tmp_path / "half.json")
    place = PlacementSettings(residency=str(tmp_path / "half.json"), borrow=borrow,
                              borrow_wait_copies=True)
    graphed = load_engine(str(tiny_dir), RunnerSettings(device="cuda", dtype="bf16", max_context=2048), place)
    sync = load_engine(str(tiny_dir), RunnerSettings(device="cuda", dtype="bf16", max_context=2048,
                                                     cuda_graph=False), place)
    assert isinstance(graphed.runner.experts, GraphHybridExperts) and graphed.runner.graphs is not None
    replay_vs_eager(graphed, sync, steps=256)
    stats = graphed.runner.placement_stats()
    assert stats["graph_cold_routes"] > 0
    assert (stats.get("borrowed", 0) > 0) == borrow
    if borrow:  # the post kernel's scoring equals Borrowing.observe's: same scores, same switches
        g, s = graphed.runner.experts.hybrid.borrow, sync.runner.experts.borrow
        assert torch.equal(g.scores, s.scores) and int(g.hits) == int(s.hits) > 0
        assert g.counters == s.counters
    graphed.runner.experts.close()


@pytest.mark.gpu
@pytest.mark.parametrize("cold", [0.0, 0.5])
def test_pass_graphs_match_host_driven_passes(tiny_dir, tmp_path, cold):
    """Short prefill passes replayed as captured graphs (padded to their size, the CPU branch through
    the worker's rows) against the host-driven passes of an engine without graphs: the same greedy
    token after every pass, logits within bf16 rounding (the attention kernels differ: split-K against
    SDPA's), the same routes counted and as many cold ones, and the same tokens decoded after."""
    pass_graphs_vs_host_driven(tiny_dir, tmp_path, cold)


@pytest.mark.gpu
def test_pass_graphs_stage_cold_experts(tiny_dir, tmp_path):
    """Captured passes that stage their cold experts with at least 2 routes (layers/moe/staging.py):
    against the host-driven passes as above, those experts now copied by the pass itself and computed
    on the GPU, the worker leaving them out."""
    pass_graphs_vs_host_driven(tiny_dir, tmp_path, 0.5, staged=True)


@pytest.mark.gpu
def test_pass_graphs_stage_from_a_pass_size(tiny_dir, tmp_path):
    """The same with OSTINATO_STAGE_FROM=32: the passes padded to 8 and 16 rows stage nothing, those of 64 do,
    and the last pass (2 tokens, 8 rows), after one that staged, posts zero marks: were the worker to keep the
    earlier marks, it would leave out routes that no branch computes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OSTINATO_STAGE_FROM", "32")
        pass_graphs_vs_host_driven(tiny_dir, tmp_path, 0.5, staged=True)


@pytest.mark.gpu
def test_pass_graphs_stage_by_the_calibrated_costs(tiny_dir, tmp_path):
    """The same with the rule "balance" (OSTINATO_STAGE_ROUTES=balance): as many of a layer's most-routed
    cold experts as the split with uploads would upload, by a calibration's costs (an upload 0.01 ms, the
    CPU 0.005 ms an expert and a route)."""
    pass_graphs_vs_host_driven(tiny_dir, tmp_path, 0.5, staged="balance")


@pytest.mark.gpu
def test_pass_graphs_prefetch_the_next_layers_experts(tiny_dir, tmp_path):
    """The same with OSTINATO_PREFETCH=2 from 8 rows: each layer of a pass also copies, on the copy stream
    while it runs, the next layer's two cold experts of most routes in the passes before; the next layer
    computes them on the GPU where routed, its own plan and its worker leaving them out."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OSTINATO_PREFETCH", "2")
        mp.setenv("OSTINATO_PREFETCH_FROM", "8")
        pass_graphs_vs_host_driven(tiny_dir, tmp_path, 0.5, staged=True, prefetch=True)


def assert_same_greedy(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    """Logits a and b [V] pick the same greedy token up to a tie within tol: each one's pick scores within
    tol of the other's best. The tiny random model's top two logits may lie a bf16 step apart, where
    two attention kernels' rounding picks either (session 36's H100 run: 102 against 1948)."""
    for x, y in ((a, b), (b, a)):
        assert float(x[int(y.argmax())]) >= float(x.max()) - tol, (int(a.argmax()), int(b.argmax()))


def pass_graphs_vs_host_driven(ckpt, tmp_path, cold: float, staged: bool | str = False, prefetch: bool = False) -> None:
    """test_pass_graphs_match_host_driven_passes on the checkpoint ckpt, a fraction `cold` of its
    experts on the CPU; staged: the graphed engine's passes stage their cold experts of 2 routes or more
    (True: OSTINATO_STAGE_ROUTES=2), or by the rule "balance" and a calibration's costs, else none (0,
    whatever the default); prefetch: the passes after the first copy some of the next layer's experts
    (OSTINATO_PREFETCH set by the caller), else none (OSTINATO_PREFETCH=0, whatever the default)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OSTINATO_STAGE_ROUTES", "balance" if staged == "balance" else "2" if staged else "0")
        if not prefetch:
            mp.setenv("OSTINATO_PREFETCH", "0")
        _pass_graphs_vs_host_driven(ckpt, tmp_path, cold, bool(staged), staged == "balance", prefetch)


def _pass_graphs_vs_host_driven(ckpt, tmp_path, cold: float, staged: bool, costs: bool, prefetch: bool) -> None:
    from ostinato.engine.placement import PlacementSettings
    from ostinato.layers.moe.staging import StageCosts
    from ostinato.load import load_engine
    from tests.test_hybrid import _residency_for

    res = _residency_for(CheckpointSource(ckpt), 1.0 - cold)
    if costs:  # MixedPass.from_calibration(measured=False): an upload 1e6 bytes at 100 GB/s, 0.01 ms
        res.calibration = {"cpu_pass": {"alpha_ms": 0.0, "beta_expert_ms": 0.005, "beta_route_ms": 0.005},
                           "upload_gbps": 100.0, "expert_bytes": 1_000_000}
    res.save(tmp_path / "res.json")
    place = PlacementSettings(residency=str(tmp_path / "res.json"))
    graphed = load_engine(str(ckpt), RunnerSettings(device="cuda", dtype="bf16", max_context=2048,
                                                    pass_graphs=64), place)
    sync = load_engine(str(ckpt), RunnerSettings(device="cuda", dtype="bf16", max_context=2048,
                                                 cuda_graph=False), place)
    staging = getattr(graphed.runner.experts, "staging", None)
    assert (staging is not None) == staged  # all resident: no handshake
    assert not costs or staging.rule == StageCosts(10_000, 0, 5_000, 5_000)
    passes = graphed.runner.passes
    assert passes is not None and passes.sizes == [8, 16, 32, 64]
    prompt = list(range(5, 105))
    graphed.runner.forward(prompt, 0)
    sync.runner.forward(prompt, 0)
    before = graphed.runner.placement_stats(), sync.runner.placement_stats()
    pos = len(prompt)
    for n in (3, 9, 16, 40, 64, 2):
        assert passes.size_for(n, pos) is not None
        tokens = [(pos * 7 + i) % 200 + 3 for i in range(n)]
        a, b = graphed.runner.forward(tokens, pos), sync.runner.forward(tokens, pos)
        assert (a - b).abs().max() <= 0.05 * b.abs().max(), n
        assert_same_greedy(a, b, 0.02 * b.abs().max())
        pos += n
    after = graphed.runner.placement_stats(), sync.runner.placement_stats()
    assert after[0]["routes"] - before[0]["routes"] == after[1]["routes"] - before[1]["routes"]
    if staged:  # some experts left the CPU for the GPU
        got, want = (s["cpu_experts"] - b["cpu_experts"] for s, b in zip(after, before))
        assert 0 < got < want and after[0]["uploaded_experts"] > before[0]["uploaded_experts"], (got, want)
    elif cold:
        assert after[0]["graph_steps"] - before[0]["graph_steps"] >= 6  # every pass went through the worker
        for key in ("cold_routes", "cpu_experts"):  # routing may differ where bf16 rounding breaks a tie
            got, want = (s[key] - b[key] for s, b in zip(after, before))
            assert want > 0 and abs(got - want) <= 0.02 * want, (key, got, want)
    assert (after[0].get("bytes_prefetched", 0) > before[0].get("bytes_prefetched", 0)) == prefetch
    token = 7
    for _ in range(4):
        a, b = graphed.runner.forward([token], pos), sync.runner.forward([token], pos)
        assert_same_greedy(a, b, 0.02 * b.abs().max())
        token, pos = int(b.argmax()), pos + 1
    assert passes.size_for(65, 200) is None and passes.size_for(8, 2045) is None  # too many rows; past the cache
    graphed.runner.experts.close()


def _decode_profile(tiny_dir):
    """A CPU engine on the tiny model (for its source) and a decode profile ranking expert e of
    every layer above e + 1."""
    from ostinato.engine.routes import RouteCounts
    from ostinato.load import load_engine

    probe = load_engine(str(tiny_dir), RunnerSettings(device="cpu", max_context=64))
    cfg = probe.source.config
    counts = RouteCounts.zeros(cfg.moe_layers, cfg.num_experts)
    for l in cfg.moe_layers:
        counts.decode[l] = torch.arange(cfg.num_experts, 0, -1)
    counts.tokens["decode"] = 10
    return probe, counts


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["expert-cache", "decaying-cache"])
def test_caches_decode_as_graph_segments_bitwise(tiny_dir, name):
    """A cache's decode step replays as graph segments cut at each MoE layer, with its plan,
    uploads and CPU branch on the host between them: bitwise equal to its synchronous path, the
    cache evolving exactly as there (the capture's warm-up leaves it alone), the cuts timed."""
    from ostinato.engine.graph import GraphChain
    from ostinato.load import load_engine
    from ostinato.policies.factory import policy_factory
    from ostinato.policies.settings import PolicySettings

    probe, counts = _decode_profile(tiny_dir)
    cfg = probe.source.config
    ps = PolicySettings(expert_slots=cfg.num_experts * len(cfg.moe_layers) // 4 + cfg.num_experts + 8,
                        profile=counts, offload_threshold=32)

    def engine(graphs):
        settings = RunnerSettings(device="cuda", dtype="bf16", max_context=2048, cuda_graph=graphs)
        return load_engine(str(tiny_dir), settings, experts_factory=policy_factory(name, ps))

    graphed, sync = engine(True), engine(False)
    chain = graphed.runner.graphs.stages[0].graphs[1024][0]
    assert isinstance(chain, GraphChain) and len(chain.parts) == len(cfg.moe_layers) + 1
    tables = lambda loaded: torch.stack([p.table_host for p in loaded.runner.experts.unwrapped.pools.groups])  # noqa: E731
    assert torch.equal(tables(graphed), tables(sync))  # the capture's warm-up left the cache alone
    replay_vs_eager(graphed, sync, steps=64)
    assert torch.equal(tables(graphed), tables(sync))
    g, s = graphed.runner.experts, sync.runner.experts
    stats, ref = g.stats(), s.stats()
    for k in ("routes", "cold_routes", "uploaded_experts", "cpu_experts", "evictions"):
        assert stats.get(k, 0) == ref.get(k, 0), k
    assert stats["uploaded_experts"] > 0
    assert stats["segment_cuts"] == (64 // 8) * len(cfg.moe_layers) and stats["segment_gap_ms"] > 0
    g.close()
    s.close()


def replay_vs_eager(graphed, sync, steps=96, device=None):
    """Greedy tokens of the graphed engine; every replay bitwise equal to the eager windowed
    step of an engine without graphs (its hooks called after each step, as the graphed
    runner calls them, so borrowing switches at the same tokens in both); device: where the
    logits must come back."""
    prompt = list(range(5, 105))
    # the prompt host-driven in both engines, so that the steps start from the same cache: a captured
    # pass computes its attention with another kernel (test_pass_graphs_match_host_driven_passes)
    passes, graphed.runner.passes = graphed.runner.passes, None
    graphed.runner.forward(prompt, 0)
    graphed.runner.passes = passes
    sync.runner.forward(prompt, 0)
    token, pos, tokens = 7, len(prompt), []
    for _ in range(steps):
        a = graphed.runner.forward([token], pos)
        b = sync.runner.decode_windowed(token, pos)
        sync.runner.experts.after_decode_step()
        assert a.device == b.device and (device is None or a.device == device)
        assert torch.equal(a, b), (f"step {len(tokens)}: max diff {float((a - b).abs().max())}; borrowing "
                                   f"(graph, eager): {borrow_state(graphed)} {borrow_state(sync)}")
        token, pos = int(a.argmax()), pos + 1
        tokens.append(token)
    return tokens


def borrow_state(engine) -> list:
    """Per hybrid backend: (sum of scores, borrowed hits, borrowed (layer, expert)s), to tell a
    divergence in borrowing from one in the computation."""
    experts = engine.runner.experts
    out = []
    for b in getattr(experts, "backends", {"": experts}).values():
        borrow = getattr(b.unwrapped, "borrow", None)
        if borrow is not None:
            out.append((round(float(borrow.scores.sum()), 3), int(borrow.hits), sorted(borrow.owner.values())))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["layers", "fixed-per-layer", "fixed-uniform", "ktransformers", "cpu"])
def test_static_baselines_decode_as_one_graph_bitwise(tiny_dir, name):
    """Every static baseline runs on the one executor and decodes as one CUDA graph with the
    handshake, exactly as Ostinato does: bitwise equal to its own synchronous path."""
    from ostinato.engine.residency import Residency, model_fingerprint
    from ostinato.layers.moe.graph_hybrid import GraphHybridExperts
    from ostinato.load import load_engine
    from ostinato.planner.fill import fill
    from ostinato.policies.factory import policy_factory
    from ostinato.policies.settings import PolicySettings

    def engine(graphs):
        settings = RunnerSettings(device="cuda", dtype="bf16", max_context=2048, cuda_graph=graphs)
        return load_engine(str(tiny_dir), settings, experts_factory=policy_factory(name, ps))

    probe, counts = _decode_profile(tiny_dir)
    cfg = probe.source.config
    hot = fill({l: torch.arange(cfg.num_experts, 0, -1) for l in cfg.moe_layers}, cfg.num_experts)
    ps = PolicySettings(expert_slots=cfg.num_experts * len(cfg.moe_layers) // 2 + 20, profile=counts,
                        residency=Residency(model_fingerprint(probe.source), cfg.num_experts, hot), offload_threshold=32)
    graphed, sync = engine(True), engine(False)
    assert isinstance(graphed.runner.experts, GraphHybridExperts) and graphed.runner.graphs is not None
    s0 = graphed.runner.placement_stats()  # the capture's warm-up steps ran through the worker: not decode
    replay_vs_eager(graphed, sync, steps=64)
    s1 = graphed.runner.placement_stats()
    cold = s1["graph_cold_routes"] - s0.get("graph_cold_routes", 0)
    assert cold > 0
    assert s1["cpu_experts"] - s0.get("cpu_experts", 0) >= cold  # a graph step's CPU experts are counted too
    graphed.runner.experts.close()
