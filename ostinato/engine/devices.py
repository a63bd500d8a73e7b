"""MoE layers split across the GPUs of one host: the runner's side of it.

Each decoder layer lives on one device (contiguous ranges, engine/assign.py, planned and
stored in the residency file): its dense weights, its KV cache and the pool slots of
its hot experts. The embedding sits on the first device, the final norm and lm_head on
the last; a pass hands the hidden state (and cos/sin) to the next device at each range
boundary. Every device has its own ExpertPool and index table and its own HybridExperts
(engine/placement.py builds them); all of them share one HostExperts and a CpuExperts pool
per worker group of the thread layout, one for every GPU unless the GPUs sit on different
NUMA nodes (layers run in order, so a pool serves one layer at a time). The model module stays pure:
the loop over devices that moves activations lives here, a `Segment` per device.

Device names are logical: "cuda:1" is a GPU, "cpu:0" and "cpu:1" are two logical
devices on the host's one memory, so the same placement runs (and is tested) on a CPU.

Decode is captured as one CUDA graph per GPU (engine/graph.py): each segment's graph
replays on its device and the hidden state (and cos/sin) is copied between them, host-driven,
one launch per device per step. Each device's hybrid backend gets its own mapped-memory
handshake and native worker (GraphHybridExperts); the workers of a worker group share its
CPU pool, and steps never overlap across devices, so a pool still has one submitter at a time.

Legend: T tokens, D hidden, L decoder layers.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from ostinato.config import ConfigError
from ostinato.engine.assign import assign_devices, layer_map
from ostinato.engine.kv_cache import allocate, layer_views
from ostinato.layers.moe.backend import MoEBackend
from ostinato.layers.moe.reference import ReferenceExperts
from ostinato.loader.build import WeightFormats, host_embedding, load_experts
from ostinato.models.common import DecodeWindow, PassChunk


def physical(name: str) -> torch.device:
    """A logical device name -> the torch device that holds its memory ("cpu:1" -> cpu)."""
    dev = torch.device(name)
    return torch.device("cpu") if dev.type == "cpu" else dev


def gpus_in_order(names: list[str]) -> list[str]:
    """The distinct CUDA devices among these names (a layer map or a device list), in order:
    the GPUs of a thread layout, position i for the i-th."""
    return [n for n in in_order(names) if physical(n).type == "cuda"]


def cuda_index(name: str) -> int:
    """The CUDA device index of a device name ("cuda" is the current device)."""
    dev = torch.device(name)
    if dev.index is not None:
        return dev.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def parse_devices(spec) -> list[str]:
    """'cuda:0,cuda:1' (or a sequence) -> ['cuda:0', 'cuda:1']; names are checked by torch."""
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s) for s in spec]
    names = [n for n in names if n]
    for n in names:
        torch.device(n)
    if len(set(names)) != len(names):
        raise ValueError(f"devices {names}: a device is named twice")
    return names


def in_order(layer_devices: list[str]) -> list[str]:
    """The distinct devices in layer order (first: embedding, last: lm_head)."""
    return list(dict.fromkeys(layer_devices))


def resolve_layer_devices(cfg, names: list[str], residency, kv_tokens: int, dtype: torch.dtype,
                          formats: WeightFormats = WeightFormats()) -> list[str] | None:
    """Each decoder layer's device, or None for a one-device run. A residency planned for
    several devices brings its own assignment (the names given, if any, must be its devices);
    otherwise several names get the balanced assignment of engine/assign.py, equal caps, of the
    weights in the formats the GPUs keep."""
    planned = residency.layer_devices(cfg.num_hidden_layers) if residency is not None else None
    if planned is not None:
        if len(names) > 1 and names != list(residency.devices):
            raise ConfigError(f"the residency file was planned for devices {','.join(residency.devices)}, not "
                              f"{','.join(names)}: give those, or plan again with --devices {','.join(names)}")
        return planned
    if len(names) < 2:
        return None
    return layer_map(assign_devices(cfg, names, kv_tokens, dtype, formats=formats), cfg.num_hidden_layers)


def place_model(model: nn.Module, layer_devices: list[str]) -> None:
    """Move each layer to its device, the embedding to the first (or into pinned host memory:
    loader/build.py host_embedding), norm and lm_head to the last."""
    first, last = physical(layer_devices[0]), physical(layer_devices[-1])
    inner = model.model
    tied = getattr(model.lm_head, "weight", None) is inner.embed_tokens.weight  # a head in blocks is never tied
    if tied and first != last:  # one tensor cannot live on two devices: the head gets a copy
        model.lm_head.weight = nn.Parameter(inner.embed_tokens.weight.detach().to(last), requires_grad=False)
    if host_embedding(model.config, first):
        inner.embed_tokens.weight = nn.Parameter(inner.embed_tokens.weight.detach().cpu().pin_memory(),
                                                 requires_grad=False)
    else:
        inner.embed_tokens.to(first)
    for layer, name in zip(inner.layers, layer_devices):
        layer.to(physical(name))
    inner.norm.to(last)
    model.lm_head.to(last)


class SplitKV:
    """The KV cache of a split model: per device, its layers' cache tensors stacked
    (engine/kv_cache.py: name -> [Ld, N, *S])."""

    def __init__(self, cfg, max_tokens: int, layer_devices: list[str], dtype: torch.dtype):
        self.max_tokens = max_tokens
        self.blocks: dict[str, dict[str, torch.Tensor]] = {}
        views = {}
        for name in in_order(layer_devices):
            self.blocks[name] = allocate(cfg, layer_devices.count(name), max_tokens, physical(name), dtype)
            views[name] = iter(layer_views(self.blocks[name]))
        self.layers = [next(views[name]) for name in layer_devices]


@dataclass(frozen=True)
class Segment:
    """One device's contiguous range of decoder layers; the first segment also embeds the
    token (and computes cos/sin), the last also runs the final norm (and lm_head)."""
    name: str  # logical device
    layers: range
    first: bool
    last: bool

    @property
    def device(self) -> torch.device:
        return physical(self.name)


def segments(layer_devices: list[str]) -> list[Segment]:
    """Each decoder layer's device -> the segments in layer order (one device: one segment).
    A device must hold one contiguous range: its graph, KV block and worker serve it once a step."""
    bounds = [0] + [i for i in range(1, len(layer_devices)) if layer_devices[i] != layer_devices[i - 1]]
    bounds.append(len(layer_devices))
    names = [layer_devices[b] for b in bounds[:-1]]
    if len(set(names)) != len(names):
        raise ConfigError(f"layer devices {layer_devices}: a device holds two ranges of layers; each device's "
                          "layers must be one contiguous range (plan again with --devices)")
    n = len(names)
    return [Segment(name, range(bounds[i], bounds[i + 1]), i == 0, i == n - 1) for i, name in enumerate(names)]


def device_scope(dev: torch.device):
    """Make a CUDA device the current one (Triton kernels, events and streams follow
    torch.cuda.current_device(), not the tensors); nothing for a CPU device."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def forward_split(model, parts: list[Segment], input_ids: torch.Tensor, positions: torch.Tensor, kv: list,
                  start: int, window: DecodeWindow | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The model's forward pass (same modules, same order) with x handed between devices:
    input_ids, positions [T] (and the embedding's rows, if looked up on the host) on the first
    device -> final hidden states [T, D] on the last."""
    x, cos, sin = model.embed(input_ids, positions, start, window, rows)
    for seg in parts:
        dev = seg.device
        if not seg.first:  # a range boundary between two devices
            x, cos, sin = x.to(dev), cos.to(dev), sin.to(dev)
            if window is not None:
                window = DecodeWindow(window.position.to(dev), window.size)
                window.refresh()
        with device_scope(dev):
            x = model.run_layers(seg.layers, x, cos, sin, kv, start, window)
    return model.model.norm(x)


def forward_layer_major(model, parts: list[Segment], chunks: list[tuple], kv: list) -> list[torch.Tensor]:
    """A pass of several chunks, layer by layer: every chunk through a layer before any enters the
    next (chunk c attends over the cache rows that chunks 0..c wrote at that layer, as in chunk
    order: the same modules on the same inputs). chunks: (input_ids, positions, start, rows) each,
    on the first device -> each chunk's final hidden states, on the last.

    Why: an upload pass stages a layer's cold experts in the pool's flex slots, and in chunk order
    every other layer overwrites them before the next chunk comes back, so a prompt of n chunks
    copied each cold expert n times (session 28: 183 GB over the 30B file's 71 held-out turns,
    mostly first turns). Layer by layer, at an MoE layer every chunk attends first, then the routed
    experts of all chunks go to the backend in one call (DecoderLayer.forward_chunks,
    MoEBackend.many), which stages each of the layer's cold experts once for all of them: where
    they outnumber the flex slots and go up in waves (HybridExperts.upload_chunks), every chunk's
    routes to a wave are computed while it is staged; one chunk after the other, only the last wave
    would still be staged for the next chunk. One chunk is the model's own layer, unchanged. Every
    chunk's hidden states wait between layers, and its residual, MLP input and expert sums while
    the waves run: the capacity test counts them (planner/capacity.py activation_bytes,
    "chunk_states")."""
    states = [PassChunk(*model.embed(ids, pos, start, None, rows), start) for ids, pos, start, rows in chunks]
    for seg in parts:
        dev = seg.device
        if not seg.first:
            states = [st.to(dev) for st in states]
        with device_scope(dev):
            for layer in seg.layers:
                model.model.layers[layer].forward_chunks(states, kv[layer])
    return [model.model.norm(st.x) for st in states]


class SplitExperts(MoEBackend):
    """The experts backend of a split model: each layer goes to its device's backend."""

    def __init__(self, backends: dict[str, object], layer_devices: list[str]):
        self.backends = backends  # device name -> backend; a device without MoE layers has none
        self.layer_devices = layer_devices

    def __call__(self, layer: int, x: torch.Tensor, topk):
        return self.backends[self.layer_devices[layer]](layer, x, topk)

    def many(self, layer: int, xs: list[torch.Tensor], topks: list) -> list[torch.Tensor]:
        return self.backends[self.layer_devices[layer]].many(layer, xs, topks)

    @property
    def capturable(self) -> bool:
        """A decode graph per device can be captured when every device's backend allows it."""
        return all(b.capturable for b in self.backends.values())

    def wrap(self, fn) -> None:
        """Replace each device's backend b by fn(b, name) (the runner wraps a hybrid backend in
        its graph backend, with that GPU's poller core)."""
        wrapped = {}
        for name, b in self.backends.items():
            with device_scope(physical(name)):
                wrapped[name] = fn(b, name)
        self.backends = wrapped

    def _each(self, hook) -> None:
        for b in self.backends.values():
            with device_scope(b.device) if b.device is not None else contextlib.nullcontext():
                hook(b)

    def before_prefill(self) -> None:
        self._each(lambda b: b.before_prefill())

    def after_decode_step(self) -> None:
        self._each(lambda b: b.after_decode_step())

    def settle(self) -> None:
        self._each(lambda b: b.settle())

    @property
    def offload_threshold(self) -> int | None:
        """Np: every device's backend has the same (engine/placement.py build_split_hybrid)."""
        return next((b.offload_threshold for b in self.backends.values()), None)

    @offload_threshold.setter
    def offload_threshold(self, n: int | None) -> None:
        for b in self.backends.values():
            b.offload_threshold = n

    def resident_experts(self) -> int:
        return sum(b.resident_experts() for b in self.backends.values())

    def close(self) -> None:
        """Close each device's backend: its graph worker, then the CPU pool and the host experts
        the devices share (the first device closes those; the others find them closed)."""
        self._each(lambda b: b.close())

    def stats(self) -> dict[str, float]:
        total: Counter = Counter()
        for b in self.backends.values():
            total.update(b.stats())
        return dict(total)


def backend_of(experts, seg: Segment):
    """The experts backend that serves a segment's layers: its device's, for a split backend."""
    return experts.backends.get(seg.name) if isinstance(experts, SplitExperts) else experts


def split_reference(source, layer_devices: list[str], dtype: torch.dtype):
    """Every expert resident, each layer's on its own device (no residency given)."""
    return ReferenceExperts({l: load_experts(source, l, device=physical(layer_devices[l]), dtype=dtype)
                             for l in source.config.moe_layers})
