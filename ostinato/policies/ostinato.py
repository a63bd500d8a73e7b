"""The `ostinato` policy: the design itself, HybridExperts over a residency, unchanged.

For a real model it is built by the engine's own `build_hybrid` (engine/placement.py) and
handed to the runner as it is, so a replay measures exactly what `ostinato serve
--residency R` runs, the runner's decode graph (the mapped-memory handshake wrapper)
included. Nothing wraps it here; the helpers below close any backend (hybrid, its graph
wrapper, or a baseline) and read what a report needs from it.

Rules (DESIGN.md, "Three execution paths"): the residency's hot experts are resident in
every pass; a decode step and a pass below Np compute the cold routes on the CPU while the
GPU computes the hot ones (zero slots for cold positions); a pass of at least Np tokens
uploads each distinct cold expert once into a flex slot and computes everything on the
GPU. Hot experts are never uploaded, nothing is evicted.
"""
from __future__ import annotations

import torch

from ostinato.layers.moe.hybrid import HybridExperts
from ostinato.policies.base import ModelExperts, build_parts, unpin


def hybrid_from_parts(spec: ModelExperts, hot: dict[int, list[int]], upload_threshold: int | None,
                      cpu_backend="auto", flex: int | None = None, upload_all: bool = False) -> HybridExperts:
    """A static placement over the one executor, from a spec: `hot` resident, `flex` slots for
    the upload path (default: each format group's most cold experts of a layer; 0 without an
    upload path)."""
    cold = {l: sorted(set(range(spec.num_experts)) - set(hot.get(l, []))) for l in spec.moe_layers}
    pools, host, cpu = build_parts(spec, hot, cold, flex, cpu_backend)
    for l in spec.moe_layers:  # HybridExperts reads every layer's host table, resident-only layers too
        host.compact.setdefault(l, torch.full((spec.num_experts,), -1, dtype=torch.int32))
    return HybridExperts(pools, host, cpu, upload_threshold, spec.max_tokens, upload_all=upload_all)


def inner(backend):
    """The HybridExperts inside the runner's graph wrapper (or the backend itself)."""
    return getattr(backend, "hybrid", backend)


def offload_threshold(backend) -> int | None:
    """Passes of at least this many tokens take the backend's upload path (None: none has one)."""
    h = inner(backend)
    return h.upload_threshold if isinstance(h, HybridExperts) else getattr(h, "offload_threshold", None)


def set_offload_threshold(backend, n: int) -> None:
    h = inner(backend)
    if isinstance(h, HybridExperts):
        h.upload_threshold = n
    else:
        h.offload_threshold = n


def close_backend(backend) -> None:
    """Stop a backend's threads and return its page-locked host memory."""
    if backend is None:
        return
    close = getattr(backend, "close", None)
    if callable(close):
        close()
    h = inner(backend)
    if isinstance(h, HybridExperts):
        if h.cpu is not None:
            h.cpu.close()
        unpin(h.host)


def resident_experts(backend) -> int:
    """Experts a backend keeps on the GPU for reuse across passes (resident or cached)."""
    own = getattr(backend, "resident_experts", None)
    return own() if callable(own) else inner(backend).pools.num_hot
