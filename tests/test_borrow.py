"""Borrowed memory: cold experts that decode keeps using move into the flex slots between
tokens, results stay those of the reference, and a prefill gets every slot back."""
from __future__ import annotations

import torch

from ostinato.layers.moe.borrow import Borrowing
from ostinato.layers.moe.reference import moe_forward
from ostinato.layers.moe.types import TopKOutput
from tests.test_hybrid import D, E, K, LAYERS, _hybrid


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
