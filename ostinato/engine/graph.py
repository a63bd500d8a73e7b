"""Decode as one CUDA graph: a whole decode step captured once per cache window, replayed
for every token.

At batch 1 a decode step does little work per layer, so launching ~70 kernels a layer from
Python costs more than the work (measured on the H200: 67 ms a step eager, all experts on
the GPU). The step is captured with its inputs in static device buffers: the token id and
its position. Attention reads the position from the device and attends over a fixed
window of the cache (masked beyond the token), so one graph serves every position inside
its window; windows double in size up to the context, and a step uses the smallest that
holds it. The experts backend must itself be capturable (no host sync): the all-GPU pool
path, or the hybrid backend with the mapped-memory handshake to the native CPU worker.

Legend: V vocabulary, W window (cache positions attended).
"""
from __future__ import annotations

import torch

from ostinato.models.qwen3_moe import DecodeWindow


def window_sizes(max_context: int, smallest: int = 1024) -> list[int]:
    sizes, w = [], smallest
    while w < max_context:
        sizes.append(w)
        w *= 2
    return sizes + [max_context]


class DecodeGraphs:
    def __init__(self, runner, before_step=None, after_step=None, smallest_window: int = 1024):
        """before_step(): launched first in every step (e.g. the handshake's sequence bump);
        after_step(): called once the step's kernels are recorded or run."""
        self.runner = runner
        dev = runner.device
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.position = torch.zeros(1, dtype=torch.long, device=dev)
        self.before_step, self.after_step = before_step, after_step
        self.sizes = window_sizes(runner.max_context, smallest_window)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _step(self, window: DecodeWindow) -> torch.Tensor:
        if self.before_step is not None:
            self.before_step()
        model = self.runner.model
        try:
            hidden = model(self.token, self.position, self.runner.kv.layers, 0, window)
            return model.logits(hidden)[0]  # [V] fp32
        finally:
            if self.after_step is not None:
                self.after_step()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every window's step (before any request: warm-up steps write KV slot 0)."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.runner.device)
        for size in self.sizes:
            window = DecodeWindow(self.position, size)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: Triton compiles, allocator settles
                for _ in range(2):
                    self._step(window)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._step(window)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    def window_for(self, position: int) -> int | None:
        return next((s for s in self.sizes if position < s), None)

    def replay(self, token: int, position: int) -> torch.Tensor:
        """Logits [V] of `token` at `position` (its KV is written at that position)."""
        graph, logits = self.graphs[self.window_for(position)]
        self.token.fill_(token)
        self.position.fill_(position)
        graph.replay()
        return logits
