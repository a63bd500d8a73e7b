"""`ostinato serve MODEL --gpu-memory CAP` plans for itself (jobs/serve_plan.py): it plans in hybrid
from the start, caches the plan, a second start reuses it, the server counts what it routes and
keeps it beside the plan (planner/served.py), and `--replan` / `plan --from-served` plan again from
those routes. On the CPU the cap sizes the plan (the capacity test) without being enforced."""
from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

from ostinato.engine.placement import PlacementSettings
from ostinato.engine.residency import Residency, measured
from ostinato.engine.runner import RunnerSettings
from ostinato.jobs.serve_plan import AutoPlan, load_planned, plan_dir, plan_key
from ostinato.planner.calibrate import CalibrateSettings
from ostinato.planner.served import ServedRoutes, learned_profile, served_path

MODEL = "synth:tiny?layers=2"
SETTINGS = RunnerSettings(device="cpu", max_context=1024)
FAST = CalibrateSettings(reps=2, gpu_reps=2, step_reps=2, sizes=(64, 256), pass_layers=1, pass_reps=1,
                         sessions="embedded:1")


def _cap_holding(hot: int) -> int:
    """The smallest cap (bytes) whose capacity test holds `hot` experts for MODEL under SETTINGS."""
    from ostinato.sources import open_source
    from ostinato.planner.capacity import CapacityError, plan_capacity

    cfg = open_source(MODEL).config
    counts = {l: torch.ones(cfg.num_experts) for l in cfg.moe_layers}
    lo, hi = 2**20, 2**36
    while hi - lo > 2**10:
        mid = (lo + hi) // 2
        try:
            n = plan_capacity(cfg, counts, mid, SETTINGS.context(cfg), SETTINGS.torch_dtype(cfg.torch_dtype)).max_hot_slots
        except CapacityError:
            n = -1
        lo, hi = (lo, mid) if n >= hot else (mid, hi)
    return hi


class Phases(list):
    def __call__(self, phase, done=None, of=None):
        self.append((phase, done, of))


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The first start: a plan made under a cap that holds 12 of the 32 experts, were they routed evenly
    (the skewed development routes need fewer flex slots, so more fit)."""
    cache = tmp_path_factory.mktemp("plans")
    place = PlacementSettings(gpu_memory=_cap_holding(12))
    auto = AutoPlan(sessions="embedded:2", calibrate=FAST, cache=cache)
    phases = Phases()
    t0 = time.perf_counter()
    loaded = load_planned(MODEL, SETTINGS, place, auto, phases)
    seconds = time.perf_counter() - t0
    return {"loaded": loaded, "place": place, "auto": auto, "phases": phases, "seconds": seconds}


def test_first_start_plans_in_hybrid_and_caches(planned, tmp_path):
    from ostinato.cli import build_parser

    loaded, phases = planned["loaded"], planned["phases"]
    res = loaded.residency
    assert [p for p, _, _ in phases if p != "profiling"] == ["loading weights", "planning", "calibrating"]
    assert [(d, n) for p, d, n in phases if p == "profiling"] == [(0, 2), (1, 2), (2, 2)]
    assert 12 <= res.hot_count < 32 and res.gpu_memory == planned["place"].gpu_memory
    # the plan `ostinato plan` makes from the same profile under the same cap
    a = build_parser().parse_args(["plan", "--model", MODEL, "--device", "cpu", "--profile", res.profile["path"],
                                   "--gpu-memory", str(res.gpu_memory), "--max-context", "1024", "--no-verify",
                                   "-o", str(tmp_path / "cli.json")])
    # (by routes, with its upload path: the calibration then filled it again by time saved and decided
    # whether that path pays for its flex slots)
    assert a.func(a) == 0 and Residency.load(tmp_path / "cli.json").hot == res.frequency_plan().hot
    up = res.calibration["upload_path"]
    assert res.hot_count == up["hot_with_flex" if up["on"] else "hot_without_flex"]
    assert res.calibration["upload_threshold"] > 0 and set(res.notes["phases_s"]) == {"load", "profile", "plan",
                                                                                       "calibrate"}
    assert 0 < res.notes["report"]["development"]["hot_share"] < 1
    path = loaded.placement.residency
    folder = plan_dir(MODEL, plan_key(loaded.source, SETTINGS, planned["place"], "embedded:2"), planned["auto"].cache)
    assert path == str(folder / "residency.json") and Residency.load(path).hot == res.hot
    assert (folder / "profile.json").is_file() and not list(folder.glob("cold*.json"))
    key = json.loads((folder / "key.json").read_text())
    assert key["gpu_memory"] == planned["place"].gpu_memory and key["kv_tokens"] == 1024
    # the engine it returned serves the plan: its experts in the pool, the calibrated Np applied
    h = loaded.runner.experts
    assert h.pools.num_hot == res.hot_count
    for l, ids in res.hot.items():  # the plan as filled again by time saved, not the one calibrated
        assert (h.pools.of(l).table_host[l] >= 0).nonzero()[:, 0].tolist() == sorted(ids)
    if res.upload_path:
        assert h.upload_threshold == res.calibration["upload_threshold"]
    else:  # the pool was built again without flex slots, and no Np
        assert h.upload_threshold is None and all(p.num_slots == p.flex_lo for p in h.pools.groups)


def _priced(cal: dict) -> dict:
    """A calibration with the H200 machine's prices of a cold route (session 17: decode 79 µs in a
    graph, a prefill pass 80 µs an expert read and 2.8 µs a route): a 2-core CPU's quick fit can price
    one at nothing, and the fill by time saved then keeps the fill by routes."""
    return {**cal, "global": {**cal["global"], "beta_ms": 0.079},
            "layers": {l: {**c, "beta_ms": 0.079} for l, c in cal["layers"].items()},
            "cpu_pass": {**cal["cpu_pass"], "beta_expert_ms": 0.080, "beta_route_ms": 0.0028}}


def test_first_start_serves_the_plan_filled_again_with_its_upload_path_kept(tmp_path, monkeypatch):
    """Borrowed memory keeps the upload path, so only the fill by time saved changes the plan after
    calibration: the engine is built again for it, not left with the plan by routes it calibrated."""
    import ostinato.planner.calibrate as calibrate

    measure = calibrate.calibrate
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **kw: _priced(measure(*a, **kw)))
    place = PlacementSettings(gpu_memory=_cap_holding(12), borrow=True)
    loaded = load_planned(MODEL, SETTINGS, place, AutoPlan(sessions="embedded:2", calibrate=FAST,
                                                            cache=tmp_path / "plans"), Phases())
    res, h = loaded.residency, loaded.runner.experts
    assert res.upload_path and res.calibration["fill"]["moved"] > 0 and res.hot != res.frequency_plan().hot
    for l, ids in res.hot.items():
        assert (h.pools.of(l).table_host[l] >= 0).nonzero()[:, 0].tolist() == sorted(ids)


def test_second_start_reuses_the_plan(planned):
    phases = Phases()
    t0 = time.perf_counter()
    again = load_planned(MODEL, SETTINGS, planned["place"], planned["auto"], phases)
    seconds = time.perf_counter() - t0
    assert phases == [("loading weights", None, None)]
    assert again.residency.hot == planned["loaded"].residency.hot
    assert again.placement.residency == planned["loaded"].placement.residency
    assert seconds < planned["seconds"] / 2, (seconds, planned["seconds"])
    print(f"first start {planned['seconds']:.1f} s, second {seconds:.1f} s")


def test_another_cap_or_other_sessions_is_another_plan(planned):
    other = PlacementSettings(gpu_memory=_cap_holding(20))
    source, place = planned["loaded"].source, planned["place"]
    dirs = {plan_dir(MODEL, plan_key(source, SETTINGS, p, sessions))
            for p, sessions in ((place, "embedded:2"), (other, "embedded:2"), (place, "embedded:8"))}
    assert len(dirs) == 3


def test_every_expert_fitting_needs_no_plan(tmp_path):
    phases = Phases()
    loaded = load_planned(MODEL, SETTINGS, PlacementSettings(gpu_memory=_cap_holding(32)),
                          AutoPlan(cache=tmp_path), phases)
    assert loaded.residency is None and phases == [("loading weights", None, None)]
    assert not (tmp_path / "plans").exists()


def test_server_counts_its_routes_beside_the_plan(planned):
    from ostinato.server.app import build_app
    from tests.test_server import LiveServer

    app = build_app(MODEL, SETTINGS, planned["place"], auto_plan=planned["auto"], warmup=True)
    with LiveServer(app) as live:
        live.wait_ready()
        health = httpx.get(live.url + "/health").json()
        assert health == {"status": "ok"}
        body = {"messages": [{"role": "user", "content": "Write a haiku about caches."}], "max_tokens": 12,
                "temperature": 0}
        for _ in range(2):
            r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        out = r.json()["usage"]["completion_tokens"]
        prompt = r.json()["usage"]["prompt_tokens"]
    served = ServedRoutes(served_path(planned["loaded"].placement.residency))
    # the warm-up and the calibration are not counted: two requests, their decode steps and prefills
    K = planned["loaded"].runner.config.num_experts_per_tok
    assert served.counts is not None and 0 < served.counts.tokens["decode"] <= 2 * out
    assert served.counts.tokens["prefill"] <= 2 * prompt
    for layer, c in served.counts.total("all").items():
        assert int(c.sum()) == K * served.served_tokens, layer


def test_tally_counts_what_the_router_chose():
    """The tally around the experts backend against the ids the backend itself receives."""
    from ostinato.load import load_engine

    loaded = load_engine(MODEL, RunnerSettings(device="cpu", max_context=256, count_routes=True), announce=False)
    runner = loaded.runner
    from ostinato.layers.moe.backend import MoEBackend

    seen = {"prefill": [], "decode": []}
    inner = runner.experts

    class Recorder(MoEBackend):
        def __call__(self, layer, x, topk):
            seen["decode" if x.shape[0] == 1 else "prefill"].append((layer, topk.ids.clone()))
            return inner(layer, x, topk)

    runner.set_experts(Recorder())
    runner.routes.reset()
    runner.forward(list(range(5, 60)), 0)
    for i in range(4):
        runner.forward([7 + i], 55 + i)
    runner.forward(list(range(8, 20)), 59)  # a second prefill pass (a tool output)
    got = runner.routes.take()
    E = runner.config.num_experts
    for phase in ("prefill", "decode"):
        want = {l: torch.zeros(E, dtype=torch.int64) for l in runner.config.moe_layers}
        for layer, ids in seen[phase]:
            want[layer] += torch.bincount(ids.flatten(), minlength=E)
        for l in want:
            assert torch.equal(getattr(got, phase)[l], want[l]), (phase, l)
    assert got.tokens == {"prefill": 55 + 12, "decode": 4} and got.passes == {55: 1, 12: 1}  # passes by size
    again = runner.routes.take()
    assert all(int(c.sum()) == 0 for c in again.total("all").values()) and again.passes == {}  # take() zeroed it


def test_served_routes_decay_by_tokens(tmp_path):
    from ostinato.engine.routes import RouteCounts

    def counts(expert: int, tokens: int) -> RouteCounts:
        rc = RouteCounts.zeros([0], 4)
        rc.decode[0][expert] = tokens
        rc.tokens["decode"] = tokens
        return rc

    s = ServedRoutes(tmp_path / "r.served.json", half_life=100)
    first = counts(0, 100)
    first.passes = {300: 2}
    s.add(first)
    s.add(counts(1, 100))  # expert 0's routes are now one half-life old (and the passes counted with them)
    assert s.counts.decode[0].tolist() == [50, 100, 0, 0] and s.served_tokens == 200
    assert s.counts.passes == {300: 1.0}
    s.save()
    back = ServedRoutes(tmp_path / "r.served.json")
    assert back.half_life == 100 and back.served_tokens == 200 and back.counts.decode[0].tolist() == [50, 100, 0, 0]
    assert back.counts.passes == {300: 1.0}
    dev = counts(3, 40)
    dev.prompts = [30, 3000]
    learned = learned_profile(dev, back, 2048)  # the development profile is two half-lives old
    assert learned.decode[0].tolist() == [50.0, 100.0, 0.0, 10.0] and learned.total("all")[0][3] == 10.0
    assert learned.tokens == {"prefill": 0, "decode": 150 + 10} and learned.prompts is None
    assert learned.passes == {30: 0.25, 300: 1.0, 952: 0.25, 2048: 0.25}  # served as counted, dev's decayed
    # a served file from before passes were counted: the development prompts' passes for its prefill tokens,
    # and it keeps no passes as it grows (the sum would hold tokens without their passes)
    old = counts(1, 100)
    old.tokens["prefill"] = 2 * 3030
    back.counts = old
    assert learned_profile(dev, back, 2048).passes == {30: 2.25, 952: 2.25, 2048: 2.25}
    back.add(first)
    assert back.counts.passes is None
    nothing = learned_profile(counts(3, 40), back, 2048)  # and no prompts either: not weighed
    assert nothing.passes is None


def _skew_served_to_cold(res: Residency, path, tokens: int = 5000, half_life: int = 1000) -> list[tuple]:
    """A served file whose routes all go to two cold experts per layer, outweighing the development
    profile (five half-lives): -> the (layer, expert) pairs it favours."""
    from ostinato.engine.routes import RouteCounts

    layers = sorted(res.hot)
    rc = RouteCounts.zeros(layers, res.num_experts)
    favoured = []
    for l in layers:
        cold = [e for e in range(res.num_experts) if e not in res.hot[l]][:2]
        for e in cold:
            rc.decode[l][e] = tokens
            favoured.append((l, e))
    rc.tokens["decode"] = tokens
    served = ServedRoutes(served_path(path), half_life=half_life)
    served.counts, served.served_tokens = rc, tokens
    served.save()
    return favoured


def test_plan_from_served_learns_and_reports(planned, tmp_path, capsys):
    from ostinato.cli import build_parser

    src = tmp_path / "r.json"
    old = Residency.load(planned["loaded"].placement.residency)
    old.calibration = _priced(old.calibration)
    old.save(src)
    favoured = _skew_served_to_cold(old, src)
    a = build_parser().parse_args(["plan", "--model", MODEL, "--device", "cpu", "--from-served", str(src),
                                   "-o", str(tmp_path / "new.json")])
    assert a.func(a) == 0
    new = Residency.load(tmp_path / "new.json")
    # the same cap and pool; how many of its slots are hot depends on the flex slots the new counts need
    assert new.gpu_memory == old.gpu_memory and new.capacity["pool_bytes"] == old.capacity["pool_bytes"]
    assert all(e in new.hot[l] for l, e in favoured)
    report = new.notes["report"]
    assert report["served_before"]["hot_share"] == 0.0 and report["served"]["hot_share"] == 1.0
    # the calibration's measurements carried over; the new plan filled again by time saved and its upload
    # path decided on the learned routes, not the old plan's decisions
    assert measured(new.calibration) == measured(old.calibration) and "upload_path" in new.calibration
    assert new.calibration["fill"]["by"] == "time saved" and new.calibration["fill"] != old.calibration.get("fill")
    assert served_path(tmp_path / "new.json").is_file()
    assert "0.0% with the old plan -> 100.0% with the new" in capsys.readouterr().out


def test_replan_uses_the_served_routes(planned, tmp_path):
    import shutil

    cache = tmp_path / "cache"
    key = plan_key(planned["loaded"].source, SETTINGS, planned["place"], "embedded:2")
    folder = plan_dir(MODEL, key, cache)
    shutil.copytree(plan_dir(MODEL, key, planned["auto"].cache), folder)
    favoured = _skew_served_to_cold(Residency.load(folder / "residency.json"), folder / "residency.json")
    phases = Phases()
    auto = AutoPlan(sessions="embedded:2", replan=True, calibrate=FAST, cache=cache)
    loaded = load_planned(MODEL, SETTINGS, planned["place"], auto, phases)
    assert "profiling" not in [p for p, _, _ in phases]
    assert all(e in loaded.residency.hot[l] for l, e in favoured)
    assert Residency.load(folder / "residency.json").hot == loaded.residency.hot


def test_cli_failures_exit_with_one_line(tmp_path):
    from tests.test_serve_startup import _serve

    r = _serve("--model", MODEL, "--gpu-memory", "64MiB", "--max-context", 1024)  # not even the dense part
    assert r.returncode == 2 and "cannot hold the dense weights" in r.stderr and "Traceback" not in r.stderr
    Residency("sha256:0", 16, {}).save(tmp_path / "r.json")
    r = _serve("--model", MODEL, "--gpu-memory", "4GiB", "--residency", tmp_path / "r.json", "--replan")
    assert r.returncode == 2 and "--replan" in r.stderr and r.stderr.count("ostinato: error:") == 1
    r = _serve("--model", MODEL, "--gpu-memory", _cap_holding(12), "--max-context", 1024,
               "--sessions", tmp_path / "none.jsonl")
    assert r.returncode == 2 and "none.jsonl" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.gpu
def test_the_tally_counts_inside_the_decode_graph(tiny_dir, tmp_path):
    """Half the experts cold, routes counted: every graph replay still equals the synchronous step
    bit for bit, and the graph's tally equals the synchronous engine's (decode steps counted in
    the captured graph, none from the warm-up once reset)."""
    from ostinato.load import load_engine
    from ostinato.loader.source import CheckpointSource
    from tests.test_graph import replay_vs_eager
    from tests.test_hybrid import _residency_for

    _residency_for(CheckpointSource(tiny_dir), 0.5).save(tmp_path / "half.json")
    place = PlacementSettings(residency=str(tmp_path / "half.json"))
    engines = [load_engine(str(tiny_dir), RunnerSettings(device="cuda", dtype="bf16", max_context=2048,
                                                         cuda_graph=g, count_routes=True), place) for g in (True, False)]
    graphed, sync = engines
    assert graphed.runner.graphs is not None
    for e in engines:
        e.runner.routes.reset()
    steps = 64
    replay_vs_eager(graphed, sync, steps=steps)
    a, b = graphed.runner.routes.take(), sync.runner.routes.take()
    for phase in ("prefill", "decode"):
        for l in a.prefill:
            assert torch.equal(getattr(a, phase)[l], getattr(b, phase)[l]), (phase, l)
    assert a.tokens == {"prefill": 100, "decode": steps}
    graphed.runner.experts.close()


def test_a_plan_brings_its_cap_and_context(planned):
    """Served with --residency and neither --gpu-memory nor --max-context: the plan's are used."""
    from ostinato.load import load_engine, startup_summary

    res = planned["loaded"].residency
    loaded = load_engine(MODEL, RunnerSettings(device="cpu"), PlacementSettings(residency=planned["loaded"].placement.residency),
                         announce=False)
    assert loaded.placement.gpu_memory == res.gpu_memory and loaded.runner.max_context == res.capacity["kv_tokens"]
    assert startup_summary(loaded)["gpu_memory"] == res.gpu_memory


def test_plan_with_sessions_profiles_with_no_expert_resident(tmp_path, monkeypatch):
    """`plan --sessions` profiles on the engine planner/auto.load_cold builds, never every expert on the GPU."""
    import ostinato.load
    from ostinato.cli import build_parser

    real, seen = ostinato.load.load_engine, []

    def spy(model, settings=RunnerSettings(), placement=None, *args, **kw):
        seen.append(Residency.load(placement.residency).hot_count if placement and placement.residency else None)
        return real(model, settings, placement, *args, **kw)

    monkeypatch.setattr(ostinato.load, "load_engine", spy)
    cap = _cap_holding(12)
    a = build_parser().parse_args(["plan", "--model", MODEL, "--device", "cpu", "--sessions", "embedded:1",
                                   "--gpu-memory", str(cap), "--max-context", "1024", "--no-verify",
                                   "-o", str(tmp_path / "r.json")])
    assert a.func(a) == 0
    assert seen == [0]
    res = Residency.load(tmp_path / "r.json")
    assert 0 < res.hot_count < 32 and res.profile["sessions"] == 1 and (tmp_path / "r.json.profile.json").is_file()


def test_serve_takes_the_model_as_its_argument(tmp_path):
    """`ostinato serve MODEL` as `--model MODEL`; none or two different ones are refused in one line."""
    from tests.test_serve_startup import _serve

    r = _serve(tmp_path / "missing")
    assert r.returncode == 2 and "no such model directory" in r.stderr, r.stderr
    r = _serve()
    assert r.returncode == 2 and "give the model to serve" in r.stderr
    r = _serve("synth:tiny", "--model", "synth:tiny-k")
    assert r.returncode == 2 and "two models given" in r.stderr and r.stderr.count("ostinato: error:") == 1


def test_servers_sharing_a_plan_add_their_routes(tmp_path):
    """Two servers' flushes into one served file: each adds its own routes to what the file holds."""
    from ostinato.engine.routes import RouteCounts

    class Tally:  # what RouteTally.take gives: the routes since the last take
        def __init__(self, expert):
            self.expert = expert

        def take(self):
            rc = RouteCounts.zeros([0], 4)
            rc.decode[0][self.expert] = 10
            rc.tokens["decode"] = 10
            return rc

    path = tmp_path / "r.served.json"
    a, b = ServedRoutes(path, half_life=10**9), ServedRoutes(path, half_life=10**9)
    a.flush(Tally(0), force=True)
    b.flush(Tally(1), force=True)
    a.flush(Tally(2), force=True)
    final = ServedRoutes(path)
    assert final.counts.decode[0].tolist() == [10, 10, 10, 0] and final.served_tokens == 30
    assert not list(tmp_path.glob("*.tmp"))
    path.write_text("{not json")
    assert ServedRoutes(path).counts is None  # an unreadable file: counting starts again, serving goes on
