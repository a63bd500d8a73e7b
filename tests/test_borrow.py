"""Borrowed memory: cold experts that decode keeps using move into the flex slots between
tokens, results stay those of the reference, and a prefill gets every slot back; with one
pool per expert format, each pool lends its slots to its own layers only."""
from __future__ import annotations

import pytest
import torch

from ostinato.engine.placement import PlacementSettings
from ostinato.engine.runner import RunnerSettings
from ostinato.layers.moe.borrow import Borrowing
from ostinato.layers.moe.cpu_experts import CpuExperts
from ostinato.layers.moe.hybrid import HybridExperts
from ostinato.layers.moe.pool import ExpertPool, ExpertPools, HostExperts
from ostinato.layers.moe.reference import moe_forward
from ostinato.layers.moe.types import TopKOutput
from ostinato.load import load_engine
from ostinato.loader.gguf import GGUFSource
from tests.test_hybrid import D, E, F, K, LAYERS, _experts, _hybrid
from tests.test_quant_engine import PROMPT, _rel, _residency, tinyk_q4km  # noqa: F401  (a fixture)


def _topk(ids):
    ids = torch.tensor([ids])
    return TopKOutput(ids, torch.full(ids.shape, 1.0 / ids.shape[1]))


def _cold_ids(hybrid, layer, n):
    return (hybrid.host.compact[layer] >= 0).nonzero().flatten()[:n].tolist()


def test_decode_borrows_hot_cold_experts_and_stays_exact():
    hybrid, weights = _hybrid(0.5, upload_threshold=10**9)
    table0, compact0 = hybrid.pool.table_host.clone(), {l: c.clone() for l, c in hybrid.host.compact.items()}
    hybrid.borrow = Borrowing(hybrid, every=1, wait_copies=True)
    layer = LAYERS[0]
    favourite = _cold_ids(hybrid, layer, K)  # decode keeps routing to these cold experts
    g = torch.Generator().manual_seed(0)
    cold_before = None
    for step in range(12):
        x = torch.randn(1, D, generator=g)
        topk = _topk(favourite)
        got = hybrid(layer, x, topk)
        assert torch.allclose(got, moe_forward(x, topk, weights[layer]), rtol=1e-4, atol=1e-5)
        hybrid.after_decode_step()
        if step == 0:
            cold_before = hybrid.stats()["cold_routes"]
    stats = hybrid.stats()
    assert stats["borrowed_now"] == len(favourite)
    assert {hybrid.borrow.owner[s] for s in hybrid.borrow.owner} == {(layer, e) for e in favourite}
    assert stats["borrowed_hits"] > 0
    assert stats["cold_routes"] < 12 * K and cold_before == K  # later steps ran on the GPU
    hybrid.before_prefill()
    assert torch.equal(hybrid.pool.table_host, table0)
    assert all(torch.equal(hybrid.host.compact[l], compact0[l]) for l in LAYERS)
    assert hybrid.stats()["borrowed_now"] == 0


def test_full_slots_admit_only_a_clearly_better_newcomer():
    hybrid, _ = _hybrid(0.5, upload_threshold=10**9)
    b = Borrowing(hybrid, every=10**9, wait_copies=True, margin=2.0)
    hybrid.borrow = b
    b.slots = b.slots[:4]  # fewer slots than cold experts, as on a real GPU
    n_slots = len(b.slots)
    layer = LAYERS[1]
    cold = _cold_ids(hybrid, layer, E)
    assert len(cold) > n_slots
    b.scores[layer, cold[:n_slots]] = 10.0
    b.rebalance()  # fills every free slot
    assert len(b.owner) == n_slots and not b.free_slots()
    newcomer = cold[n_slots]
    b.scores[layer, newcomer] = 15.0  # better, but not twice the weakest
    b.rebalance()
    assert (layer, newcomer) not in b.owner.values()
    b.scores[layer, newcomer] = 25.0
    b.rebalance()
    assert (layer, newcomer) in b.owner.values() and b.counters["replaced"] == 1


def _two_pools(flex=(3, 5)):
    """The hybrid of _hybrid at half hot, but one pool per layer (as two format groups are: each
    serves its own layers) with flex[i] flex slots each; layer 1 has no pool (a dense layer). Both
    pools number their flex slots from 8 + K, so equal slot numbers name different memory."""
    weights = {l: _experts(l) for l in LAYERS}
    g = torch.Generator().manual_seed(7)
    hot = {l: torch.randperm(E, generator=g)[:E // 2].tolist() for l in LAYERS}
    cold = {l: sorted(set(range(E)) - set(hot[l])) for l in LAYERS}
    pools = ExpertPools([ExpertPool({l: hot[l]}, 3, E, K, n, (2 * F, D), (D, F), "cpu", torch.float32)
                         for l, n in zip(LAYERS, flex)])
    host = HostExperts(cold, E, (2 * F, D), (D, F), torch.float32)
    for l in LAYERS:
        pools.fill_layer(l, weights[l])
        host.fill_layer(l, weights[l])
    cpu = CpuExperts(host.layers, num_threads=1, backend="torch")
    return HybridExperts(pools, host, cpu, 10**9, max_tokens=512), weights


def _check_tables(hybrid, weights):
    """Every borrowed expert sits in a flex slot of its own layer's pool, holds that expert's weights,
    and both branches' tables say so (the device table published)."""
    b, pools = hybrid.borrow, hybrid.pools
    for (g, s), (l, e) in b.owner.items():
        pool = pools.of(l)
        assert pools.groups[g] is pool and pool.flex_lo <= s < pool.num_slots
        assert int(hybrid.table_row(l)[e]) == s and int(hybrid.host.compact[l][e]) < 0
        assert torch.equal(pool.w13[s], weights[l].w13[e]) and torch.equal(pool.w2[s], weights[l].w2[e])
    for l in LAYERS:
        assert torch.equal(pools.of(l).table[l], pools.of(l).table_host[l])


def test_decode_borrows_into_each_layers_own_pool():
    hybrid, weights = _two_pools()
    pools = hybrid.pools
    tables0 = [p.table_host.clone() for p in pools.groups]
    compact0 = {l: c.clone() for l, c in hybrid.host.compact.items()}
    hybrid.borrow = Borrowing(hybrid, every=1, wait_copies=True)
    favourite = {l: _cold_ids(hybrid, l, K) for l in LAYERS}  # K cold experts a layer; pool 0 has 3 slots
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        for l in LAYERS:
            x = torch.randn(1, D, generator=g)
            topk = _topk(favourite[l])
            assert torch.allclose(hybrid(l, x, topk), moe_forward(x, topk, weights[l]), rtol=1e-4, atol=1e-5)
        hybrid.after_decode_step()
    b = hybrid.borrow
    by_layer = {l: {e for (_, s), (m, e) in b.owner.items() if m == l} for l in LAYERS}
    assert len(by_layer[0]) == 3 and by_layer[0] < set(favourite[0])  # pool 0 full, pool 1's slots unused by it
    assert by_layer[2] == set(favourite[2])
    assert sorted(g for g, _ in b.owner) == [0] * 3 + [1] * K
    assert hybrid.stats()["borrowed_hits"] > 0
    _check_tables(hybrid, weights)
    hybrid.before_prefill()
    assert all(torch.equal(p.table_host, t) for p, t in zip(pools.groups, tables0))
    assert all(torch.equal(p.table, t) for p, t in zip(pools.groups, tables0))
    assert all(torch.equal(hybrid.host.compact[l], compact0[l]) for l in LAYERS)
    assert hybrid.stats()["borrowed_now"] == 0 and b.free_slots() == b.slots and len(b.slots) == 3 + 5


def test_replacement_stays_within_a_pool():
    hybrid, weights = _two_pools()
    b = Borrowing(hybrid, every=10**9, wait_copies=True, margin=2.0)
    hybrid.borrow = b
    cold = {l: _cold_ids(hybrid, l, E) for l in LAYERS}  # 8 each
    b.scores[1] = 100.0  # a layer without a pool (dense): never borrowed for
    b.scores[0, cold[0][:3]] = 10.0  # fills pool 0's 3 slots
    b.scores[2, cold[2][:4]] = 10.0  # 4 of pool 1's 5 slots
    b.rebalance()
    assert {l for l, _ in b.owner.values()} == {0, 2} and len(b.owner) == 7
    assert not b.free_slots(0) and len(b.free_slots(1)) == 1
    # pool 0 is full and its best newcomer fails the margin; pool 1's weaker one still takes its free slot
    b.scores[0, cold[0][3]] = 15.0
    b.scores[2, cold[2][4]] = 1.0
    b.rebalance()
    assert (0, cold[0][3]) not in b.owner.values() and (2, cold[2][4]) in b.owner.values()
    assert b.counters["replaced"] == 0 and not b.free_slots()
    # both full: each newcomer evicts its own pool's weakest borrowed expert
    b.scores[0, cold[0][3]] = 25.0
    b.scores[2, cold[2][5]] = 30.0
    b.rebalance()
    assert (0, cold[0][3]) in b.owner.values() and (2, cold[2][5]) in b.owner.values()
    assert (2, cold[2][4]) not in b.owner.values()  # pool 1's weakest (score 1)
    assert sorted(g for g, _ in b.owner) == [0] * 3 + [1] * 5 and b.counters["replaced"] == 2
    _check_tables(hybrid, weights)
    g = torch.Generator().manual_seed(1)
    for l in LAYERS:  # every borrowed expert and the rest, in both branches
        x = torch.randn(5, D, generator=g)
        topk = TopKOutput(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(5)]),
                          torch.rand(5, K, generator=g))
        assert torch.allclose(hybrid.split_path(l, x, topk), moe_forward(x, topk, weights[l]), rtol=1e-4, atol=1e-5)
    b.release_all()
    assert not b.owner and b.counters["returned"] == 2 + 8
    assert all(int(hybrid.table_row(l)[e]) < 0 for l in LAYERS for e in cold[l])
    assert all(torch.equal(hybrid.host.compact[l], hybrid.host.rows[l]) for l in LAYERS)


def test_a_rebalance_copies_once_a_layer_and_publishes_once(monkeypatch):
    """The rebalance runs on the host between two decode steps: after a prefill returned every slot,
    its refill issues one upload per layer (not one per expert), publishes the tables once, and tells
    the graph worker once per layer switched. Equal scores go in (layer, expert) order."""
    hybrid, weights = _two_pools(flex=(3, 5))
    b = Borrowing(hybrid, every=10**9, wait_copies=True)
    hybrid.borrow = b
    cold = {l: _cold_ids(hybrid, l, E) for l in LAYERS}
    b.scores[0, cold[0]] = 1.0  # ties: pool 0 takes layer 0's first three cold experts
    b.scores[2, cold[2][:5]] = 2.0
    uploads, publishes, told = [], [], []
    for p in hybrid.pools.groups:
        monkeypatch.setattr(p, "upload", lambda slots, host, layer, experts, f=p.upload:
                            uploads.append((layer, len(experts))) or f(slots, host, layer, experts))
    monkeypatch.setattr(hybrid, "publish", lambda f=hybrid.publish: publishes.append(1) or f())
    b.on_switch = lambda layer, table: told.append(layer)
    b.rebalance()
    assert sorted(uploads) == [(0, 3), (2, 5)] and len(publishes) == 1 and sorted(told) == [0, 2]
    assert sorted(e for l, e in b.owner.values() if l == 0) == cold[0][:3]
    _check_tables(hybrid, weights)
    publishes.clear()
    b.release_all()
    assert len(publishes) == 1 and not b.owner


def test_a_copy_switches_in_once_its_event_is_done():
    """On a GPU the copies of one rebalance share one event on the copy stream: the next rebalance asks
    it once, switches in the experts whose copies finished and keeps the others pending."""
    hybrid, weights = _two_pools(flex=(3, 5))
    b = Borrowing(hybrid, every=10**9)
    hybrid.borrow = b
    cold = {l: _cold_ids(hybrid, l, E) for l in LAYERS}
    b.scores[0, cold[0][:2]] = 5.0
    b.scores[2, cold[2][:3]] = 5.0
    b.rebalance()  # on the CPU the copies are made at once; their pending entries carry no event
    assert not b.owner and len(b.pending) == 5

    class Event:
        def __init__(self, done):
            self.done, self.asked = done, 0

        def query(self):
            self.asked += 1
            return self.done

    done, running = Event(True), Event(False)
    b.pending = [(s, l, e, done if l == 0 else running) for s, l, e, _ in b.pending]
    b.scores.zero_()  # nothing new to copy
    b.rebalance()
    assert done.asked == 1 and running.asked == 1
    assert sorted(e for l, e in b.owner.values()) == cold[0][:2] and {l for _, l, _, _ in b.pending} == {2}
    _check_tables(hybrid, weights)


def test_the_host_time_bench_refills_and_replaces():
    """scripts/bench_borrow_host.py times what it claims to: each turn's first rebalance refills the
    slots a prefill returned, and the later ones replace borrowed experts."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_borrow_host import main

    got = main(["--turns", "2", "--steps", "16", "--flex", "20"])
    assert len(got["first_ms"]) == 2 and len(got["later_ms"]) == 2 * 3 and len(got["every_ms"]) == 2 * 16
    assert got["borrowed"] > 2 * 2 * 20 and got["replaced"] > 0  # both pools filled twice, then replacements
    assert got["returned"] >= 2 * 20  # the second prefill returned the first turn's


TWO_POOL_TOKENS = [7, 300, 1200, 55, 900, 13, 401, 77, 1500, 260, 31, 808]


def _decode_two_pools(path, residency: str, borrow: bool, device: str):
    """tiny-k's Q4_K_M file decoding TWO_POOL_TOKENS after PROMPT on `device` (CUDA: the decode graph, the
    worker's handshake scoring the routes) -> (logits [1 + steps, V], placement stats, the backend, the
    borrowed experts {(pool, slot): (layer, expert)})."""
    settings = RunnerSettings(device=device, dtype="fp32" if device == "cpu" else "bf16", max_context=128,
                              prefill_chunk=64)
    place = PlacementSettings(residency=residency, borrow=borrow, borrow_wait_copies=True)
    r = load_engine(str(path), settings, place).runner
    rows = [r.forward(PROMPT, 0)[None]] + [r.forward([t], len(PROMPT) + i)[None]
                                           for i, t in enumerate(TWO_POOL_TOKENS)]
    hybrid = r.experts.unwrapped
    owner = dict(hybrid.borrow.owner) if borrow else {}
    stats = r.placement_stats()
    r.experts.close()
    return torch.cat(rows).float(), stats, hybrid, owner


def _check_two_pools_lent(stats, hybrid, owner) -> None:
    assert [p.qtypes for p in hybrid.pools.groups] == [("Q4_K", "Q4_K"), ("Q4_K", "Q6_K")]
    assert stats["borrowed"] > 0 and stats["borrowed_hits"] > 0
    assert {l for l, _ in owner.values()} == {0, 1}  # both pools lent slots
    for (g, s), (l, _) in owner.items():
        assert hybrid.pools.groups[g] is hybrid.pools.of(l) and hybrid.pools.of(l).flex_lo <= s


def test_borrowing_over_two_format_pools_keeps_the_logits(tinyk_q4km, tmp_path):  # noqa: F811
    """tiny-k as Q4_K_M (two pools: layer 0 Q4_K/Q4_K, layer 1 Q4_K/Q6_K), half hot, decoding a fixed
    token sequence with and without borrowing. A borrowed expert moves from the CPU branch (int8
    activations) to the GPU branch (fp32): the tolerance of tests/test_quant_engine.py, 1% of the
    largest logit; above 1e-6, since borrowed experts did compute."""
    _residency(GGUFSource(tinyk_q4km), 0.5).save(tmp_path / "r.json")
    ref, _, _, _ = _decode_two_pools(tinyk_q4km, str(tmp_path / "r.json"), False, "cpu")
    got, stats, hybrid, owner = _decode_two_pools(tinyk_q4km, str(tmp_path / "r.json"), True, "cpu")
    _check_two_pools_lent(stats, hybrid, owner)
    assert 1e-6 < _rel(got, ref) < 1e-2, _rel(got, ref)


@pytest.mark.gpu
def test_borrowing_over_two_format_pools_in_the_decode_graph(tinyk_q4km, tmp_path):  # noqa: F811
    """The same on CUDA, where decode steps replay as one graph and the handshake's post kernel scores each
    layer's cold routes against its own pool's flex slots: both pools lend, and the logits stay within 2% of
    the largest of a run without borrowing (bf16 activations on the GPU branch, int8 on the CPU's)."""
    _residency(GGUFSource(tinyk_q4km), 0.5).save(tmp_path / "r.json")
    ref, _, _, _ = _decode_two_pools(tinyk_q4km, str(tmp_path / "r.json"), False, "cuda")
    got, stats, hybrid, owner = _decode_two_pools(tinyk_q4km, str(tmp_path / "r.json"), True, "cuda")
    _check_two_pools_lent(stats, hybrid, owner)
    assert _rel(got, ref) < 2e-2, _rel(got, ref)
