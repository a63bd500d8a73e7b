"""MoE layers split across devices (issue [G]), on the CPU: "cpu:0" and "cpu:1" are two
logical devices on one memory, so the split placement runs through the same code as on two
GPUs (pools, index tables, layer loop, hand-offs) and must give the one-device logits. The
decode graphs per device are checked on the CPU through their eager step (same stages,
buffers and hand-offs, nothing captured); on two GPUs (marked gpu) by replay."""
from __future__ import annotations

import pytest
import torch

from ostinato.config import ConfigError
from ostinato.engine.assign import assign_devices, assign_layers, layer_map
from ostinato.engine.devices import Segment, SplitExperts, backend_of, segments
from ostinato.engine.graph import DecodeGraphs
from ostinato.engine.placement import PlacementSettings
from ostinato.engine.residency import Residency, model_fingerprint
from ostinato.engine.runner import RunnerSettings
from ostinato.layers.moe.pool import COLD
from ostinato.load import load_engine
from ostinato.planner.fill import fill, fill_per_device
from tests.test_graph import replay_vs_eager

TWO = "cpu:0,cpu:1"
PROMPT = list(range(5, 5 + 60))


def _settings(**kw):
    return RunnerSettings(**{"device": "cpu", "dtype": "fp32", "max_context": 128, "prefill_chunk": 32,
                             "cuda_graph": False, **kw})


def _greedy(runner, prompt, steps=8):
    logits = runner.forward(prompt, 0)
    out = []
    for i in range(steps):
        out.append(int(logits.argmax()))
        logits = runner.forward(out[-1:], len(prompt) + i)
    return out


def _check_same(one, two):
    a = one.runner.forward(PROMPT, 0, all_logits=True)
    b = two.runner.forward(PROMPT, 0, all_logits=True)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    assert _greedy(one.runner, PROMPT[:20]) == _greedy(two.runner, PROMPT[:20])


@pytest.mark.parametrize("caps", [[1, 1], [1, 1, 1], [3, 1], [1, 2, 1]])
def test_assignment_is_contiguous_and_balanced(caps):
    costs = [10] * 12
    ranges = assign_layers(costs, caps, first_extra=3, last_extra=3)
    assert [l for r in ranges for l in r] == list(range(12)) and all(ranges)  # contiguous, each device a range
    loads = [sum(costs[l] for l in r) for r in ranges]
    loads[0] += 3
    loads[-1] += 3
    total = sum(loads)
    for load, cap in zip(loads, caps):  # within one layer of its cap's share
        assert abs(load - total * cap / sum(caps)) <= 10


def test_assignment_counts_embedding_and_head():
    ranges = assign_layers([10] * 4, [1, 1], first_extra=20)  # the embedding weighs two layers
    assert ranges == [[0], [1, 2, 3]]
    with pytest.raises(ValueError):
        assign_layers([10] * 2, [1, 1, 1])


def test_assignment_of_a_model(tiny_dir):
    from ostinato.sources import open_source

    cfg = open_source(tiny_dir).config
    devices = assign_devices(cfg, ["cuda:0", "cuda:1"], 128, torch.bfloat16)
    # the head (V x D) weighs on the last device; the embedding stays in host memory (host_embedding)
    assert devices == {"cuda:0": [0, 1, 2], "cuda:1": [3]}
    assert layer_map(devices, 4) == ["cuda:0", "cuda:0", "cuda:0", "cuda:1"]


def test_fill_per_device_ranks_each_devices_own_layers():
    g = torch.Generator().manual_seed(0)
    counts = {l: torch.rand(8, generator=g) * (10 if l < 2 else 1) for l in range(4)}  # layers 0-1 route more
    devices = {"a": [0, 1], "b": [2, 3]}
    hot = fill_per_device(counts, devices, {"a": 3, "b": 5})
    assert sum(len(hot[l]) for l in devices["a"]) == 3 and sum(len(hot[l]) for l in devices["b"]) == 5
    for d, layers in devices.items():
        assert {l: hot[l] for l in layers} == fill({l: counts[l] for l in layers}, 3 if d == "a" else 5)
    assert all(not v for l, v in fill(counts, 8).items() if l >= 2)  # one global fill would starve device b


FOUR = "cpu:0,cpu:1,cpu:2,cpu:3"  # the paper's four GPUs ([P]): on the CPU, a layer a device


@pytest.mark.parametrize("devices, layer_devices", [
    (TWO, ["cpu:0", "cpu:0", "cpu:0", "cpu:1"]),  # balanced as in test_assignment_of_a_model
    (FOUR, ["cpu:0", "cpu:1", "cpu:2", "cpu:3"])])
def test_split_reference_matches_one_device(tiny_dir, devices, layer_devices):
    one = load_engine(str(tiny_dir), _settings())
    split = load_engine(str(tiny_dir), _settings(devices=devices))
    assert split.runner.layer_devices == layer_devices
    _check_same(one, split)


SPLITS = {"two": {"cpu:0": [0], "cpu:1": [1, 2, 3]}, "four": {f"cpu:{l}": [l] for l in range(4)}}


def _split_residency(source, tmp_path, fraction=0.5, devices=SPLITS["two"]):
    cfg = source.config
    g = torch.Generator().manual_seed(3)
    n = round(fraction * cfg.num_experts)
    hot = {l: sorted(torch.randperm(cfg.num_experts, generator=g)[:n].tolist()) for l in cfg.moe_layers}
    fp = model_fingerprint(source)
    Residency(fp, cfg.num_experts, hot).save(tmp_path / "one.json")
    Residency(fp, cfg.num_experts, hot, devices=devices).save(tmp_path / "split.json")
    return hot


@pytest.mark.parametrize("split", ["two", "four"])
@pytest.mark.parametrize("threshold", [10**9, 16])  # split path / upload path for the 60-token prompt
def test_split_hybrid_matches_one_device(tiny_dir, tmp_path, threshold, split):
    from ostinato.sources import open_source

    devices = SPLITS[split]
    hot = _split_residency(open_source(tiny_dir), tmp_path, devices=devices)
    place = dict(upload_threshold=threshold, cpu_backend="torch", borrow_wait_copies=True)
    one = load_engine(str(tiny_dir), _settings(), PlacementSettings(residency=str(tmp_path / "one.json"), **place))
    # the residency's devices place the layers; no flag needed
    two = load_engine(str(tiny_dir), _settings(), PlacementSettings(residency=str(tmp_path / "split.json"), **place))
    _check_same(one, two)
    experts = two.runner.experts
    assert two.runner.layer_devices == layer_map(devices, 4)
    backends = experts.backends
    assert set(backends) == set(devices)
    assert len({id(b.cpu) for b in backends.values()}) == 1  # one CPU pool serves every device
    for name, layers in devices.items():
        pool = backends[name].pool
        assert pool.num_hot == sum(len(hot[l]) for l in layers)
        for l in range(4):
            row = pool.table_host[l]  # decode may have lent flex slots to its own layers' cold experts
            assert ((row >= 0) & (row < pool.flex_lo)).nonzero().flatten().tolist() == (hot[l] if l in layers else [])
            assert l in layers or (row == COLD).all()
    stats = two.runner.placement_stats()
    assert stats["cold_routes"] > 0 and stats["routes"] == one.runner.placement_stats()["routes"]


def test_devices_must_match_the_plan(tiny_dir, tmp_path):
    from ostinato.config import ConfigError
    from ostinato.sources import open_source

    _split_residency(open_source(tiny_dir), tmp_path)
    with pytest.raises(ConfigError, match="planned for devices"):
        load_engine(str(tiny_dir), _settings(devices="cpu:1,cpu:0"),
                    PlacementSettings(residency=str(tmp_path / "split.json"), cpu_backend="torch"))


def test_plan_per_device(tiny_dir, tmp_path, capsys):
    from ostinato.cli import main
    from ostinato.engine.routes import RouteCounts
    from ostinato.sources import open_source
    from ostinato.planner.capacity import CapacitySettings, device_capacity

    cfg = open_source(tiny_dir).config
    g = torch.Generator().manual_seed(1)
    prof = RouteCounts.zeros(cfg.moe_layers, cfg.num_experts)
    for l in cfg.moe_layers:  # skewed, and the later layers route far more: a global fill would favour them
        prof.prefill[l] += (torch.rand(cfg.num_experts, generator=g) ** 3 * 100 * (1 + 10 * l)).long()
    prof.tokens, prof.max_tokens, prof.sessions = {"prefill": 100, "decode": 20}, 128, 1
    prof.save(tmp_path / "p.json")
    counts = prof.total("all")
    s = CapacitySettings(margin_bytes=0, margin_fraction=0.0)
    devices = assign_devices(cfg, TWO.split(","), 128, torch.float32)  # the balanced assignment plan makes
    probes = [device_capacity(cfg, counts, 2**40, 128, torch.float32, layers, i == 0, i == 1, s)
              for i, layers in enumerate(devices.values())]
    # every slot that the head's device (the larger fixed part) needs to hold its layer whole; the first has room left
    budget = max(p.fixed for p in probes) + (cfg.num_experts_per_tok + 20) * probes[0].expert_bytes
    out = tmp_path / "r.json"
    assert main([str(a) for a in ("plan", "--model", tiny_dir, "--profile", tmp_path / "p.json", "--devices", TWO,
                                  "--dtype", "fp32", "--margin", 0, "--margin-fraction", 0, "--gpu-memory", budget,
                                  "-o", out)]) == 0
    assert "verification skipped" in capsys.readouterr().out
    res = Residency.load(out)
    assert res.devices == devices and res.gpu_memory == budget
    for i, (d, layers) in enumerate(res.devices.items()):
        cap = device_capacity(cfg, counts, budget, 128, torch.float32, layers, i == 0, i == 1, s)
        assert res.capacity["devices"][d]["hot_slots"] == cap.hot_slots
        want = fill({l: counts[l] for l in layers}, cap.hot_slots)
        assert {l: res.hot[l] for l in layers} == want  # filled from its own layers only
        assert sum(map(len, want.values())) == cap.hot_slots

    one = load_engine(str(tiny_dir), _settings())
    two = load_engine(str(tiny_dir), RunnerSettings(dtype="fp32", prefill_chunk=32, cuda_graph=False),
                      PlacementSettings(residency=str(out), cpu_backend="torch"))
    assert two.runner.max_context == 128 and two.runner.layer_devices == layer_map(devices, 4)
    _check_same(one, two)


def test_segments_of_layer_devices():
    assert segments(["a", "a", "b", "b", "b"]) == [Segment("a", range(0, 2), True, False),
                                                  Segment("b", range(2, 5), False, True)]
    assert segments(["cuda:0"] * 3) == [Segment("cuda:0", range(3), True, True)]
    three = segments(["cpu:0", "cpu:1", "cpu:2"])
    assert [(s.first, s.last) for s in three] == [(True, False), (False, False), (False, True)]
    assert three[1].device == torch.device("cpu") and segments(["cuda:1"])[0].device == torch.device("cuda:1")
    with pytest.raises(ConfigError, match="contiguous"):
        segments(["a", "b", "a"])


def test_split_experts_hooks_per_device():
    from ostinato.layers.moe.backend import MoEBackend

    class Backend(MoEBackend):
        def __init__(self, capturable):
            self.capturable, self.calls = capturable, []

        def after_decode_step(self):
            self.calls.append("after")

    a, b = Backend(True), Backend(False)
    split = SplitExperts({"cpu:0": a, "cpu:1": b}, ["cpu:0", "cpu:1", "cpu:1"])
    assert not split.capturable
    split.wrap(lambda backend, name: Backend(True) if name == "cpu:1" else backend)
    assert split.capturable and split.backends["cpu:0"] is a
    split.after_decode_step()
    assert a.calls == ["after"] and split.backends["cpu:1"].calls == ["after"]
    segs = segments(split.layer_devices)
    assert [backend_of(split, s) for s in segs] == [a, split.backends["cpu:1"]]
    assert backend_of(a, segs[1]) is a  # one backend serves every segment


def _stepped(runner, steps=24):
    """Greedy decode through DecodeGraphs' eager step (the static buffers and hand-offs the
    graphs capture), each step checked bitwise against decode_windowed."""
    graphs = DecodeGraphs(runner)
    assert len(graphs.stages) == len(runner.segments)
    logits = runner.forward(PROMPT[:20], 0)
    tokens = []
    for pos in range(20, 20 + steps):
        tokens.append(int(logits.argmax()))
        logits = graphs.run(tokens[-1], pos)
        assert torch.equal(logits, runner.decode_windowed(tokens[-1], pos))
    return tokens


@pytest.mark.parametrize("residency", [None, "split.json"])
def test_decode_stages_equal_the_eager_windowed_step(tiny_dir, tmp_path, residency):
    from ostinato.sources import open_source

    _split_residency(open_source(tiny_dir), tmp_path)
    one = load_engine(str(tiny_dir), _settings())
    if residency is None:
        two = load_engine(str(tiny_dir), _settings(devices="cpu:0,cpu:1,cpu:2"))
        assert sorted(set(two.runner.layer_devices)) == ["cpu:0", "cpu:1", "cpu:2"]
    else:
        place = PlacementSettings(residency=str(tmp_path / residency), cpu_backend="torch")
        two = load_engine(str(tiny_dir), _settings(), place)
        backends = two.runner.experts.backends
        assert list(backends["cpu:0"].has_cold) == [0] and list(backends["cpu:1"].has_cold) == [1, 2, 3]
    assert len(two.runner.segments) == (3 if residency is None else 2)
    assert _stepped(one.runner) == _stepped(two.runner)


def _two_gpu_engines(tiny_dir, tmp_path, fraction, borrow):
    from ostinato.sources import open_source
    from tests.test_hybrid import _residency_for

    source = open_source(tiny_dir)
    res = _residency_for(source, fraction)
    res.save(tmp_path / "one.json")
    Residency(res.fingerprint, res.num_experts, res.hot, devices={"cuda:0": [0, 1], "cuda:1": [2, 3]}).save(
        tmp_path / "split.json")
    place = dict(borrow=borrow, borrow_wait_copies=True)
    settings = dict(dtype="bf16", max_context=2048)

    def engine(residency, graphs, **kw):
        return load_engine(str(tiny_dir), RunnerSettings(cuda_graph=graphs, **settings, **kw),
                           PlacementSettings(residency=str(tmp_path / residency), **place))

    return engine


def _skip_without_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")


@pytest.mark.gpu
@pytest.mark.parametrize("borrow", [False, True])
def test_graph_per_gpu_with_cpu_workers_bitwise_equals_eager(tiny_dir, tmp_path, borrow):
    """Half the experts cold, layers split over two GPUs: one graph per GPU, each device's
    hybrid backend with its own handshake and native worker on the one CPU pool; replay is
    bitwise the eager windowed step, greedy tokens those of one GPU's graphs."""
    from ostinato.layers.moe.graph_hybrid import GraphHybridExperts

    _skip_without_two_gpus()
    engine = _two_gpu_engines(tiny_dir, tmp_path, 0.5, borrow)
    graphed = engine("split.json", True, devices="cuda:0,cuda:1")
    sync = engine("split.json", False, devices="cuda:0,cuda:1")
    runner = graphed.runner
    assert runner.layer_devices == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"] and runner.graphs is not None
    assert [s.device for s in runner.graphs.stages] == [torch.device("cuda:0"), torch.device("cuda:1")]
    backends = list(runner.experts.backends.values())
    assert all(isinstance(b, GraphHybridExperts) for b in backends) and sync.runner.graphs is None
    assert backends[0].hybrid.cpu is backends[1].hybrid.cpu  # one CPU pool, two workers
    assert list(backends[0].index) == [0, 1] and list(backends[1].index) == [2, 3]
    tokens = replay_vs_eager(graphed, sync, device=torch.device("cuda:0"))
    for b in backends:  # each device's worker served its own layers' cold routes
        s = b.worker.stats()
        assert s["cold_routes"] > 0 and s["errors"] == 0 and s["last_error"] == ""
    assert (runner.placement_stats().get("borrowed", 0) > 0) == borrow
    runner.experts.close()
    sync.runner.experts.close()
    if not borrow:  # borrowing picks per device, so only then is one GPU's run the same placement
        one = engine("one.json", True, device="cuda:0")
        assert one.runner.graphs is not None and isinstance(one.runner.experts, GraphHybridExperts)
        assert _greedy_graphed(one.runner, len(tokens)) == tokens
        one.runner.experts.close()


@pytest.mark.gpu
def test_graph_per_gpu_all_resident_bitwise_equals_eager(tiny_dir, tmp_path):
    """Every expert resident (no CPU worker), layers split over two GPUs."""
    _skip_without_two_gpus()
    engine = _two_gpu_engines(tiny_dir, tmp_path, 1.0, False)
    graphed = engine("split.json", True, devices="cuda:0,cuda:1")
    sync = engine("split.json", False, devices="cuda:0,cuda:1")
    assert graphed.runner.graphs is not None and len(graphed.runner.graphs.stages) == 2
    tokens = replay_vs_eager(graphed, sync, device=torch.device("cuda:0"))
    one = engine("one.json", True, device="cuda:0")
    assert one.runner.graphs is not None
    assert _greedy_graphed(one.runner, len(tokens)) == tokens


def _greedy_graphed(runner, steps):
    runner.forward(list(range(5, 105)), 0)
    token, pos, tokens = 7, 100, []
    for _ in range(steps):
        token, pos = int(runner.forward([token], pos).argmax()), pos + 1
        tokens.append(token)
    return tokens
