"""The decode graph's CPU worker against CpuExperts (bitwise) and torch_reference.

The test plays the GPU: per step and layer it writes routing and activations into the
shared buffers, then has_cold, then post_flag (numpy stores, in that order, as the graph
will), and spins on done_flag when the layer has cold routes. The worker is native and
polls the same memory.

Legend: L MoE layers, K top-k, E experts, D hidden, F expert FFN size.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from ostinato.kernels.cpu import build
from ostinato.layers.moe.cpu_experts import CpuExperts, torch_reference
from ostinato.layers.moe.graph_worker import GraphHandshake, GraphWorker
from ostinato.layers.moe.pool import HostExperts
from ostinato.layers.moe.types import ExpertWeights

L, K, E, D, F = 4, 4, 16, 256, 128
LAYERS = [3, 5, 8, 11]  # model layer ids, in execution order
TOL = 1e-4


@pytest.fixture(scope="module")
def native():
    ext = build.load_cpu_extension()
    if ext is None:
        pytest.skip(f"native CPU extension unavailable: {build.load_error()}")
    if not ext.cpu_features()["avx512"]:
        pytest.skip("this CPU lacks AVX-512")
    return ext


class Model:
    """Full experts of L layers, 4 cold ones per layer in host memory (as the engine keeps them)."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.full = {l: ExpertWeights((torch.randn(E, 2 * F, D, generator=g) / D**0.5).bfloat16(),
                                      (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()) for l in LAYERS}
        cold = {l: sorted(torch.randperm(E, generator=g)[:4].tolist()) for l in LAYERS}
        self.host = HostExperts(cold, E, (2 * F, D), (D, F), torch.bfloat16)
        for l in LAYERS:
            self.host.fill_layer(l, self.full[l])
        self.cold = cold
        self.full32 = {l: ExpertWeights(w.w13.float(), w.w2.float()) for l, w in self.full.items()}  # the oracle's


def make_worker(native, model, x_dtype=torch.bfloat16, **kw):
    cpu = CpuExperts(model.host.layers, num_threads=1, backend="native", spin_us=100)
    hs = GraphHandshake(L, K, D, x_dtype=x_dtype)
    kw = {"spin_us": 200, "sleep_us": 20, "idle_sleep_us": 500, **kw}
    return cpu, hs, GraphWorker(hs, cpu, model.host.compact, LAYERS, **kw)


def wait_for(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    n = 0
    while not pred():
        n += 1
        if n > 200:
            time.sleep(0)  # the worker and the pool may share this core
        if time.monotonic() > deadline:
            raise TimeoutError("the worker did not answer")


class FakeGpu:
    """The decode graph's side of the handshake, through numpy views of the shared memory (row 0 of
    each layer's [T, ...] buffers: a decode step's one token)."""

    def __init__(self, hs: GraphHandshake, row: int | slice = 0):
        self.post, self.has, self.done = hs.post_flag.numpy(), hs.has_cold.numpy(), hs.done_flag.numpy()
        self.tokens = hs.tokens.numpy()
        self.ids, self.w, self.out = (t.numpy()[:, row] for t in (hs.ids, hs.weights, hs.out))
        self.x = (hs.x.view(torch.int16) if hs.x.dtype == torch.bfloat16 else hs.x).numpy()[:, row]

    def publish(self, i, seq, ids, w, x, has_cold, tokens=1):
        n = ids.shape[0] if ids.dim() == 2 else None  # a pass's rows [n, ...]; else one token's
        rows = slice(0, n) if n is not None else slice(None)
        self.ids[i][rows] = ids.numpy()
        self.w[i][rows] = w.numpy()
        self.x[i][rows] = (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()
        self.tokens[i, 0] = tokens
        self.has[i, 0] = has_cold
        self.post[i, 0] = seq  # last: x86 keeps the order of the stores above

    def layer(self, i, seq, ids, w, x, has_cold, tokens=1) -> np.ndarray | None:
        self.publish(i, seq, ids, w, x, seq if has_cold else 0, tokens)
        if not has_cold:
            return None
        wait_for(lambda: self.done[i, 0] == seq)
        return self.out[i][:tokens].copy() if ids.dim() == 2 else self.out[i].copy()


def routing(g, x_dtype, force=()):
    """One token's top-k ids (distinct, `force` among them), weights and activations."""
    rest = [e for e in torch.randperm(E, generator=g).tolist() if e not in force]
    ids = torch.tensor((list(force) + rest)[:K], dtype=torch.int32)
    w = torch.rand(K, generator=g) + 0.1
    return ids, (w / w.sum()).float(), torch.randn(D, generator=g).to(x_dtype)


def expected(cpu, model, layer, table, ids, w, x, oracle=True):
    """What the synchronous path computes for this layer (CpuExperts on the cold routes,
    as HybridExperts gathers them), and torch_reference on the full experts."""
    cid = table[ids.long()]
    cold = cid >= 0
    tok = torch.zeros(int(cold.sum()), dtype=torch.int32)
    got = cpu.forward(layer, x[None], tok, cid[cold], w[cold])[0]
    if not oracle:
        return got, None
    full = model.full32[layer]
    h_dtype = model.full[layer].w2.dtype  # what the kernel rounds h to
    return got, torch_reference(full.w13, full.w2, x[None], tok, ids[cold], w[cold], h_dtype=h_dtype)[0]


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_steps_match_cpu_experts_bitwise_with_table_switches(native, x_dtype):
    model = Model()
    cpu, hs, worker = make_worker(native, model, x_dtype)
    gpu = FakeGpu(hs)
    g = torch.Generator().manual_seed(1)
    tables = {l: model.host.compact[l].clone() for l in LAYERS}
    # Borrowed memory: one cold expert of LAYERS[1] becomes hot from step 26 (set between
    # steps), one of LAYERS[0] from step 45 (announced during step 40).
    moved = {26: (LAYERS[1], model.cold[LAYERS[1]][0]), 45: (LAYERS[0], model.cold[LAYERS[0]][1])}
    new_tables = {}
    for at, (layer, e) in moved.items():
        new_tables[at] = tables[layer].clone()
        new_tables[at][e] = -1
    records, cold_layers, last_done = [], 0, [0] * L
    worker.start(1)
    for seq in range(1, 51):
        if seq == 26:
            worker.set_compact(moved[26][0], new_tables[26])  # from the next step
        for at, (layer, _) in moved.items():
            if seq == at:
                tables[layer] = new_tables[at]  # the GPU's device table switches with it
        for i, layer in enumerate(LAYERS):
            # Route each moved expert (beside another cold one) right before and after its switch.
            force = ()
            for at, (ml, me) in moved.items():
                if ml == layer and seq in (at - 1, at):
                    force = (me, next(c for c in model.cold[layer] if c != me))
            ids, w, x = routing(g, x_dtype, force)
            has_cold = bool((tables[layer][ids.long()] >= 0).any())
            out = gpu.layer(i, seq, ids, w, x, has_cold)
            if seq == 40 and i == 1:  # mid-step, for a later step
                worker.set_compact(moved[45][0], new_tables[45], at_seq=45)
            if out is not None:
                cold_layers += 1
                last_done[i] = seq
                records.append((layer, tables[layer], ids, w, x, out))
            assert gpu.done[i, 0] == last_done[i]  # a layer without cold routes leaves done alone
    worker.stop()
    stats = worker.stats()
    assert not worker.running
    assert stats["layers_served"] == cold_layers and stats["cold_routes"] > cold_layers
    assert stats["desync"] == stats["errors"] == stats["bad_ids"] == 0, stats
    assert stats["last_error"] == ""
    assert stats["steps"] >= 45  # it may jump over steps whose tail had no cold layer
    for l in LAYERS:
        assert torch.equal(worker.active_table(l), tables[l])
    for n, (layer, table, ids, w, x, out) in enumerate(records):
        want, ref = expected(cpu, model, layer, table, ids, w, x, oracle=n % 5 == 0)  # the oracle is slow
        assert torch.equal(torch.from_numpy(out), want)  # bitwise: the synchronous path's kernel
        assert ref is None or (want - ref).norm() <= TOL * ref.norm()


def test_pass_steps_match_cpu_experts_bitwise(native):
    """A captured prefill pass posts n <= T tokens a layer (GraphHandshake tokens=T): the worker
    computes the cold routes of the n rows, token-major as the synchronous path gathers them, and
    counts each layer's distinct cold experts; a count outside [1, T] is refused with zeros."""
    model = Model(seed=8)
    T = 5
    cpu = CpuExperts(model.host.layers, num_threads=2, backend="native", spin_us=100)
    hs = GraphHandshake(L, K, D, tokens=T)
    worker = GraphWorker(hs, cpu, model.host.compact, LAYERS, spin_us=200, sleep_us=20, idle_sleep_us=500)
    gpu = FakeGpu(hs, row=slice(None))
    g = torch.Generator().manual_seed(9)
    records, distinct = [], 0
    worker.start(1)
    for seq, n in enumerate((1, 3, T, 2), start=1):
        for i, layer in enumerate(LAYERS):
            rows = [routing(g, torch.bfloat16, (model.cold[layer][t % 4],)) for t in range(n)]
            ids, w, x = (torch.stack(c) for c in zip(*rows))
            table = model.host.compact[layer]
            out = gpu.layer(i, seq, ids, w, x, True, tokens=n)
            cid = table[ids.long()]
            distinct += int(cid[cid >= 0].unique().numel())
            records.append((layer, table, ids, w, x, out))
    gpu.layer(0, 5, *(t[None] for t in routing(g, torch.bfloat16, (model.cold[LAYERS[0]][0],))), True, tokens=T + 1)
    worker.stop()
    stats = worker.stats()
    assert stats["bad_tokens"] == 1 and stats["errors"] == stats["desync"] == 0
    assert np.array_equal(hs.out.numpy()[0], np.zeros((T, D), np.float32))  # every row zeroed
    assert stats["cold_experts"] == distinct
    for layer, table, ids, w, x, out in records:
        cid = table[ids.long()]
        cold = cid >= 0
        tok = cold.nonzero()[:, 0].to(torch.int32)
        want = cpu.forward(layer, x, tok, cid[cold], w[cold])
        assert torch.equal(torch.from_numpy(out), want)


def test_pass_steps_leave_staged_experts_out(native):
    """The experts a captured pass stages, marked in the shared staged[L, E] before the flag (here by the
    staging rule with 2 routes and at most 2 experts a layer, layers/moe/staging.py plan), are the GPU's:
    the worker computes the other cold routes, bitwise as the synchronous path would, and counts the staged
    experts and their routes. A layer whose cold routes are all staged is answered with zeros and no
    desync; decode steps (n = 1) read no marks, whatever they hold."""
    from ostinato.layers.moe.staging import plan

    model = Model(seed=11)
    T, m, cap = 6, 2, 2
    cpu = CpuExperts(model.host.layers, num_threads=2, backend="native", spin_us=100)
    hs = GraphHandshake(L, K, D, tokens=T, staged_experts=E)
    with pytest.raises(ValueError, match="stages 3 experts a layer"):
        GraphWorker(GraphHandshake(L, K, D, tokens=T, staged_experts=3), cpu, model.host.compact, LAYERS)
    worker = GraphWorker(hs, cpu, model.host.compact, LAYERS, spin_us=200, sleep_us=20, idle_sleep_us=500)
    gpu = FakeGpu(hs, row=slice(None))
    marks = hs.staged.numpy()
    g = torch.Generator().manual_seed(12)
    records, staged, staged_routes = [], 0, 0
    worker.start(1)
    for seq, n in enumerate((1, 4, T, 3), start=1):
        for i, layer in enumerate(LAYERS):
            cold = model.cold[layer]
            if seq == 4 and i == 0:  # every cold route on one expert, routed twice: staged, the rest zeros
                hot = [e for e in range(E) if e not in cold]
                rows = [routing(g, torch.bfloat16) for _ in range(n)]
                rows = [(torch.tensor(([cold[0]] + hot[:K - 1]) if t < 2 else hot[t:t + K], dtype=torch.int32),
                         *rows[t][1:]) for t in range(n)]
            else:
                rows = [routing(g, torch.bfloat16, (cold[t % 3],)) for t in range(n)]
            ids, w, x = (torch.stack(c) for c in zip(*rows))
            table = model.host.compact[layer]
            gpu_table = torch.where(table >= 0, -1, 0).to(torch.int32)  # the pool's row: cold < 0
            real = torch.ones(n, dtype=torch.bool)
            pick = plan(ids, real, gpu_table, m, cap, 0)[1] if n > 1 else torch.zeros(E, dtype=torch.bool)
            marks[i] = pick.numpy() if n > 1 else 1  # a decode step's marks: all set, and unread
            out = gpu.layer(i, seq, ids, w, x, True, tokens=n)
            staged += int(pick.sum())
            cid = table[ids.long()]
            staged_routes += int(((cid >= 0) & pick[ids.long()]).sum())
            records.append((layer, table, ids, w, x, out, pick))
    worker.stop()
    stats = worker.stats()
    assert stats["errors"] == stats["desync"] == stats["bad_tokens"] == 0, stats
    assert stats["staged_experts"] == staged > 0 and stats["staged_routes"] == staged_routes
    for layer, table, ids, w, x, out, pick in records:
        cid = table[ids.long()]
        cold = (cid >= 0) & ~pick[ids.long()]
        tok = cold.nonzero()[:, 0].to(torch.int32)
        want = cpu.forward(layer, x, tok, cid[cold], w[cold]) if cold.any() else torch.zeros(len(ids), D)
        assert torch.equal(torch.from_numpy(out), want)
    assert not any(r[6].any() for r in records[:L])  # the decode step's layers: nothing staged
    assert records[-L][6].any() and (records[-L][5] == 0).all()  # seq 4, layer 0: all staged


def test_table_switch_is_exact(native):
    """Each step's output must use the table of that step, never the neighbour's."""
    model = Model(seed=3)
    cpu, hs, worker = make_worker(native, model)
    gpu = FakeGpu(hs)
    g = torch.Generator().manual_seed(4)
    layer = LAYERS[2]
    a, b = model.cold[layer][:2]
    table_a = model.host.compact[layer].clone()
    table_b = table_a.clone()
    table_b[a] = -1  # a borrowed: hot from step 3
    outs = {}
    worker.start(1)
    for seq in range(1, 5):
        if seq == 3:
            worker.set_compact(layer, table_b)
        for i, l in enumerate(LAYERS):
            ids, w, x = routing(g, torch.bfloat16, (a, b) if l == layer else ())
            x = torch.linspace(-1, 1, D).bfloat16() if l == layer else x  # same input every step
            w = torch.tensor([0.4, 0.3, 0.2, 0.1]) if l == layer else w
            table = (table_b if seq >= 3 else table_a) if l == layer else model.host.compact[l]
            out = gpu.layer(i, seq, ids, w, x, bool((table[ids.long()] >= 0).any()))
            if l == layer:
                outs[seq] = (torch.from_numpy(out), ids, w, x)
    worker.stop()
    for seq, (out, ids, w, x) in outs.items():
        want, _ = expected(cpu, model, layer, table_b if seq >= 3 else table_a, ids, w, x)
        assert torch.equal(out, want), f"step {seq} used the wrong table"
    assert not torch.equal(outs[2][0], outs[3][0])


def test_tables_out_of_sync_do_not_deadlock(native):
    model = Model()
    cpu, hs, worker = make_worker(native, model)
    gpu = FakeGpu(hs)
    layer = LAYERS[1]
    worker.set_compact(layer, torch.full((E,), -1, dtype=torch.int32))  # the CPU thinks all hot
    hs.out.fill_(7.0)
    worker.start(1)
    ids = torch.tensor(model.cold[layer], dtype=torch.int32)  # the GPU thinks all cold
    gpu.publish(0, 1, ids, torch.full((K,), 0.25), torch.randn(D).bfloat16(), 0)
    out = gpu.layer(1, 1, ids, torch.full((K,), 0.25), torch.randn(D).bfloat16(), has_cold=True)
    worker.stop()
    assert np.array_equal(out, np.zeros(D, np.float32))
    assert worker.stats()["desync"] == 1


@pytest.mark.parametrize("mid_step", [False, True])
def test_stop_returns_promptly_without_posts(native, mid_step):
    model = Model()
    # Long sleeps: stop() must cut them short rather than wait them out.
    cpu, hs, worker = make_worker(native, model, spin_us=0, sleep_us=2_000_000, idle_sleep_us=2_000_000)
    gpu = FakeGpu(hs)
    if mid_step:  # layer 0 without cold routes: the worker will wait for layer 1
        ids, w, x = routing(torch.Generator().manual_seed(0), torch.bfloat16)
        gpu.publish(0, 1, ids, w, x, 0)
    worker.start(1)
    if mid_step:
        wait_for(lambda: worker.stats()["layer"] == 1)
    time.sleep(0.05)
    t0 = time.monotonic()
    worker.stop()
    assert time.monotonic() - t0 < 1.0
    assert not worker.running
    worker.start(1)  # restartable
    worker.stop()


def test_worker_catches_up_with_a_gpu_ahead(native):
    """The GPU does not wait at layers without cold routes, so it can post a later step
    before the worker saw the earlier one; the worker must follow, never wait forever."""
    model = Model()
    cpu, hs, worker = make_worker(native, model)
    gpu = FakeGpu(hs)
    g = torch.Generator().manual_seed(5)
    hot = [torch.tensor([e for e in range(E) if model.host.compact[l][e] < 0][:K], dtype=torch.int32)
           for l in LAYERS]
    # Step 1 entirely without cold routes, step 2 layers 0-1 too: already posted.
    for seq, layers in ((1, range(L)), (2, range(2))):
        for i in layers:
            _, w, x = routing(g, torch.bfloat16)
            gpu.publish(i, seq, hot[i], w, x, 0)
    worker.start(1)  # expects step 1 at layer 0 but finds step 2 there
    ids, w, x = routing(g, torch.bfloat16, (model.cold[LAYERS[2]][0],))
    out = gpu.layer(2, 2, ids, w, x, True)
    want, _ = expected(cpu, model, LAYERS[2], model.host.compact[LAYERS[2]], ids, w, x)
    # has_cold of a later step (the GPU is at step 4 while the worker expects step 3).
    gpu.publish(3, 2, hot[3], w, x, 0)
    gpu.publish(0, 3, hot[0], w, x, 0)
    wait_for(lambda: worker.stats()["seq"] == 3 and worker.stats()["layer"] == 1)
    worker.stop()
    gpu.has[1, 0] = 4
    gpu.post[1, 0] = 3  # layer 1 looks posted for step 3 but has_cold already says step 4
    worker.start(3)
    worker_at = lambda: (worker.stats()["seq"], worker.stats()["layer"])  # noqa: E731
    wait_for(lambda: worker_at() == (4, 0))
    ids4, w4, x4 = routing(g, torch.bfloat16, (model.cold[LAYERS[0]][0],))
    out4 = gpu.layer(0, 4, ids4, w4, x4, True)
    worker.stop()
    assert torch.equal(torch.from_numpy(out), want)
    want4, _ = expected(cpu, model, LAYERS[0], model.host.compact[LAYERS[0]], ids4, w4, x4)
    assert torch.equal(torch.from_numpy(out4), want4)
    assert worker.stats()["resyncs"] == 2


def test_reset_after_prefill(native):
    model = Model()
    cpu, hs, worker = make_worker(native, model)
    gpu = FakeGpu(hs)
    g = torch.Generator().manual_seed(6)

    served = []

    def step(seq, layers=range(L)):
        for i in layers:
            ids, w, x = routing(g, torch.bfloat16, (model.cold[LAYERS[i]][0],))
            served.append((LAYERS[i], ids, w, x, gpu.layer(i, seq, ids, w, x, True)))

    with pytest.raises(RuntimeError, match="start"):
        worker.reset(5)  # not running
    worker.start(1)
    for seq in (1, 2, 3):
        step(seq)
    step(4, layers=range(2))  # a step cut short (e.g. a request ended)
    worker.reset(100)  # meanwhile a prefill could have used the pool
    assert (worker.stats()["seq"], worker.stats()["layer"]) == (100, 0)
    for seq in (100, 101):
        step(seq)
    worker.stop()
    hs.clear_flags()  # seq starts over
    worker.start(1)
    step(1)
    worker.reset(7)
    step(7)
    worker.stop()
    for layer, ids, w, x, out in served:
        want, _ = expected(cpu, model, layer, model.host.compact[layer], ids, w, x)
        assert torch.equal(torch.from_numpy(out), want)
    assert worker.stats()["layers_served"] == len(served) == 3 * L + 2 + 2 * L + 2 * L


def test_stats_and_bad_inputs(native):
    model = Model()
    cpu, hs, worker = make_worker(native, model)
    assert worker.core == -1 or worker.core in os.sched_getaffinity(0)
    with pytest.raises(ValueError, match="outside"):
        worker.set_compact(LAYERS[0], torch.full((E,), 99, dtype=torch.int32))
    with pytest.raises(ValueError, match="entries"):
        worker.set_compact(LAYERS[0], torch.zeros(E + 1, dtype=torch.int32))
    gpu = FakeGpu(hs)
    worker.start(1)
    with pytest.raises(RuntimeError, match="running"):
        worker.start(1)
    g = torch.Generator().manual_seed(7)
    for seq in (1, 2):
        for i, l in enumerate(LAYERS):
            ids, w, x = routing(g, torch.bfloat16, (model.cold[l][0],) if i % 2 == 0 else ())
            gpu.layer(i, seq, ids, w, x, bool((model.host.compact[l][ids.long()] >= 0).any()))
    wait_for(lambda: worker.stats()["steps"] >= 1)
    worker.stop()
    s = worker.stats()
    assert s["last_layers"] >= 1 and s["last_routes"] >= 1 and s["last_compute_ns"] > 0
    assert s["compute_ns"] >= s["last_compute_ns"] and s["compute_us_per_step"] > 0
    # the counters a turn's figures are differences of (GraphHybridExperts.stats): never the gauges
    assert set(GraphWorker.COUNTERS) <= set(s) and not any(k.startswith("last_") for k in GraphWorker.COUNTERS)
    torch_cpu = CpuExperts(model.host.layers, backend="torch")
    with pytest.raises(RuntimeError, match="native"):
        GraphWorker(hs, torch_cpu, model.host.compact, LAYERS)
