"""The model runner: the only owner of devices, memory and the experts placement.

It materialises the dense model on the compute device, plugs an experts backend into
the model's MoE blocks (all on one device by default; hybrid or a baseline policy when
given one), owns the KV cache and runs forward passes, chunked for long prompts. With
several devices (`devices`, or a residency planned for several) each layer and its KV
cache live on their own device and the runner drives the loop over devices (engine/devices.py);
decode is then captured as one CUDA graph per device (engine/graph.py).

Legend: T tokens of a pass, V vocabulary.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ostinato.engine import devices as split
from ostinato.engine.gpu_memory import allocator_counters
from ostinato.engine.graph import DecodeGraphs, PassGraphs, pass_rows, pass_sizes, window_sizes
from ostinato.engine.kv_cache import KVCache
from ostinato.engine.routes import RouteTally
from ostinato.kernels.triton import compiles as triton_compiles
from ostinato.threads import ThreadLayout, claim_host_thread, process_layout
from ostinato.layers.moe.graph_hybrid import for_graphs
from ostinato.layers.moe.reference import ReferenceExperts
from ostinato.loader.build import WeightFormats, build_model, load_all_experts
from ostinato.models.common import DecodeWindow


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class RunnerSettings:
    device: str | None = None  # default: cuda if present, else cpu
    dtype: str | None = None  # default: the checkpoint's (bf16 on GPU, fp32 on CPU)
    max_context: int | None = None  # default: min(16384, max_position_embeddings)
    prefill_chunk: int = 2048
    cuda_graph: bool = True  # decode as captured graphs (one per device), when the experts backend allows it
    # the most tokens of a prefill pass captured as a graph too (engine/graph.py PassGraphs; one device,
    # with cuda_graph); None: env_pass_rows (engine/graph.py)
    pass_graphs: int | None = None
    devices: str | tuple[str, ...] | None = None  # "cuda:0,cuda:1": MoE layers split across them, in order
    cpu_threads: int | None = None  # CPU expert workers; default: every physical core the layout leaves
    count_routes: bool = False  # tally every pass's routes on the device (engine/routes.py: serve learns from them)

    def thread_layout(self, layer_devices: Sequence[str] | None = None, graphs: bool = True) -> ThreadLayout:
        """The process's thread layout (ostinato/threads.py) for these devices (default: the
        settings'); graphs: the backend decodes through the graph handshake when it can."""
        gpus = [split.cuda_index(n) for n in split.gpus_in_order(list(layer_devices or self.device_names()))]
        return process_layout(gpus, graphs and self.cuda_graph and bool(gpus), self.cpu_threads)

    def context(self, cfg) -> int:
        """The KV cache's tokens: max_context, else min(16384, the model's max_position_embeddings)."""
        return self.max_context or min(16384, cfg.max_position_embeddings)

    def device_names(self) -> list[str]:
        """The devices in layer order; `device` may itself be a comma list."""
        spec = self.devices or self.device
        return split.parse_devices(spec) if spec else [str(default_device())]

    def torch_device(self) -> torch.device:
        """The (first) compute device: the embedding's."""
        if self.devices or (self.device and "," in self.device):
            return split.physical(self.device_names()[0])
        return torch.device(self.device) if self.device else default_device()

    def torch_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if self.dtype:
            return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                    "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}[self.dtype]
        # CPUs compute bf16 matmuls slowly and less exactly in torch's portable path
        return checkpoint_dtype if self.torch_device().type == "cuda" else torch.float32


class ModelRunner:
    def __init__(self, source, settings: RunnerSettings = RunnerSettings(), experts=None,
                 quantized: dict[str, str] | None = None):
        """`quantized`: the dense linear weights kept in their GGUF blocks (loader/build.py dense_formats;
        layers/quant_linear.py), else every dense weight is dequantized at load."""
        self.settings = settings
        self.config = source.config
        self.device = settings.torch_device()
        self.dtype = settings.torch_dtype(self.config.torch_dtype)
        max_context = settings.context(self.config)
        self.layer_devices = (experts.layer_devices if experts is not None else None) or \
            split.resolve_layer_devices(self.config, settings.device_names(), None, max_context, self.dtype,
                                        WeightFormats(dense=quantized or {}))  # the oracle's experts: float
        self.threads = settings.thread_layout(self.layer_devices)
        self._step_done = None  # a blocking event, where the host thread shares a poller's core
        self._sides: dict[torch.device, torch.cuda.Stream] = {}  # side_stream's
        # the routes of every pass, counted where the model calls its experts (inside graphs too)
        self.routes = RouteTally(self.config.moe_layers, self.config.num_experts,
                                 self.config.num_experts_per_tok) if settings.count_routes else None
        if self.device.type == "cuda":
            claim_host_thread(self.threads)
            triton_compiles.install()
            if self.threads.host_shares_poller:
                self._step_done = torch.cuda.Event(blocking=True)
        if self.layer_devices is not None:
            self._init_split(source, experts, max_context, quantized)
            return
        self.experts = experts if experts is not None else ReferenceExperts(
            load_all_experts(source, device=self.device, dtype=self.dtype))
        self.model = build_model(source, self.device, self.dtype, quantized)
        self.model.fuse_projections()  # where it runs: nothing moves it after this
        self._plug(self.experts)
        self.kv = KVCache(self.config, max_context, self.device, self.dtype)
        self.segments = split.segments([str(self.device)] * self.config.num_hidden_layers)
        self.graphs = self.passes = None
        if settings.cuda_graph and self.device.type == "cuda":
            self.enable_graphs()

    def _init_split(self, source, experts, max_context: int, quantized: dict[str, str] | None) -> None:
        """Layers across devices: built in host memory, then each part moved to its device (so
        no device ever holds more than its share); decode graphs per device as for one."""
        self.segments = split.segments(self.layer_devices)  # one contiguous range per device
        self.device = split.physical(self.layer_devices[0])
        self.experts = experts if experts is not None else split.split_reference(source, self.layer_devices,
                                                                                 self.dtype)
        self.model = build_model(source, "cpu", self.dtype, quantized)
        split.place_model(self.model, self.layer_devices)
        self.model.fuse_projections()
        self._plug(self.experts)
        self.kv = split.SplitKV(self.config, max_context, self.layer_devices, self.dtype)
        self.graphs = self.passes = None
        if self.settings.cuda_graph and self.device.type == "cuda":
            self.enable_graphs()

    @property
    def host_rows(self) -> torch.Tensor | None:
        """The embedding table in pinned host memory (loader/build.py host_embedding), else None."""
        w = self.model.model.embed_tokens.weight
        return w if w.device.type == "cpu" and self.device.type != "cpu" else None

    def _chunk(self, tokens: list[int], start: int) -> tuple:
        """A chunk of a pass as forward_layer_major takes it: (ids, positions, start, embedding rows or None)."""
        ids = torch.tensor(tokens, dtype=torch.long)
        rows = self.host_rows[ids].to(self.device) if self.host_rows is not None else None
        return ids.to(self.device), torch.arange(start, start + len(tokens), device=self.device), start, rows

    def _hidden(self, tokens: torch.Tensor, pos: torch.Tensor, start: int, window=None) -> torch.Tensor:
        """tokens [T] int64 in host memory, pos [T] on the device -> final hidden states [T, D]."""
        ids, host = tokens.to(self.device), self.host_rows
        rows = host[tokens].to(self.device) if host is not None else None  # only the pass's rows cross
        if self.layer_devices is None:
            return self.model(ids, pos, self.kv.layers, start, window, rows)
        return split.forward_split(self.model, self.segments, ids, pos, self.kv.layers, start, window, rows)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden).to(self.device)  # from the last device, where lm_head lives

    @contextlib.contextmanager
    def experts_swapped(self, backend):
        """Run passes through another backend for a while (profiling, calibration wrappers),
        host-driven: the captured decode graphs hold the old backend, so they are set aside
        and come back, untouched, afterwards. Their routes are not the served ones: not counted."""
        graphs, passes, experts = self.graphs, self.passes, self.experts
        self.graphs = self.passes = None
        self.model.set_experts(backend)
        try:
            yield
        finally:
            self._plug(experts)
            self.graphs, self.passes = graphs, passes

    def _plug(self, backend) -> None:
        """The backend the model's MoE blocks call: the runner's, counted when routes are tallied."""
        self.model.set_experts(self.routes.wrap(backend) if self.routes is not None and backend is not None
                               else backend)

    def set_experts(self, backend) -> None:
        """Plug another experts backend in (a baseline policy): the old decode graphs go, and
        new ones are captured when the settings ask for them and the backend allows it."""
        self.graphs = self.passes = None
        self.experts = backend
        self._plug(backend)
        if backend is not None and self.settings.cuda_graph and self.device.type == "cuda":
            self.enable_graphs()  # may wrap a HybridExperts (each device's) in its graph backend

    def pass_graph_rows(self) -> int:
        """The most tokens of a prefill pass captured as a graph (0: none; graph.pass_rows), as many as the
        experts' kernels run inside a graph (MoEBackend.graph_rows: OSTINATO_PASS_GRAPHS=1023 over Q4_K_M
        experts captures up to 511 rows where the device's tuning takes their dequantized path from 512; without
        experts yet, as a bench's engine between policies, the setting's)."""
        rows = pass_rows(self.settings.pass_graphs, self.layer_devices is not None, self.max_context)
        return self.experts.graph_rows(rows) if rows > 1 and self.experts is not None else rows

    def enable_graphs(self) -> None:
        """Capture decode steps when the placement allows it: every expert resident, or the
        hybrid placement through the mapped-memory handshake with the native CPU worker (a
        split model: each device's hybrid backend with a handshake and worker of its own), or
        a cache's step as graph segments between its per-layer host work. On one device, short
        prefill passes too where the backend captures them (PassGraphs)."""
        rows = self.pass_graph_rows()
        if isinstance(self.experts, split.SplitExperts):
            self.experts.wrap(lambda backend, name: for_graphs(backend, self.poller_core(name)))
        elif self.layer_devices is None:
            self.experts = for_graphs(self.experts, self.poller_core(str(self.device)), max(rows, 1))
        self._plug(self.experts)
        if not (self.experts.capturable or self.experts.segmented):
            return
        self.graphs = DecodeGraphs(self)
        self.graphs.capture()
        if rows > 1 and self.experts.capturable and any(self.experts.captures_pass(T) for T in (2, rows)):
            self.passes = PassGraphs(self, pass_sizes(rows))
            self.passes.capture()

    def poller_core(self, device: str) -> int:
        """The CPU of the graph poller that serves `device`'s layers (-1: none reserved)."""
        gpus = split.gpus_in_order(self.layer_devices or [str(self.device)])
        pollers = self.threads.pollers
        return pollers[gpus.index(device)] if device in gpus and gpus.index(device) < len(pollers) else -1

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The stream decode graphs warm up and capture on, one per device for the runner's life:
        a stream that runs a matmul gets a cuBLAS workspace of its own, which is never freed, so a
        new stream per capture held 32 MiB more with every policy a bench built (session 14)."""
        if device not in self._sides:
            self._sides[device] = torch.cuda.Stream(device)
        return self._sides[device]

    @property
    def max_context(self) -> int:
        return self.kv.max_tokens

    @torch.inference_mode()
    def forward(self, tokens: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        """Run tokens at positions [start, start + T), in chunks; logits of the last token [V]
        (or of every token [T, V] with all_logits)."""
        if start + len(tokens) > self.max_context:
            raise ValueError(f"{start + len(tokens)} tokens exceed the context of {self.max_context}")
        if self.device.type == "cuda":
            claim_host_thread(self.threads)
        decode = len(tokens) == 1 and not all_logits
        if not decode:
            self.experts.before_prefill()  # borrowed slots go back to the upload path first
        if decode and self.graphs is not None and self.graphs.window_for(start) is not None:
            logits = self._replayed(lambda: self.graphs.replay(tokens[0], start))
            self._after_decode_step()
            return logits
        size = self.passes.size_for(len(tokens), start) if self.passes is not None and not decode and \
            not all_logits else None
        if size is not None:
            return self._replayed(lambda: self.passes.replay(size, tokens, start))
        chunk = self.settings.prefill_chunk  # several chunks run layer by layer (devices.forward_layer_major says why)
        hidden = split.forward_layer_major(self.model, self.segments, [
            self._chunk(tokens[s:s + chunk], start + s) for s in range(0, len(tokens), chunk)], self.kv.layers)
        logits = torch.cat([self._logits(h) for h in hidden]) if all_logits else self._logits(hidden[-1][-1:])[0]
        if decode:
            self._after_decode_step()
        return logits

    def _replayed(self, replay) -> torch.Tensor:
        """A captured step or pass: the graph's worker takes the CPU pool, replay() launches it; -> its
        logits, copied from the graph's static buffer on the last device."""
        self.experts.settle()
        logits = replay().to(self.device, copy=True)
        if self._step_done is not None:  # sleep, not spin, beside the poller on its core
            self._step_done.record()
            self._step_done.synchronize()
        return logits

    def _after_decode_step(self) -> None:
        self.experts.after_decode_step()

    @torch.inference_mode()
    def decode_windowed(self, token: int, position: int) -> torch.Tensor:
        """The captured step's computation run eagerly (same attention window, same kernels):
        the synchronous reference the graph must equal bit for bit."""
        size = next(s for s in window_sizes(self.max_context) if position < s)
        pos = torch.tensor([position], device=self.device)
        hidden = self._hidden(torch.tensor([token]), pos, 0, DecodeWindow(pos, size))
        return self._logits(hidden)[0]  # experts by the synchronous path (host-driven)

    def placement_stats(self) -> dict[str, float]:
        """Cumulative counters of the experts placement (routes, cold routes, CPU experts, bytes
        uploaded, pool hits) and, on CUDA, of the allocator (gpu_memory.allocator_counters: a pass
        that met the cap retries its cudaMalloc after freeing every cached block) and of triton's
        compiles (kernels/triton: a new specialisation of a kernel's arguments), for /metrics and
        reports; empty for the all-on-one-device backend."""
        if self.experts is None:
            return {}
        return {**self.experts.stats(), **allocator_counters(s.name for s in self.segments),
                **triton_compiles.counters()}
