"""The experts backend as the runner sees it: the model's one call (models/qwen3_moe.py) and the
hooks the runner, the decode graphs and a split model's devices call around passes.

Every backend (the reference, the hybrid and its graph wrapper, the caches, a split model's
set of per-device backends) derives from MoEBackend, so a hook it does not need is the no-op
here and the callers call each hook directly.

Legend: T tokens, K top-k, D hidden.
"""
from __future__ import annotations

import torch

from ostinato.layers.moe.types import TopKOutput


class MoEBackend:
    capturable = False  # a decode step through it may be captured as one CUDA graph as it is
    segmented = False  # or as graph segments it cuts where it needs the host (engine/graph.py GraphChain)
    device: torch.device | None = None

    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """x [T, D], topk ids / weights [T, K] -> routing-weighted sum of the experts [T, D]."""
        raise NotImplementedError

    def before_prefill(self) -> None:
        """Before a pass of more than one token (borrowed slots go back to the upload path)."""

    def after_decode_step(self) -> None:
        """After every decode step: a token boundary."""

    def before_step(self) -> None:
        """The first thing of a graph decode step (captured into it)."""

    def after_step(self) -> None:
        """Once a graph decode step is recorded or run."""

    def before_capture(self) -> None:
        """Before the warm-up steps of a capture (token 0 at position 0: not decode)."""

    def after_capture(self) -> None:
        """Once the warm-up steps of a capture are done (they were not decode)."""

    def stats(self) -> dict[str, float]:
        """Cumulative placement counters (routes, cold routes, CPU experts, bytes uploaded, ...)."""
        return {}

    def close(self) -> None:
        """Stop its threads; after this it serves no pass."""
