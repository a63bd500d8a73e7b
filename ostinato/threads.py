"""Who owns which core (DESIGN.md, "Threads"): one function lays out the threads of a process.

Three kinds of thread run while the engine serves:
- the host thread runs the model: Python, launches, and, in a split pass, the CPU pool's last
  worker; while a decode graph replays it spins in CUDA's synchronize;
- one graph poller per GPU (layers/moe/graph_worker.py) spins on the mapped-memory flags of the
  decode graph and serves each layer's cold routes as the CPU pool's submitter;
- the expert workers of the CPU pool, one pinned to each core it may use.
Before that, while a model loads, its layers are copied on a few threads pinned to the workers'
CPUs (`on_workers`).

The CPU branch is memory-bound and gains from every core; the handshake is latency-bound: a
poller that shares its core with another busy thread waits for the scheduler (a slice of
milliseconds) at every layer with a cold route. So `thread_layout` gives the host thread and each
poller a physical core of its own, and the workers take the remaining physical cores, those of
the GPU's NUMA node where it is known. SMT siblings are left idle: two threads on one core share
its load ports, and the experts are memory-bound.

An explicit worker count that does not fit beside the host and the pollers is accepted with a
note (printed at start-up): the host and the pollers keep their cores, and the extra workers go
to the SMT siblings of the workers' cores, then two to a core. The note names the largest count
that fits. On a machine with too few cores for that (fewer than the pollers + 2) the host shares
the first poller's core, and the runner then waits for a replayed step on a blocking event, so
that the host sleeps rather than spins beside the poller.

`Topology.read()` is this process's view: `sched_getaffinity`, the cgroup's CPU quota (a
container limited to 4 CPUs of 64 gets a layout of 4), cores and NUMA nodes from sysfs.
"""
from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

_SYS = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class Cpu:
    id: int  # logical CPU
    core: tuple[int, int]  # (package, core id): the physical core
    node: int = -1  # NUMA node, -1 unknown


@dataclass(frozen=True)
class Topology:
    cpus: tuple[Cpu, ...]  # the logical CPUs this process may use
    quota: float | None = None  # the cgroup's CPU bandwidth in CPUs (None: no limit)

    @staticmethod
    @functools.cache
    def read() -> "Topology":
        """Read once per process: the first layout is computed at load, before any thread is
        pinned (sched_getaffinity reads the calling thread's CPUs)."""
        cpus = []
        for c in sorted(os.sched_getaffinity(0)):
            topo = _SYS / f"cpu{c}" / "topology"
            try:
                core = (int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text()))
            except (OSError, ValueError):
                core = (-1, c)
            nodes = sorted(_SYS.glob(f"cpu{c}/node[0-9]*"))
            cpus.append(Cpu(c, core, int(nodes[0].name[4:]) if nodes else -1))
        return Topology(tuple(cpus), cgroup_quota())

    def cores(self) -> list[list[Cpu]]:
        """Physical cores (their logical CPUs, lowest first), in the order of their first CPU."""
        by_core: dict[tuple[int, int], list[Cpu]] = {}
        for c in sorted(self.cpus, key=lambda c: c.id):
            by_core.setdefault(c.core, []).append(c)
        return list(by_core.values())


def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup of this process may use (v2 cpu.max, v1 cfs quota)."""
    rel = ""
    try:
        for line in open("/proc/self/cgroup"):
            if line.startswith("0::"):
                rel = line.strip()[3:].lstrip("/")
    except OSError:
        pass
    candidates = [(root / rel / "cpu.max", None), (root / "cpu.max", None),
                  (root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"),
                  (root / "cpu,cpuacct" / "cpu.cfs_quota_us", root / "cpu,cpuacct" / "cpu.cfs_period_us")]
    for quota, period in candidates:
        try:
            if period is None:
                q, p = quota.read_text().split()[:2]
            else:
                q, p = quota.read_text().strip(), period.read_text().strip()
        except (OSError, ValueError):
            continue
        if q in ("max", "-1"):
            return None
        return int(q) / int(p)
    return None


@dataclass(frozen=True)
class WorkerGroup:
    """One CPU expert pool: its pinned workers and the GPUs whose cold routes it serves."""
    cpus: tuple[int, ...]
    gpus: tuple[int, ...]  # positions in the layout's GPU list
    node: int = -1


@dataclass(frozen=True)
class ThreadLayout:
    host: tuple[int, ...]  # the host thread's CPUs (one physical core)
    pollers: tuple[int, ...]  # one CPU per GPU when decode runs as graphs, else empty
    groups: tuple[WorkerGroup, ...]  # the CPU pools; one unless GPUs sit on different NUMA nodes
    host_shares_poller: bool = False  # too few cores: the host waits for replays on a blocking event
    notes: tuple[str, ...] = ()
    allowed: int = 0  # logical CPUs this process may use
    physical: int = 0  # physical cores among them (after the cgroup quota)
    requested: int | None = None  # the --cpu-threads asked for
    graphs: bool = False

    @property
    def workers(self) -> tuple[int, ...]:
        return tuple(c for g in self.groups for c in g.cpus)

    def group_of(self, gpu: int) -> WorkerGroup:
        return next((g for g in self.groups if gpu in g.gpus), self.groups[0])

    def as_dict(self) -> dict:
        return {"host": list(self.host), "pollers": list(self.pollers), "graphs": self.graphs,
                "workers": [{"cpus": list(g.cpus), "gpus": list(g.gpus), "node": g.node} for g in self.groups],
                "num_workers": len(self.workers), "host_shares_poller": self.host_shares_poller,
                "allowed_cpus": self.allowed, "physical_cores": self.physical, "requested": self.requested,
                "notes": list(self.notes)}

    def describe(self) -> str:
        pools = "; ".join(f"{len(g.cpus)} on {_ranges(g.cpus)}" + (f" (node {g.node})" if g.node >= 0 else "")
                          for g in self.groups)
        polls = f", graph pollers on {', '.join(map(str, self.pollers))}" if self.pollers else ""
        text = (f"threads: host on CPU {_ranges(self.host)}{polls}, CPU expert workers {pools} "
                f"({self.physical} physical cores of {self.allowed} CPUs allowed)")
        return "\n".join([text] + [f"  note: {n}" for n in self.notes])


def _ranges(cpus: Sequence[int]) -> str:
    out, cpus = [], sorted(set(cpus))
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out) or "-"


def thread_layout(topo: Topology, gpu_nodes: Sequence[int] = (), graphs: bool = False,
                  cpu_threads: int | None = None) -> ThreadLayout:
    """The layout for a process with these GPUs (their NUMA nodes, -1 unknown; none for a
    CPU-only run) whose decode runs as graphs or not, with cpu_threads workers (None: every
    physical core left). Pure: the same topology gives the same layout."""
    if cpu_threads is not None and cpu_threads < 1:
        raise ValueError(f"--cpu-threads must be at least 1, got {cpu_threads}")
    cores = topo.cores()
    if not cores:
        raise ValueError("no CPU is allowed to this process")
    if topo.quota is not None:  # a container's CPU time: never more busy threads than it grants
        cores = cores[:max(1, math.floor(topo.quota + 1e-6))]
    core_nodes = {c[0].node for c in cores}
    numa = len(core_nodes) > 1 and -1 not in core_nodes
    nodes = [n if numa and n in core_nodes else -1 for n in gpu_nodes]
    npoll = len(nodes) if graphs else 0
    free, notes = list(cores), []

    def take(node: int) -> list[Cpu]:
        """A free core, on `node` where one is left."""
        pick = next((c for c in free if c[0].node == node), free[0])
        free.remove(pick)
        return pick

    shares = npoll > 0 and len(cores) < npoll + 2
    if shares:  # the pollers first; the host sleeps on the first one's core while a step replays
        pollers = [(take(nodes[i]) if free else cores[i % len(cores)])[0].id for i in range(npoll)]
        host = next(c for c in cores if c[0].id == pollers[0])
        notes.append(f"{len(cores)} cores for {npoll} graph poller(s), the host thread and the CPU experts: the "
                     "host thread shares the first poller's core and sleeps while a step replays")
    else:
        host = take(nodes[0] if nodes else -1)
        pollers = [take(nodes[i])[0].id for i in range(npoll)]
    # one pool per NUMA node of the GPUs where nodes are known (GPUs of unknown node join the first)
    group_nodes = sorted({n for n in nodes if n >= 0}) or [-1]
    gpus_of = {n: tuple(i for i, g in enumerate(nodes) if g == n or (g < 0 and n == group_nodes[0]))
               for n in group_nodes}
    own = {n: [c for c in free if n < 0 or c[0].node == n] or free for n in group_nodes}
    if not free:  # every core is the host's or a poller's
        own = {n: [host] for n in group_nodes}
        notes.append(f"{len(cores)} core(s): the CPU experts share the host thread's core")
    counts = {n: len(v) for n, v in own.items()}
    if cpu_threads is not None:
        counts = {n: cpu_threads // len(group_nodes) + (i < cpu_threads % len(group_nodes))
                  for i, n in enumerate(group_nodes)}
        fits = len({c[0].id for v in own.values() for c in v}) if free else 0
        if any(counts[n] > len(own[n]) for n in group_nodes):
            reserved = "the host thread" + (f" and {npoll} graph poller(s)" if npoll else "")
            notes.append(f"--cpu-threads {cpu_threads} does not fit beside {reserved} on {len(cores)} physical "
                         f"cores: the largest that fits is {fits}; the extra workers share cores (SMT siblings "
                         "first), so decode may slow down")
    groups = []
    for n in group_nodes:
        order = [c[0].id for c in own[n]] + [s.id for c in own[n] for s in c[1:]]  # cores, then siblings
        groups.append(WorkerGroup(tuple(order[i % len(order)] for i in range(max(1, counts[n]))), gpus_of[n], n))
    return ThreadLayout(tuple(c.id for c in host), tuple(pollers), tuple(groups), shares, tuple(notes),
                        len(topo.cpus), len(cores), cpu_threads, npoll > 0)


def gpu_node(index: int) -> int:
    """The NUMA node of CUDA device `index` (sysfs, from its PCI address), -1 if unknown."""
    try:
        p = torch.cuda.get_device_properties(index)
        addr = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        return int(Path(f"/sys/bus/pci/devices/{addr}/numa_node").read_text())
    except (AttributeError, OSError, ValueError, RuntimeError):
        return -1


def process_layout(gpus: Sequence[int] = (), graphs: bool = False, cpu_threads: int | None = None) -> ThreadLayout:
    """The layout of this process: CUDA device indices `gpus` (none on a CPU-only run)."""
    return thread_layout(Topology.read(), [gpu_node(i) for i in gpus], graphs, cpu_threads)


_host = threading.local()


def claim_host_thread(layout: ThreadLayout | None) -> None:
    """Pin the calling thread (the one that runs the model on a GPU) to the layout's host CPUs
    and keep torch's intra-op threads at one there: its host ops are bookkeeping of a few
    thousand elements, and torch's pool, spinning after such an op, took the cores of the CPU
    experts' pinned workers (results/2026-11-29-h200x2-s4/b_split.txt). Once per thread and
    layout: torch keeps a thread's setting once that thread has run a parallel op."""
    done = getattr(_host, "layout", None)
    if (done is layout or done == layout) and getattr(_host, "single", False):  # every pass: identity first
        return
    if not getattr(_host, "single", False):
        torch.set_num_threads(1)
        _host.single = True
    if layout is not None and layout.host:
        _pin(layout.host)
    _host.layout = layout


def _pin(cpus: Sequence[int]) -> None:
    """The calling thread onto `cpus` (pid 0: this thread), where the process may use them."""
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        pass


LOAD_JOBS = 4  # layers a model's load copies at once (each holds one layer's experts in host memory)


def on_workers(fn, items: Sequence, layout: ThreadLayout | None, jobs: int = LOAD_JOBS) -> None:
    """fn(item) for every item, `jobs` at a time, on threads pinned to the layout's expert workers'
    CPUs: for a model's load. A GPU run's host thread runs torch at one thread on one core
    (claim_host_thread), so every copy of a load (the file's pages into host memory, the pool's and
    the page-locked host copies) ran on that core (session 27: 140.7 s for the experts of a 46 GB
    file, 0.33 GB/s). The workers' CPUs are idle while a model loads. New threads take torch's
    thread count from the process (one, once the host thread is claimed). Where the caller's torch
    runs several threads (a CPU run), its copies are parallel already, and fn runs in the calling
    thread, as it does where jobs is 1 or there is no layout. The first error is raised; items not
    yet started are dropped."""
    cpus = layout.workers if layout is not None else ()
    jobs = min(jobs, len(cpus), len(items))
    if jobs <= 1 or torch.get_num_threads() > 1:
        for item in items:
            fn(item)
        return
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(jobs, thread_name_prefix="ostinato-load", initializer=_pin, initargs=(cpus,))
    try:
        for _ in pool.map(fn, items):
            pass
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
