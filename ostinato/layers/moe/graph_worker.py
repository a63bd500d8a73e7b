"""The CPU half of the decode graph's handshake (DESIGN.md, "Decode as one CUDA graph per GPU").

A decode step replays as one CUDA graph; every MoE layer's cold routes are served by a native
thread that polls flags in page-locked, device-mapped host memory, so the step needs no host
launch, callback or Python per layer. The trade-off: one core spins while steps run.

`GraphHandshake` allocates the shared buffers once (pinned where CUDA is available); the
captured graph writes routing and activations, then post_flag, and waits on done_flag.
`GraphWorker` runs the native worker (ostinato/kernels/cpu/graph_worker.h has the full
protocol) on the CpuExperts pool with the same kernel as the synchronous path, so its results
are bitwise those of CpuExperts.forward on the same routes; layers of quantized experts
(QuantExpertWeights) carry their block formats in their native arguments and run the
quantized kernels there too.

Legend: L MoE layers in execution order, T the most tokens one step posts (1: decode only; a short
prefill pass captured as a graph posts up to T), K top-k, D hidden, E experts per layer.
Flags are int32 at column 0 of [L, FLAG_STRIDE] tensors: one 64-byte line per layer.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ostinato.layers.moe.cpu_experts import CpuExperts

FLAG_STRIDE = 16  # int32 elements: 64 bytes
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class GraphHandshake:
    """Buffers shared by the captured steps and the worker; seq counts steps from 1 (decode steps
    and captured prefill passes alike)."""

    def __init__(self, num_layers: int, top_k: int, hidden: int, x_dtype: torch.dtype = torch.bfloat16,
                 pin: bool | None = None, tokens: int = 1, staged_experts: int = 0):
        """tokens: the most rows a step posts; staged_experts: E, where captured passes stage (staging.py):
        the [L, E] marks of the experts a pass computes on the GPU (0: none shared)."""
        if x_dtype not in _DTYPES:
            raise ValueError(f"x_dtype must be bf16 or fp32, not {x_dtype}")
        pin = torch.cuda.is_available() if pin is None else pin
        L, K, D, T = num_layers, top_k, hidden, tokens
        if T < 1:
            raise ValueError(f"tokens must be at least 1, not {T}")

        def buf(shape, dtype):
            t = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            assert t.data_ptr() % 64 == 0, "shared buffers must start on a cache line"
            return t

        self.post_flag = buf((L, FLAG_STRIDE), torch.int32)  # [L, 16] GPU -> CPU: seq published
        self.has_cold = buf((L, FLAG_STRIDE), torch.int32)  # [L, 16] GPU -> CPU: 0, or seq
        self.done_flag = buf((L, FLAG_STRIDE), torch.int32)  # [L, 16] CPU -> GPU: seq answered
        self.tokens = buf((L, FLAG_STRIDE), torch.int32)  # [L, 16] GPU -> CPU: the step's tokens n
        self.ids = buf((L, T, K), torch.int32)  # [L, T, K] routed expert ids, top-k order
        self.weights = buf((L, T, K), torch.float32)  # [L, T, K]
        self.x = buf((L, T, D), x_dtype)  # [L, T, D] the tokens' activations entering each MoE
        self.out = buf((L, T, D), torch.float32)  # [L, T, D] CPU partial: cold routes' weighted sum
        # [L, E] GPU -> CPU: 1 for the experts a captured pass computes on the GPU, written before post_flag
        self.staged = buf((L, staged_experts), torch.uint8) if staged_experts and T > 1 else None
        self.tokens.fill_(1)
        self.num_layers, self.top_k, self.hidden, self.max_tokens, self.pinned = L, K, D, T, pin

    def clear_flags(self) -> None:
        """Zero the flags (only while no step is in flight), e.g. before seq starts over."""
        for t in (self.post_flag, self.has_cold, self.done_flag):
            t.zero_()

    def native(self, ext):
        s = ext.GraphShared()
        s.post_flag, s.has_cold, s.done_flag = (t.data_ptr() for t in (self.post_flag, self.has_cold, self.done_flag))
        s.ids, s.weights, s.x, s.out = (t.data_ptr() for t in (self.ids, self.weights, self.x, self.out))
        s.tokens = self.tokens.data_ptr()
        s.staged = self.staged.data_ptr() if self.staged is not None else 0
        s.x_dtype, s.flag_stride = _DTYPES[self.x.dtype], FLAG_STRIDE
        s.L, s.K, s.D, s.T = self.num_layers, self.top_k, self.hidden, self.max_tokens
        return s


class GraphWorker:
    """The native polling worker serving the cold routes of every MoE layer of a decode step.

    compact_tables: {model layer: int32 [E]} cold expert -> index in that layer's host stack
    (-1 hot), e.g. HostExperts.compact; layer_order: model layer ids in execution order
    (position i of the handshake); a layer without a table is all hot. core: the CPU to pin
    the worker to (the thread layout's poller core, ostinato/threads.py; -1 unpinned).

    The worker shares the CpuExperts pool: while decode steps run it is the pool's only
    submitter. Use cpu_experts synchronously (prefill) only between steps, then call
    reset(next_seq), which also orders that use before the worker's next one.
    """

    def __init__(self, handshake: GraphHandshake, cpu_experts: CpuExperts,
                 compact_tables: Mapping[int, torch.Tensor], layer_order: Sequence[int], core: int = -1,
                 *, spin_us: int = 2000, sleep_us: int = 20, idle_sleep_us: int = 1000):
        if cpu_experts._native is None:
            raise RuntimeError("the graph worker needs the native CPU experts, not the "
                               f"{cpu_experts.backend!r} backend ({cpu_experts.fallback_reason or 'asked for'})")
        if len(layer_order) != handshake.num_layers:
            raise ValueError(f"layer_order has {len(layer_order)} layers, the handshake {handshake.num_layers}")
        if not compact_tables:
            raise ValueError("compact_tables is empty: the worker needs E from a table")
        from ostinato.kernels.cpu.build import load_cpu_extension

        ext = load_cpu_extension()
        self.handshake, self.cpu_experts = handshake, cpu_experts
        self.position = {int(layer): i for i, layer in enumerate(layer_order)}
        self.num_experts = next(iter(compact_tables.values())).numel()
        if handshake.staged is not None and handshake.staged.shape[1] != self.num_experts:
            raise ValueError(f"the handshake stages {handshake.staged.shape[1]} experts a layer, the tables have "
                             f"{self.num_experts}")
        args = [cpu_experts._args.get(int(layer)) or ext.ColdArgs() for layer in layer_order]  # E = 0: no host stack
        opts = ext.GraphWorkerOptions()
        opts.cpu = int(core)
        opts.spin_us, opts.sleep_us, opts.idle_sleep_us = int(spin_us), int(sleep_us), int(idle_sleep_us)
        self._native = ext.GraphWorker(cpu_experts._native, handshake.native(ext), args, self.num_experts, opts)
        self.core = opts.cpu
        for layer, table in compact_tables.items():
            if int(layer) in self.position:
                self.set_compact(int(layer), table)

    def set_compact(self, layer: int, table: torch.Tensor, at_seq: int = 0) -> None:
        """Layer's table from step at_seq (0: the next step the worker begins); copied.
        Switch the GPU's device table for the same step."""
        t = table.to("cpu", torch.int32).contiguous()
        if t.shape != (self.num_experts,):
            raise ValueError(f"layer {layer}: table must have {self.num_experts} entries, got {tuple(table.shape)}")
        self._native.set_compact(self.position[int(layer)], t.data_ptr(), int(at_seq))

    def active_table(self, layer: int) -> torch.Tensor:
        return torch.tensor(self._native.active_table(self.position[int(layer)]), dtype=torch.int32)

    def start(self, first_seq: int = 1) -> None:
        self._native.start(int(first_seq))

    def stop(self) -> None:
        """Joins the worker; returns promptly even if the GPU never posts."""
        self._native.stop()

    def reset(self, seq: int) -> None:
        """Abandon the step in progress and expect step seq at layer 0 (after a prefill).
        seq must be newer than any flag in the buffers, or clear_flags() first."""
        self._native.reset(int(seq))

    @property
    def running(self) -> bool:
        return self._native.running()

    # what stats() counts since the worker started (a difference of two reads says what happened
    # between them); the rest are the state of the moment: the last step's figures, the means
    COUNTERS = ("steps", "layers_served", "layers_skipped", "cold_routes", "cold_experts", "staged_experts",
                "staged_routes", "desync", "bad_ids", "bad_tokens", "resyncs", "errors", "wait_ns", "idle_ns",
                "compute_ns")

    def stats(self) -> dict:
        """Native counters (COUNTERS) and state (the step in progress, the last step's figures), plus
        per-step means in microseconds: wait_us (the CPU waiting for the GPU inside a step) and
        compute_us (post seen -> done stored, summed)."""
        s = self._native.stats()
        steps = max(1, s["steps"])
        s["wait_us_per_step"] = s["wait_ns"] / steps / 1e3
        s["compute_us_per_step"] = s["compute_ns"] / steps / 1e3
        s["last_error"] = self._native.last_error()
        return s

    def __del__(self):  # join before the shared buffers can be freed
        native = getattr(self, "_native", None)
        if native is not None:
            native.stop()
