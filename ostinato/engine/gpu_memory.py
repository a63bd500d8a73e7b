"""The GPU memory cap (`--gpu-memory`) as a user and a peer engine count it: what `nvidia-smi`
gives this process, not only what torch's allocator holds.

torch's allocator never sees the CUDA context, the libraries' handles or the loaded kernel
modules (hundreds of MiB on a Hopper GPU), yet they are this process's memory, and llama.cpp's
`nvidia-smi` figure includes them. So the cap given to the allocator is the cap less what the
process already holds outside it when the cap is applied (after the context exists); what comes
later outside the allocator (kernel modules of later compilations, a few MiB each) is the
capacity plan's margin's to absorb.

`process_gpu_mib` reads `nvidia-smi` (a driver tool wherever there is an NVIDIA GPU). Where it
cannot list this process (no tool, or a PID namespace that hides it), the device's used memory
(`cudaMemGetInfo`) stands in, which also counts any other process on the GPU: a cap then leaves
less to the pool than the user gave, never more.
"""
from __future__ import annotations

import logging
import os
import subprocess

import torch

from ostinato.config import ConfigError

log = logging.getLogger("ostinato")
MiB = 2**20


def process_gpu_mib(pid: int | None = None, uuid: str | None = None) -> int | None:
    """GPU memory (MiB) that nvidia-smi gives process `pid` (default: this one) on the GPU whose
    UUID contains `uuid` (default: all its GPUs, summed); None where nvidia-smi does not list it."""
    pid = os.getpid() if pid is None else pid
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory,gpu_uuid",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_compute_apps(out, pid, uuid)


def parse_compute_apps(text: str, pid: int, uuid: str | None = None) -> int | None:
    """The sum of used_memory over the lines of `pid` (on the GPU matching `uuid`, if given) in
    nvidia-smi's `--query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader,nounits`."""
    total = None
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2 or parts[0] != str(pid) or not parts[1].isdigit():
            continue
        if uuid is not None and (len(parts) < 3 or uuid not in parts[2]):
            continue
        total = (total or 0) + int(parts[1])
    return total


def outside_allocator_bytes(device: torch.device) -> int:
    """GPU memory this process holds on `device` outside torch's allocator (the CUDA context above
    all), the context created first if it was not yet."""
    torch.empty(1, device=device)  # the context exists from here on
    torch.cuda.synchronize(device)
    reserved = torch.cuda.memory_reserved(device)
    mib = process_gpu_mib(uuid=str(torch.cuda.get_device_properties(device).uuid))
    if mib is not None:
        return max(0, mib * MiB - reserved)
    free, total = torch.cuda.mem_get_info(device)
    log.info("nvidia-smi does not list this process: the GPU's used memory stands in for its own")
    return max(0, total - free - reserved)


def allocator_limit(cap: int, total: int, outside: int) -> int:
    """The bytes torch's allocator may reserve so that the process stays under `cap` with
    `outside` bytes beside the allocator, on a device of `total` bytes."""
    if cap > total:
        raise ConfigError(f"--gpu-memory {cap / 2**30:.1f} GiB exceeds the device's {total / 2**30:.1f} GiB")
    if cap <= outside:
        raise ConfigError(f"--gpu-memory {cap / 2**30:.1f} GiB does not even hold the {outside / MiB:.0f} MiB this "
                          "process has on the GPU outside its allocator (the CUDA context): give a larger cap")
    return cap - outside


def allocator_account(e: torch.OutOfMemoryError) -> str:
    """What an out-of-memory error's first sentences say: what did not fit, and what was free and held
    (without the allocator's advice on fragmentation)."""
    return str(e).splitlines()[0].split(" If reserved but unallocated")[0] if str(e) else "no detail"


def apply_memory_cap(device: torch.device, cap: int | None) -> None:
    """Hold this process under `cap` bytes on `device`, as nvidia-smi counts it (module docstring).
    Applied again (another placement in the same process), it recounts what lies outside."""
    if cap is None or device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    dev = torch.device("cuda", index)
    total = torch.cuda.get_device_properties(dev).total_memory
    outside = outside_allocator_bytes(dev)
    limit = allocator_limit(cap, total, outside)
    torch.cuda.set_per_process_memory_fraction(limit / total, index)
    log.debug("GPU memory cap %.2f GiB: %.0f MiB outside the allocator, %.2f GiB for it",
              cap / 2**30, outside / MiB, limit / 2**30)


def memory_figures(device: torch.device) -> dict | None:
    """What this process holds on `device`, as a run records it beside its cap: nvidia-smi's figure
    (MiB, None where it does not list this process) and torch's allocator peak since the last
    torch.cuda.reset_peak_memory_stats (MiB); None off CUDA."""
    if device.type != "cuda":
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return {"process_mib": process_gpu_mib(uuid=uuid),
            "allocator_peak_mib": round(torch.cuda.max_memory_reserved(device) / MiB)}


# torch's allocator counters that say a pass paid for memory: cudaMalloc calls, and retries (every cached
# block freed, the streams synchronised, the cudaMalloc tried again: what a pass meets near the cap)
ALLOCATOR_COUNTERS = {"num_device_alloc": "cuda_mallocs", "num_alloc_retries": "cuda_malloc_retries"}


def allocator_counters(devices) -> dict[str, int]:
    """Cumulative allocator counters (ALLOCATOR_COUNTERS) summed over the CUDA devices among
    `devices`; empty where there is none."""
    out: dict[str, int] = {}
    for dev in {torch.device(d) for d in devices}:
        if dev.type != "cuda":
            continue
        stats = torch.cuda.memory_stats(dev)
        for key, name in ALLOCATOR_COUNTERS.items():
            out[name] = out.get(name, 0) + int(stats.get(key, 0))
    return out
