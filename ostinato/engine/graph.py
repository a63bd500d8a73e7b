"""Decode as one CUDA graph per GPU: a whole decode step captured once per cache window,
replayed for every token.

At batch 1 a decode step does little work per layer, so launching ~70 kernels a layer from
Python costs more than the work (measured on the H200: 67 ms a step eager, all experts on
the GPU). The step is captured with its inputs in static device buffers: the token id and
its position. Attention reads the position from the device and attends over a fixed
window of the cache (masked beyond the token), so one graph serves every position inside
its window; windows double in size up to the context, and a step uses the smallest that
holds it. The experts backend must itself be capturable (no host sync): the all-GPU pool
path, or the hybrid backend with the mapped-memory handshake to the native CPU worker.

A cache (policies/caches.py) must read each layer's routing on the host before it can say
where the layer's experts are, as llama.cpp's expert cache does. Its step is captured as a
`GraphChain`: the backend cuts the capture at each MoE layer (routing copied to page-locked
memory at the end of one graph, the experts' GPU branch at the start of the next), and a
replay runs the graphs in order with the backend's host work between them. All the GPU work
of a step stays captured; the host work per layer is one sync, the cache's decision and
its uploads.

A model split across devices (engine/devices.py) is captured as one graph per device and
window: a `Stage` per segment (its contiguous layers; the first also embeds the token and
computes cos/sin, the last also runs the norm and lm_head), each with static inputs on its
device. A replay is host-driven: one launch per device, in order, with the previous stage's
outputs (hidden state, cos, sin) copied into the next stage's inputs between them; torch's
cross-device copy orders it after the producer's stream and before the consumer's. A
one-device model is the one-stage case. The eager step through the same buffers (`run`)
is the warm-up before capture.

A short prefill pass (a turn's new tokens after a tool output, say) is as host-bound: a 16-token
pass of the Q4_K_M 30B shape took 76 ms on the H100 machine, of which the GPU was busy 19 ms and
the host launched, synchronised and ran Python the rest (results/2026-12-05-h100-s33/prefill/).
On one device, `PassGraphs` captures such passes too, one graph per size B (powers of two): the
pass's n tokens padded to B rows, its first position and n in static device buffers, attention
over the whole cache (token t over rows 0..position + t), the split layers' CPU branch through
the same handshake and worker as decode (its rows, layers/moe/graph_hybrid.py), and the logits of
row n - 1. Rows past n are padding: their keys lie past every real token's (never attended), the
worker never computes their routes, the counters skip them. A pass replays its graph only where
the backend would run it split without uploads in every layer (MoEBackend.captures_pass), so the
graph computes what the host-driven pass computes, or, where the backend's captured passes stage
their most-routed cold experts themselves (layers/moe/staging.py), where the host-driven pass would
upload some; and only where the cache holds its B rows.

Legend: V vocabulary, W window (cache positions attended), D hidden, Hd head dim, B rows of a
captured pass.
"""
from __future__ import annotations

import contextlib

import torch

from ostinato.config import env_count
from ostinato.engine.devices import Segment, backend_of, device_scope
from ostinato.layers.moe.backend import MoEBackend, StepRows
from ostinato.models.common import DecodeWindow


def window_sizes(max_context: int, smallest: int = 1024) -> list[int]:
    sizes, w = [], smallest
    while w < max_context:
        sizes.append(w)
        w *= 2
    return sizes + [max_context]


class GraphChain:
    """A decode step captured as a sequence of graphs sharing one memory pool. The experts
    backend calls `cut(between)` during the capture: the graph so far ends and the next
    begins; at replay `between()` runs on the host after the graph before it was launched
    (it synchronises itself when it needs the results). Graphs of one pool replay in the
    order they were captured, as sharing the pool requires."""

    def __init__(self, pool):
        self.pool = pool
        self.parts: list[tuple[torch.cuda.CUDAGraph, object]] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def cut(self, between) -> None:
        self._graph.capture_end()
        self.parts.append((self._graph, between))
        self.begin()

    def end(self) -> None:
        self._graph.capture_end()
        self.parts.append((self._graph, None))
        self._graph = None

    def replay(self) -> None:
        for graph, between in self.parts:
            graph.replay()
            if between is not None:
                between()


class Stage:
    """One segment of the decode step on its device: static inputs (the token for the first,
    x [1, D] and cos, sin [1, Hd] copied from the previous stage otherwise; the position for
    all), and per window its DecodeWindow, graph and outputs ((x, cos, sin), or (logits [V],)
    for the last)."""

    def __init__(self, model, kv: list, seg: Segment, backend, host_rows: torch.Tensor | None = None,
                 side: torch.cuda.Stream | None = None):
        """host_rows: the embedding table in pinned host memory (first stage only): each step's
        row is copied into a static input before the replay, instead of a lookup in the graph;
        side: the stream of its warm-up and capture (the runner's, runner.side_stream)."""
        self.model, self.kv, self.seg = model, kv, seg
        dev = self.device = seg.device
        self.cuda = dev.type == "cuda"
        # the segment's own backend (none on a device without MoE layers): its before_step() is the
        # first thing of the graph (the handshake's sequence bump), after_step() once it ran
        self.backend = backend if backend is not None else MoEBackend()
        self.token = torch.zeros(1, dtype=torch.long, device=dev) if seg.first else None
        self.host_rows = host_rows if seg.first else None
        self.row = (torch.zeros((1, host_rows.shape[1]), dtype=host_rows.dtype, device=dev)
                    if self.host_rows is not None else None)
        self.position = torch.zeros(1, dtype=torch.long, device=dev)
        self.inputs: tuple[torch.Tensor, ...] = ()  # allocated at the first hand-off
        self.windows: dict[int, DecodeWindow] = {}  # kept alive: the graphs read their buffers
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.side = side  # warm-up and capture (None off CUDA)
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None  # this device's graphs

    def window(self, size: int) -> DecodeWindow:
        if size not in self.windows:
            self.windows[size] = DecodeWindow(self.position, size)
        return self.windows[size]

    def load(self, token: int, position: int, prev: tuple[torch.Tensor, ...]) -> None:
        """Set the static inputs of a step; prev: the previous stage's outputs (another device)."""
        if self.token is not None:
            self.token.fill_(token)
        if self.row is not None:  # from pinned memory, in stream order before the replay that reads it
            self.row.copy_(self.host_rows[token:token + 1], non_blocking=True)
        self.position.fill_(position)
        if prev and not self.inputs:
            self.inputs = tuple(torch.zeros_like(t, device=self.device) for t in prev)
        for dst, src in zip(self.inputs, prev):
            dst.copy_(src, non_blocking=True)  # device to device: after src's producer, before dst's consumer

    def step(self, window: DecodeWindow) -> tuple[torch.Tensor, ...]:
        """The stage's part of a decode step: what is captured (the same modules in the same
        order as the eager pass, devices.forward_split / the model's forward)."""
        self.backend.before_step()
        model, seg = self.model, self.seg
        try:
            if seg.first:
                x, cos, sin = model.embed(self.token, self.position, 0, window, self.row)
            else:
                window.refresh()
                x, cos, sin = self.inputs
            x = model.run_layers(seg.layers, x, cos, sin, self.kv, 0, window)
            if seg.last:
                return (model.logits(model.model.norm(x))[0],)  # [V] fp32
            return x, cos, sin
        finally:
            self.backend.after_step()

    @contextlib.contextmanager
    def eagerly(self):
        """Eager work on the side stream (after the current stream's), finished on leaving:
        stages never overlap, so the CPU pool shared by every device's worker has one
        submitter at a time."""
        if not self.cuda:
            yield
            return
        with device_scope(self.device):
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                yield
            torch.cuda.current_stream().wait_stream(self.side)
            torch.cuda.synchronize()

    def run(self, size: int, token: int, position: int, prev: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        with self.eagerly():
            self.load(token, position, prev)
            return self.step(self.window(size))

    def capture(self, size: int) -> None:
        with device_scope(self.device):
            if not self.backend.segmented:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.side):
                    out = self.step(self.window(size))
                self.graphs[size] = (graph, out)
                return
            torch.cuda.synchronize()
            chain = GraphChain(self.pool)
            self.backend.chain = chain  # the backend cuts the capture where it needs the host
            try:
                with torch.cuda.stream(self.side):
                    chain.begin()
                    out = self.step(self.window(size))
                    chain.end()
            finally:
                self.backend.chain = None
            self.graphs[size] = (chain, out)

    def replay(self, size: int, token: int, position: int, prev: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        graph, out = self.graphs[size]  # a CUDAGraph or a GraphChain
        with device_scope(self.device):
            self.load(token, position, prev)
            graph.replay()  # on the device's current stream
        return out


class DecodeGraphs:
    def __init__(self, runner, smallest_window: int = 1024):
        """One stage per segment of the runner's layers (runner.segments), each with the hooks
        of the backend that serves its layers."""
        model, kv = runner.model, runner.kv.layers
        self.stages = [Stage(model, kv, seg, backend_of(runner.experts, seg), runner.host_rows,
                             runner.side_stream(seg.device) if seg.device.type == "cuda" else None)
                       for seg in runner.segments]
        self.sizes = window_sizes(runner.max_context, smallest_window)
        # the next step's first stage waits for the last stage of the step before (split only)
        self.step_done = torch.cuda.Event() if len(self.stages) > 1 and self.stages[0].cuda else None

    def _run(self, size: int, token: int, position: int) -> torch.Tensor:
        out: tuple[torch.Tensor, ...] = ()
        for stage in self.stages:
            out = stage.run(size, token, position, out)
        return out[0]

    @torch.inference_mode()
    def run(self, token: int, position: int) -> torch.Tensor:
        """Logits [V] of `token` at `position`, stepped eagerly through the static buffers and
        hand-offs (the warm-up; and on a CPU, where nothing is captured, the check of them)."""
        return self._run(self.window_for(position), token, position)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every window's step on every device (before any request: warm-up steps
        write KV slot 0). Warm-up runs eagerly first (Triton compiles, allocators settle)."""
        for stage in self.stages:
            stage.backend.before_capture()
        for size in self.sizes:
            for _ in range(2):
                self._run(size, 0, 0)
            for stage in self.stages:
                stage.capture(size)
        for stage in self.stages:
            with device_scope(stage.device):
                torch.cuda.synchronize()
            stage.backend.after_capture()

    def window_for(self, position: int) -> int | None:
        return next((s for s in self.sizes if position < s), None)

    def replay(self, token: int, position: int) -> torch.Tensor:
        """Logits [V] of `token` at `position` (its KV is written at that position), a static
        buffer on the last device."""
        size = self.window_for(position)
        first, last = self.stages[0], self.stages[-1]
        if self.step_done is not None:
            torch.cuda.current_stream(first.device).wait_event(self.step_done)
        out: tuple[torch.Tensor, ...] = ()
        for stage in self.stages:
            out = stage.replay(size, token, position, out)
        if self.step_done is not None:
            self.step_done.record(torch.cuda.current_stream(last.device))
        return out[0]


DEFAULT_PASS_ROWS = 256
STAGED_PASS_ROWS = 511


def env_pass_rows() -> int:
    """The most tokens a captured prefill pass holds (PassGraphs): OSTINATO_PASS_GRAPHS (0: none), else
    STAGED_PASS_ROWS where captured passes stage their cold experts (layers/moe/staging.py, on by
    default), DEFAULT_PASS_ROWS where they do not.

    Why 256 without staging (results/2026-12-06-h100-s38/, the Q4_K_M 30B shape under 12 GiB on an
    H100, after a 4096-token context, with the copy join of kernels/triton/handshake.py): replayed, a
    pass of 8 / 32 / 64 / 128 / 255 tokens took 23.3 / 52.8 / 88.9 / 142.6 / 262.7 ms against 89.6 /
    124.2 / 140.0 / 154.3 / 284.1 ms host-driven. In two held-out replays against three with graphs up to
    32 rows, the turns of 1-63, 64-127 and 128-255 new tokens took 0.53-0.62x, 0.68-0.86x and 0.81-0.96x
    as long (sums of TTFT by band), the larger ones as long.

    Why 512 with staging (results/2026-12-06-h100-s40/, the same shape): the turns of 256-511 new tokens
    then replay too, each moving its own most-routed cold experts. In three held-out replays the median
    TTFT after tool outputs was 143-147 ms against 161 with 256 rows (and 170-181 unstaged); the larger
    graphs' memory left 2593 experts resident instead of 2669, and TPOT (8.17-8.53 ms) did not move.
    511, not the 512 measured: a 512-row pass took quantized experts' dequantized path under the default
    tuning of then (from 512 tokens), whose scratch the capacity test then counts once more for the graphs'
    own memory pool: about 200 MB of the 215 MB that the 512 rows cost the 30B shape above, some 70 experts.
    A 512-token pass runs host-driven. Where a device's tuning takes that path (layers/moe/gpu_quant.py
    dequant_min_tokens; since session 58 no default does, and neither tuned file), a larger setting over
    quantized experts captures no pass it would serve: that path finds a pass's distinct experts on the
    host, which a graph cannot hold (session 46's OSTINATO_PASS_GRAPHS=1023 stopped the bench with a capture
    error); the runner caps it there (ModelRunner.pass_graph_rows), while the capacity test, which does not
    know the device's tuning, counts the setting. Captured passes of 512 rows and more without that path
    have not been measured."""
    from ostinato.layers.moe.staging import stages

    default = STAGED_PASS_ROWS if stages() else DEFAULT_PASS_ROWS
    return env_count("OSTINATO_PASS_GRAPHS", default, "tokens")


def pass_rows(setting: int | None, split: bool, max_context: int) -> int:
    """The most tokens of a prefill pass captured as a graph (0: none): the setting (None: env_pass_rows's
    count), at most max_context; none on a model split over devices (split), whose backends capture decode
    steps only. The runner's count (ModelRunner.pass_graph_rows) and the capacity test's
    (planner/capacity.py pass_graph_bytes)."""
    if split:
        return 0
    return min(setting if setting is not None else env_pass_rows(), max_context)


def env_pass_midpoints() -> int:
    """OSTINATO_PASS_MIDPOINTS: the fewest rows of a captured pass size whose doubling also gets its midpoint
    (pass_sizes; 0: none, the default). A pass replays at the next captured size, and its padding rows
    still run the dense layers and attention: in session 45's held-out replay (results/2026-12-06-h200-s45/,
    the Q4_K_M 30B shape under 12 GiB), tool turns of 253 new tokens, in the 256-row graph, took 89.8-92.4 ms
    and those of 269-339, padded to 511, 100.4-116.0 ms. 128 adds 192 and 383: smaller ones share the
    largest's memory pool (planner/capacity.py pass_graph_bytes counts the largest alone)."""
    return env_count("OSTINATO_PASS_MIDPOINTS", 0, "rows")


def pass_sizes(largest: int, smallest: int = 8, midpoints: int | None = None) -> list[int]:
    """The row counts passes are captured at: doubling from `smallest` up to `largest` (itself the
    last), as decode windows double (window_sizes), and the midpoint of each doubling from a size of at
    least `midpoints` rows on (None: env_pass_midpoints; 0: none); none below 2."""
    sizes = window_sizes(largest, smallest) if largest >= 2 else []
    m = env_pass_midpoints() if midpoints is None else midpoints
    mids = [(a + b) // 2 for a, b in zip(sizes, sizes[1:]) if m and a >= m and b - a > 1]
    return sorted(sizes + mids)


class PassGraphs:
    """Short prefill passes of a one-device runner as CUDA graphs, one per size (module docstring)."""

    def __init__(self, runner, sizes: list[int]):
        self.model, self.kv, self.backend = runner.model, runner.kv.layers, runner.experts
        self.tally = runner.routes
        self.device = dev = runner.device
        cuda = dev.type == "cuda"
        self.side = runner.side_stream(dev) if cuda else None  # warm-up and capture
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        self.max_context, self.host_rows = runner.max_context, runner.host_rows
        self.sizes = sorted(sizes)
        self.position = torch.zeros(1, dtype=torch.long, device=dev)
        self.count = torch.zeros(1, dtype=torch.int32, device=dev)  # n, the pass's tokens
        D = self.model.config.hidden_size
        self.tokens = {B: torch.zeros(B, dtype=torch.long, device=dev) for B in self.sizes}
        self.rows = ({B: torch.zeros((B, D), dtype=self.host_rows.dtype, device=dev) for B in self.sizes}
                     if self.host_rows is not None else None)
        self.windows = {B: DecodeWindow(self.position, self.max_context, B) for B in self.sizes}
        self.aranges = {B: torch.arange(B, device=dev) for B in self.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def size_for(self, T: int, start: int) -> int | None:
        """The size a pass of T tokens at `start` replays at, or None (host-driven)."""
        if not self.backend.captures_pass(T):
            return None
        return next((B for B in self.sizes if T <= B and start + B <= self.max_context), None)

    def _load(self, B: int, tokens: list[int], start: int) -> None:
        ids = torch.zeros(B, dtype=torch.long)  # pageable: the copy is made before this returns
        ids[:len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        if self.rows is not None:
            self.rows[B].copy_(self.host_rows[ids], non_blocking=True)
        else:
            self.tokens[B].copy_(ids, non_blocking=True)
        self.position.fill_(start)
        self.count.fill_(len(tokens))

    def _step(self, B: int) -> torch.Tensor:
        """The captured pass: the same modules in the same order as the host-driven one; logits [V] of
        row n - 1."""
        rows = StepRows(self.count, self.aranges[B] < self.count)
        self.backend.before_step(rows)
        if self.tally is not None:
            self.tally.rows = rows
        try:
            window, model = self.windows[B], self.model
            emb = self.rows[B] if self.rows is not None else None
            x, cos, sin = model.embed(self.tokens[B], window.position, 0, window, emb)
            x = model.run_layers(range(len(model.model.layers)), x, cos, sin, self.kv, 0, window)
            last = x.index_select(0, (self.count - 1).long())  # [1, D]
            return model.logits(model.model.norm(last))[0]
        finally:
            self.backend.after_step()
            if self.tally is not None:
                self.tally.rows = None

    @torch.inference_mode()
    def run(self, B: int, tokens: list[int], start: int) -> torch.Tensor:
        """The pass stepped eagerly through size B's static buffers (the warm-up; on a CPU, where
        nothing is captured, the check of them): logits [V] of its last token."""
        self._load(B, tokens, start)
        return self._step(B)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (Triton compiles, allocators settle) and capture every size, before any request:
        the warm-up passes write cache rows 0..B-1."""
        with device_scope(self.device):
            for B in self.sizes:
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    for _ in range(2):
                        self.run(B, [0] * B, 0)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.side):
                    out = self._step(B)
                self.graphs[B] = (graph, out)
            torch.cuda.synchronize()

    def replay(self, B: int, tokens: list[int], start: int) -> torch.Tensor:
        """Logits [V] of the pass's last token (its KV written at start..start + T - 1), a static
        buffer."""
        graph, out = self.graphs[B]
        with device_scope(self.device):
            self._load(B, tokens, start)
            graph.replay()
        if self.tally is not None:
            self.tally.count_pass(len(tokens))
        return out
