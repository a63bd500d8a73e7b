"""The clock every calibration measurement reads, the fits they share, and the GPU branch
they time (HybridExperts.split_path's, alone)."""
from __future__ import annotations

import itertools
import statistics
import time

import torch


class Clock:
    """Host wall time (with the device synchronised around it) or device time (CUDA events)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def wall(self, fn) -> float:
        """ms from the call to the device being idle again."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return 1e3 * (time.perf_counter() - t0)

    def host(self, fn) -> float:
        """ms until fn returns on the host (work it enqueued may still run)."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        ms = 1e3 * (time.perf_counter() - t0)
        self.sync()
        return ms

    def both(self, fn) -> tuple[float, float]:
        """(ms until fn returns on the host, ms until the device is idle again)."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        self.sync()
        return 1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t0)

    def graphed(self, fn, reps: int = 20) -> float:
        """ms of one fn as a captured CUDA graph replays it: fn captured reps times in one
        graph, timed by events (no launch gaps: what fn costs inside a decode graph). The
        wall clock of one call on a CPU-only machine."""
        if not self.cuda:
            return self.wall(fn)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up (Triton compiles, allocator pools) outside the capture
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        ms = self.device(g.replay) / reps
        del g
        return ms

    def device(self, fn) -> float:
        if not self.cuda:
            return self.wall(fn)
        self.sync()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)


def gpu_branch(h, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slots=None):
    """The GPU branch of HybridExperts h in one layer: the pool's slots for ids (or `slots`), fp32."""
    pool = h.pools.of(layer)
    slots = pool.slots_for(layer, ids) if slots is None else slots
    return pool.forward(x, slots, weights, out_dtype=torch.float32)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = alpha + beta x, beta clipped at 0 (one distinct x: the mean, beta 0)."""
    if not points:
        return 0.0, 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    beta = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
    beta = max(beta, 0.0)
    return my - beta * mx, beta


def nnls(rows: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative least squares for a handful of columns: the best non-negative subset fit."""
    A, b = torch.tensor(rows, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)[:, None]
    best, best_err = [0.0] * A.shape[1], float((b**2).sum())
    for k in range(1, A.shape[1] + 1):
        for cols in itertools.combinations(range(A.shape[1]), k):
            sol = torch.linalg.lstsq(A[:, cols], b).solution.flatten()
            if (sol < 0).any():
                continue
            err = float(((A[:, cols] @ sol[:, None] - b) ** 2).sum())
            if err < best_err - 1e-15:
                best, best_err = [0.0] * A.shape[1], err
                for c, v in zip(cols, sol.tolist()):
                    best[c] = v
    return best
