"""Transfers the cost model prices by bandwidth:

  upload     GB/s of the upload path's copies (page-locked host -> flex slots), and the bytes
             of one expert;
  host read  GB/s of host-memory reads on the CPU workers' cores (the decode bound's divisor; bench
             measures it around each policy's replay to show the machine's drift).
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence

import torch

from ostinato.layers.moe.cpu_experts import CpuExperts
from ostinato.planner.measure.timing import Clock


def measure_upload(h, layers: list[int], clock: Clock, reps: int = 3) -> tuple[float, int]:
    """GB/s of the upload path's copies of cold experts into flex slots; -> (GB/s, expert bytes)."""
    rates, sizes = [], []
    for layer in layers:
        pool = h.pools.of(layer)
        cold = h.cold_experts(layer).tolist()[:pool.num_slots - pool.flex_lo]
        if not cold:
            continue

        def copy() -> int:  # as HybridExperts.upload_path: the pool's own copy of each expert (biases too)
            return pool.upload(range(pool.flex_lo, pool.flex_lo + len(cold)), h.host, layer, cold)

        nbytes = copy()
        for _ in range(reps):
            rates.append(nbytes / (clock.wall(copy) * 1e-3) / 1e9)
            sizes.append(nbytes // len(cold))
    # expert bytes: the mean over the measured layers (a quantized model's formats differ by layer)
    eb = round(statistics.fmean(sizes)) if sizes else h.pools.groups[0].expert_bytes
    return (statistics.median(rates) if rates else 0.0), eb


def read_buffer(gib: float) -> torch.Tensor:
    """A bf16 buffer of `gib` GiB to read, every page written (pages never written would all map
    the kernel's one zero page, and their reads would come from the caches)."""
    return torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16)


def measure_host_read(cpus: Sequence[int], gib: float = 2.0, reps: int = 3, buf: torch.Tensor | None = None) -> float:
    """Host-memory read bandwidth, GB/s: a torch sum over a buffer far larger than the caches
    (buf, else a new one of `gib` GiB), on one thread per CPU of `cpus` (BENCHMARK.md's bound
    divides cold bytes by this). The calling thread may be pinned to one core (the host
    thread's): torch's threads, started from it, would inherit that, so it takes `cpus` for
    the measurement."""
    buf = read_buffer(gib) if buf is None else buf
    before = torch.get_num_threads()
    torch.set_num_threads(len(set(cpus)))
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        buf.sum()  # first touch and thread start-up
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
        os.sched_setaffinity(0, pinned)
    return round(buf.numel() * buf.element_size() / best / 1e9, 2)


def host_read_gbps(cpu: CpuExperts | None, cpus: Sequence[int], gib: float = 1.0, reps: int = 3,
                   buf: torch.Tensor | None = None) -> dict:
    """Host-memory read bandwidth with a CPU pool, GB/s, best of `reps` reads of buf (else a
    new one of `gib` GiB) after one unmeasured read: {"gbps", "probe"}. The one place that
    picks the probe: "native" where the pool runs the native kernels (its workers and the
    calling thread sum the buffer in 1 MiB tasks, ColdExperts::read_seconds: what the kernels
    get, 140 GB/s on the H200 machine's 15 workers), else "torch-sum" on `cpus`
    (measure_host_read: 78 GB/s there). Figures of two probes do not compare."""
    buf = read_buffer(gib) if buf is None else buf
    if cpu is None or cpu.backend != "native":
        return {"gbps": measure_host_read(cpus, reps=reps, buf=buf), "probe": "torch-sum"}
    cpu.read_seconds(buf)  # first touch and the workers woken
    best = min(cpu.read_seconds(buf) for _ in range(reps))
    return {"gbps": round(buf.numel() * buf.element_size() / best / 1e9, 2), "probe": "native"}
