"""The thread layout (ostinato/threads.py) on faked topologies: every poller and the host thread on
a physical core of its own, the workers on the rest, on any core count."""
import os
import threading

import pytest
import torch

from ostinato.threads import Cpu, Topology, claim_host_thread, cgroup_quota, thread_layout


def fake(cores: int, smt: int = 1, nodes: int = 1, quota: float | None = None) -> Topology:
    """`cores` physical cores numbered like Linux does (siblings after all first threads),
    split into `nodes` NUMA nodes of consecutive cores (node -1 for a one-node machine)."""
    cpus = [Cpu(t * cores + c, (c * nodes // cores, c), c * nodes // cores if nodes > 1 else -1)
            for t in range(smt) for c in range(cores)]
    return Topology(tuple(cpus), quota)




def check_own_cores(layout, topo: Topology) -> None:
    """Host, pollers and workers on distinct physical cores."""
    core = {c.id: c.core for c in topo.cpus}
    busy = [core[layout.host[0]]] + [core[p] for p in layout.pollers] + [core[w] for w in layout.workers]
    assert len(busy) == len(set(busy)), layout


@pytest.mark.parametrize("cores", [2, 4, 16, 32, 64])
@pytest.mark.parametrize("smt", [1, 2])
@pytest.mark.parametrize("gpus", [0, 1, 2])
@pytest.mark.parametrize("graphs", [False, True])
def test_default_layout_gives_host_and_pollers_cores_of_their_own(cores, smt, gpus, graphs):
    topo = fake(cores, smt)
    lay = thread_layout(topo, [-1] * gpus, graphs)
    pollers = gpus if graphs else 0
    assert len(lay.pollers) == pollers and lay.graphs == bool(pollers)
    assert lay.allowed == cores * smt and lay.physical == cores
    core = {c.id: c.core for c in topo.cpus}
    assert len(set(core[c] for c in lay.host)) == 1  # the host's CPUs: one physical core (and its siblings)
    assert len(lay.host) == smt
    if cores >= pollers + 2:  # enough cores: nothing shares, and every core works
        check_own_cores(lay, topo)
        assert not lay.host_shares_poller and not lay.notes
        assert len(lay.workers) == cores - 1 - pollers
    else:  # 2 cores, 2 graph pollers: the host sleeps on the first poller's core
        assert lay.host_shares_poller and lay.host[0] == lay.pollers[0] and lay.notes
        assert len(lay.workers) >= 1
    if not pollers:  # host-driven: the host thread is the pool's last worker, as before
        assert len(lay.workers) == max(1, cores - 1)
    assert all(w < cores for w in lay.workers)  # SMT siblings stay idle by default


def test_sixteen_cores_one_gpu_graphs():
    """The GPU machine: 16 cores, one H200, graph decode: 14 workers, not the 15 that starved
    the poller (issue [H])."""
    lay = thread_layout(fake(16), [0], True)
    assert lay.host == (0,) and lay.pollers == (1,) and lay.workers == tuple(range(2, 16))
    assert "14 on 2-15" in lay.describe() and "graph pollers on 1" in lay.describe()
    host_driven = thread_layout(fake(16), [0], False)
    assert host_driven.pollers == () and host_driven.workers == tuple(range(1, 16))


@pytest.mark.parametrize("smt", [1, 2])
def test_explicit_count_that_does_not_fit_keeps_host_and_poller_cores(smt):
    """--cpu-threads 15 on 16 cores with a graph: accepted with a note that names 14, and the
    host's and the poller's cores stay theirs (the extra worker takes an SMT sibling, else
    shares a worker's core)."""
    topo = fake(16, smt)
    lay = thread_layout(topo, [0], True, cpu_threads=15)
    assert len(lay.workers) == 15
    assert any("the largest that fits is 14" in n for n in lay.notes)
    core = {c.id: c.core for c in topo.cpus}
    reserved = {core[lay.host[0]], core[lay.pollers[0]]}
    assert not reserved & {core[w] for w in lay.workers}
    if smt == 2:
        assert len(set(lay.workers)) == 15  # a sibling, not a shared CPU
    fits = thread_layout(topo, [0], True, cpu_threads=14)
    assert not fits.notes and len(set(fits.workers)) == 14


def test_explicit_count_below_the_default():
    lay = thread_layout(fake(16), [0], True, cpu_threads=10)
    assert lay.workers == tuple(range(2, 12)) and not lay.notes
    with pytest.raises(ValueError, match="at least 1"):
        thread_layout(fake(16), [0], True, cpu_threads=0)


def test_cgroup_quota_caps_the_busy_threads():
    """A container granted 4 CPUs' time out of 64 allowed runs 4 busy threads, not 64."""
    lay = thread_layout(fake(64, quota=4.0), [0], True)
    assert lay.physical == 4 and len(lay.workers) == 2 and lay.host == (0,) and lay.pollers == (1,)
    assert thread_layout(fake(8, quota=2.5), [], False).physical == 2


def test_cgroup_quota_files(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cgroup_quota(tmp_path) == 2.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(v1) == 4.0


def test_two_numa_nodes_keep_each_gpus_workers_on_its_node():
    """The paper's machine: two sockets. A GPU's poller and workers stay on its node; two GPUs
    on two nodes get a pool each; one GPU leaves the other node's cores alone."""
    topo = fake(32, smt=2, nodes=2)
    node = {c.id: c.node for c in topo.cpus}
    two = thread_layout(topo, [0, 1], True)
    assert [g.node for g in two.groups] == [0, 1] and [g.gpus for g in two.groups] == [(0,), (1,)]
    assert {node[c] for c in two.groups[0].cpus} == {0} and {node[c] for c in two.groups[1].cpus} == {1}
    assert node[two.pollers[0]] == 0 and node[two.pollers[1]] == 1 and node[two.host[0]] == 0
    assert len(two.groups[0].cpus) == 14 and len(two.groups[1].cpus) == 15
    check_own_cores(two, topo)
    one = thread_layout(topo, [1], True)
    assert [g.node for g in one.groups] == [1] and node[one.host[0]] == 1 and len(one.workers) == 14
    same = thread_layout(topo, [0, 0], True)  # both GPUs on node 0: one pool there
    assert len(same.groups) == 1 and same.groups[0].gpus == (0, 1) and len(same.workers) == 13
    unknown = thread_layout(topo, [-1], True)  # a GPU of unknown node: every core may work
    assert len(unknown.groups) == 1 and len(unknown.workers) == 30
    split = thread_layout(topo, [0, 1], True, cpu_threads=20)
    assert [len(g.cpus) for g in split.groups] == [10, 10] and not split.notes


def test_as_dict_records_the_layout():
    d = thread_layout(fake(16), [0], True).as_dict()
    assert d["host"] == [0] and d["pollers"] == [1] and d["num_workers"] == 14 and d["physical_cores"] == 16
    assert d["workers"][0]["cpus"] == list(range(2, 16))


def test_read_topology_of_this_process():
    topo = Topology.read()
    assert topo.cpus and topo.cores()
    lay = thread_layout(topo)
    assert lay.workers and set(lay.workers) | set(lay.host) <= {c.id for c in topo.cpus}


def test_claim_host_thread_sets_each_calling_thread_once():
    """The runner calls it before every pass on a GPU: torch's intra-op pool goes to one thread in
    the thread that runs the model (also one that ran a parallel op first), and that thread is
    pinned to the layout's host CPUs; other threads keep theirs."""
    import os

    topo = Topology.read()
    lay = thread_layout(topo)
    before_threads, before_cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    seen = {}

    def worker():
        torch.ones(1 << 20).sum()  # a parallel op first: torch keeps this thread's setting from now on
        claim_host_thread(lay)
        claim_host_thread(lay)  # once per thread
        seen["threads"], seen["cpus"] = torch.get_num_threads(), os.sched_getaffinity(0)

    try:
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert seen["threads"] == 1 and seen["cpus"] == set(lay.host)
        assert os.sched_getaffinity(0) == before_cpus  # the caller's own thread is untouched
    finally:
        torch.set_num_threads(before_threads)


def test_calibrate_refuses_a_starved_graph_poller():
    """The graph fit of issue [H]'s 16-core run (alpha 3.556 ms, forced r=1 step 181 ms) is a
    misconfiguration: calibrate names it and the layout instead of saving it."""
    from ostinato.config import ConfigError
    from ostinato.planner.calibrate import check_handshake

    lay = thread_layout(fake(16), [0], True, cpu_threads=15)
    glob = {"alpha_ms": 0.577}
    starved = {"graph_fit": {"alpha_ms": 3.556, "beta_ms": 0.096},
               "forced_steps": {"r": [0, 1], "measured_ms": [10.0, 181.0]}}
    with pytest.raises(ConfigError, match="starved") as e:
        check_handshake(starved, glob, lay)
    assert "r=1: 181.00 ms" in str(e.value) and "graph pollers on 1" in str(e.value)
    twice = dict(starved, first_forced_steps={"r": [0, 1], "measured_ms": [10.0, 175.0]})
    with pytest.raises(ConfigError, match="measured before: r=0: 10.00 ms, r=1: 175.00 ms"):
        check_handshake(twice, glob, lay)  # refused after a second measurement: both are named
    tight = {"graph_fit": {"alpha_ms": 0.05, "beta_ms": 0.08}, "forced_steps": {"r": [0, 1], "measured_ms": [10.0, 13.0]}}
    with pytest.raises(ConfigError):
        check_handshake(tight, {"alpha_ms": 0.004}, lay)  # 12x the host-driven alpha
    check_handshake(dict(tight, graph_fit={"alpha_ms": 0.024, "beta_ms": 0.077}), glob, lay)  # the good layout
    check_handshake({"forced_steps": {}}, glob, lay)  # host-driven: no graph fit to judge
    # DeepSeek-V3-shaped's 88 MB experts on the H100 machine (session 50): the graph's alpha is above the
    # handshake's few microseconds, but below the host-driven branch's own: a good layout, not a starved one
    big = {"graph_fit": {"alpha_ms": 0.323, "beta_ms": 0.93}, "forced_steps": {"r": [0, 1], "measured_ms": [4.42, 8.09]}}
    check_handshake(big, {"alpha_ms": 0.433}, lay)
    with pytest.raises(ConfigError, match="starved"):
        check_handshake(dict(big, graph_fit={"alpha_ms": 0.7, "beta_ms": 0.93}), {"alpha_ms": 0.433}, lay)


def test_on_workers_runs_each_item_once_on_the_workers_cpus():
    """A load's layers on threads pinned to the workers' CPUs (torch at one thread in the caller, as a
    GPU run's host thread); in the caller where torch runs several threads or there is one job; the
    first error raised, and items not yet started dropped."""
    import time

    from ostinato.threads import ThreadLayout, WorkerGroup, on_workers

    cpus = tuple(sorted(os.sched_getaffinity(0)))
    lay = ThreadLayout(host=cpus[:1], pollers=(), groups=(WorkerGroup(cpus, (0,), -1),))
    main = threading.get_ident()
    seen, lock = [], threading.Lock()

    def record(i):
        with lock:
            seen.append((i, threading.get_ident() != main, tuple(sorted(os.sched_getaffinity(0)))))

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        on_workers(record, list(range(10)), lay, jobs=3)
        assert sorted(i for i, _, _ in seen) == list(range(10))
        assert all(off and aff == cpus for _, off, aff in seen) == (len(cpus) > 1)
        seen.clear()
        on_workers(record, list(range(4)), lay, jobs=1)
        assert [(i, off) for i, off, _ in seen] == [(i, False) for i in range(4)]
        seen.clear()
        on_workers(record, list(range(4)), None)
        assert [(i, off) for i, off, _ in seen] == [(i, False) for i in range(4)]

        def fail(i):
            if i == 0:
                raise ValueError("layer 0")
            time.sleep(0.05)
            record(i)

        seen.clear()
        with pytest.raises(ValueError, match="layer 0"):
            on_workers(fail, list(range(50)), ThreadLayout(cpus[:1], (), (WorkerGroup(cpus * 2, (0,), -1),)), jobs=2)
        assert len(seen) < 49  # the queued items were dropped
    finally:
        torch.set_num_threads(before)
    if torch.get_num_threads() > 1:  # torch's own threads copy in parallel: no pool of ours
        seen.clear()
        on_workers(record, [0, 1], lay, jobs=2)
        assert [off for _, off, _ in seen] == [False, False]
