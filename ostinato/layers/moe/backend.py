"""The experts backend as the runner sees it: the model's call (models/common.py RoutedBlock), for
one chunk or for every chunk of a pass at once (`many`), the hooks the runner, the decode graphs
and a split model's devices call around passes, and what its owners ask of it (a report, a
threshold to tune, its end).

Every backend (the reference, the hybrid and its graph wrapper, the caches, a split model's
set of per-device backends) derives from MoEBackend, so a hook it does not need is the no-op
here and the callers call each hook directly; a wrapper answers for what it wraps, and hands
`many` on whole (wrappers outside this hierarchy, planner/profile.py's and engine/routes.py's
counters, do too).

Legend: T tokens, K top-k, D hidden.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ostinato.layers.moe.types import TopKOutput


class StepRows(NamedTuple):
    """The real rows of a prefill pass captured as a graph and padded to its B rows (engine/graph.py
    PassGraphs), on the device: what its replays may change without a new capture."""

    count: torch.Tensor  # [1] int32: n, the pass's tokens (the first n rows)
    valid: torch.Tensor  # [B] bool: row < n


class MoEBackend:
    capturable = False  # a decode step through it may be captured as one CUDA graph as it is
    segmented = False  # or as graph segments it cuts where it needs the host (engine/graph.py GraphChain)
    device: torch.device | None = None
    layer_devices: list[str] | None = None  # each decoder layer's device, where it spans several (engine/devices.py)
    cpu = None  # the CpuExperts pool that computes its host experts, if it has one
    # passes of at least this many tokens take its upload path (None: it has none); settable, so a
    # bench can tune it (HybridExperts calls it Np, its upload_threshold)
    offload_threshold: int | None = None

    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """x [T, D], topk ids / weights [T, K] -> routing-weighted sum of the experts [T, D]."""
        raise NotImplementedError

    def many(self, layer: int, xs: list[torch.Tensor], topks: list[TopKOutput]) -> list[torch.Tensor]:
        """The chunks of one host-driven pass through a layer at once (xs [T_c, D], topks [T_c, K] each;
        engine/devices.py forward_layer_major, never inside a captured graph) -> each chunk's sum, as
        __call__ gives it. Here: __call__ on each chunk, in order. A backend that stages experts for a
        pass stages them once for all its chunks (HybridExperts.many); a wrapper hands the chunks on
        whole to what it wraps."""
        return [self(layer, x, topk) for x, topk in zip(xs, topks)]

    def captures_pass(self, T: int) -> bool:
        """Whether a prefill pass of T tokens may replay as a captured graph (engine/graph.py
        PassGraphs) and compute what the host-driven pass computes."""
        return False

    def graph_rows(self, rows: int) -> int:
        """Of the `rows` a runner would capture prefill passes up to (engine/graph.py pass_rows), the most
        this backend's kernels run inside a CUDA graph."""
        return rows

    def before_prefill(self) -> None:
        """Before a pass of more than one token (borrowed slots go back to the upload path)."""

    def after_decode_step(self) -> None:
        """After every decode step: a token boundary."""

    def settle(self) -> None:
        """Before a decode graph replays: no CPU call of an earlier pass may still hold the CPU pool
        the graph's worker takes (a split layer's deferred combine, layers/moe/hybrid.py)."""

    def before_step(self, rows: StepRows | None = None) -> None:
        """The first thing of a graph step (captured into it): a decode step, or with `rows` a
        prefill pass of several rows."""

    def after_step(self) -> None:
        """Once a graph step is recorded or run."""

    def before_capture(self) -> None:
        """Before the warm-up steps of a capture (token 0 at position 0: not decode)."""

    def after_capture(self) -> None:
        """Once the warm-up steps of a capture are done (they were not decode)."""

    def stats(self) -> dict[str, float]:
        """Cumulative placement counters (routes, cold routes, CPU experts, bytes uploaded, ...)."""
        return {}

    def resident_experts(self) -> int:
        """Experts it keeps on the GPU for reuse across passes (resident or cached)."""
        return 0

    @property
    def unwrapped(self) -> "MoEBackend":
        """The backend that holds the placement: itself, or the one a wrapper (the decode graph's
        handshake, layers/moe/graph_hybrid.py) hands its passes to."""
        return self

    def close(self) -> None:
        """Stop its threads and return its page-locked host memory (a wrapper: what it wraps too);
        after this it serves no pass."""


class CallableBackend(MoEBackend):
    """A function (layer, x, topk) -> sum as a backend (a measurement's forced routing, a profiler's
    marks around the runner's backend): a pass of several chunks calls it once a chunk (MoEBackend.many)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        return self.fn(layer, x, topk)
