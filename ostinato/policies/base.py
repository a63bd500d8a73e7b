"""What every baseline policy shares: the model's experts as a spec, the expert pools, host
experts and a CPU pool built from one load (build_parts); and, for the caches, the executor of
a pass plan.

Experts keep their format as in Ostinato's placement (engine/placement.py): a GGUF file's
experts stay in its block formats (`ModelExperts.formats`, loader.build.expert_formats), one
pool per format group (ExpertPools, layers/moe/pool.py), host copies per format. So a
policy's budget is bytes, not slots: every group's pool (its resident or cached experts, K
zero slots and its staging slots) costs that group's expert bytes per slot (`pools_bytes`),
and a policy chooses its residency so that the sum fits the budget. A float model is one group,
where bytes // expert bytes is the old slot count. The static placements (policies/static.py) run on HybridExperts, Ostinato's
executor; only a cache, whose placement changes with every pass, needs its own.

A cache answers one question per MoE layer and forward pass: which pool slot serves each
expert of the layer in this pass (-1: the CPU computes it), and which experts to copy from
page-locked host memory into which slots first. That answer is a `PassPlan`. The executor
then runs the same seams as the hybrid backend (layers/moe/hybrid.py): the GPU branch is
`pool.forward` over the pool (a CPU route reads the zero slot of its top-k
position, so shapes stay fixed), the CPU branch is `CpuExperts.submit`/`wait` over the host
copies, and the two partial sums (fp32) are added and rounded once.

A plan that does not depend on the routing (`static_plan`) needs no host sync before the
GPU branch is launched; a plan that does (caches, uploads) first brings the routing to the
host. Counters (as HybridExperts'): routes, token_layers (tokens summed over layer calls),
cold_routes (routes whose expert was not in the pool when the pass began: computed on the
CPU or uploaded), cpu_experts (distinct experts the CPU computed, summed over calls),
uploaded_experts, bytes_uploaded, evictions; pool_hits = routes - cold_routes.

Decode steps are captured as graph segments (engine/graph.py GraphChain), as llama.cpp runs
its cached layers: at each MoE layer the captured step copies the routing and activations to
page-locked buffers and cuts; at replay the host then synchronises once, plans, starts the
uploads, writes the pass's slot table (and the CPU branch's partial sum, computed meanwhile)
to static device buffers, and the next segment runs the GPU branch from them. The same plan
and kernels as the synchronous path, so a replayed step equals it bit for bit. Every eighth
step the gaps are timed with events: segment_gap_ms over segment_cuts (from the end of a
segment to the next one's inputs being on the device) and, for the cuts with nothing to
upload or compute on the CPU, sync_gap_ms over sync_cuts: the cost of the sync itself.

Legend: T tokens, K top-k, E experts per layer, D hidden, F expert FFN, L model layers.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ostinato.config import ConfigError
from ostinato.layers.moe.backend import MoEBackend
from ostinato.layers.moe.cpu_experts import CpuExperts
from ostinato.layers.moe.hybrid import to_host
from ostinato.layers.moe.pool import (ExpertPool, ExpertPools, HostExperts, Qtypes, expert_nbytes, group_flex,
                                      group_layers)
from ostinato.threads import ThreadLayout
from ostinato.config import SILU, ExpertAct
from ostinato.layers.moe.types import ExpertWeights, QuantExpertWeights, TopKOutput
from ostinato.loader.build import expert_formats, load_layer_experts

CPU = -1  # a plan's slot for "computed on the CPU"


@dataclass
class ModelExperts:
    """The model's experts as a policy sees them: shapes, formats, where to compute, how to load."""

    num_layers: int  # all model layers (rows of an index table)
    moe_layers: list[int]
    num_experts: int  # E
    top_k: int  # K
    hidden: int  # D
    ffn: int  # F
    device: torch.device
    dtype: torch.dtype
    load: Callable[[int], ExpertWeights | QuantExpertWeights]  # one layer's stacked experts, in its format
    max_tokens: int  # the largest pass (the runner's prefill chunk)
    threads: ThreadLayout | None = None  # whose workers the CPU pool takes (None: a host-driven process's)
    formats: dict[int, Qtypes] = field(default_factory=dict)  # layer -> (qt13, qt2) of GGUF blocks; absent: float
    act: ExpertAct = SILU  # the experts' activation
    bias: bool = False  # the experts have biases (gpt-oss), kept in fp32 beside each slot

    def expert_size(self, layer: int) -> int:
        """Bytes of one expert (gate, up, down, its biases) of `layer` as its pool holds it."""
        D, F = self.hidden, self.ffn
        return expert_nbytes((2 * F, D), (D, F), self.formats.get(layer), self.dtype, self.bias)

    @property
    def expert_bytes(self) -> int:
        """One expert's bytes, the mean over the MoE layers where formats differ (as
        planner/pipeline.size_pool counts it): the unit of a budget given in slots."""
        sizes = [self.expert_size(l) for l in self.moe_layers]
        return round(sum(sizes) / len(sizes)) if sizes else self.expert_size(-1)

    def groups(self) -> dict[Qtypes, list[int]]:
        """The pool groups (one per format) and their MoE layers, in ExpertPools' order."""
        return group_layers(self.moe_layers, self.formats)

    @property
    def total_experts(self) -> int:
        return len(self.moe_layers) * self.num_experts

    @classmethod
    def from_source(cls, source, runner_settings, graphs: bool = True, experts: str = "native") -> "ModelExperts":
        """graphs: the policy decodes through the graph handshake (a poller core is kept for it);
        experts: "native" keeps a GGUF file's block formats, "bf16" dequantizes them at load."""
        cfg = source.config
        dtype = runner_settings.torch_dtype(cfg.torch_dtype)
        device = runner_settings.torch_device()
        formats = expert_formats(source, experts)
        return cls(cfg.num_hidden_layers, list(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok,
                   cfg.hidden_size, cfg.moe_intermediate_size, device, dtype,
                   lambda layer: load_layer_experts(source, layer, formats[layer], device, dtype),
                   runner_settings.prefill_chunk, runner_settings.thread_layout(graphs=graphs),
                   {l: qt for l, qt in formats.items() if qt is not None}, cfg.expert_act, cfg.expert_bias)


@dataclass(frozen=True)
class PassPlan:
    """Where each expert of one layer runs in one pass."""

    slot: torch.Tensor  # [E] int32 on the host: pool slot of each expert, CPU (-1) for the CPU
    slot_dev: torch.Tensor | None = None  # the same on the compute device (None: made when needed)
    uploads: tuple[tuple[int, int], ...] = ()  # (expert, slot): copied from host memory before the pass
    all_gpu: bool = False  # set from slot: every expert served from the pool (no host sync needed)

    def __post_init__(self):
        object.__setattr__(self, "all_gpu", bool((self.slot.numpy() >= 0).all()))

    def where(self, expert: int) -> str:
        """'upload', 'pool' or 'cpu': for tests and reports."""
        if any(e == expert for e, _ in self.uploads):
            return "upload"
        return "pool" if int(self.slot[expert]) >= 0 else "cpu"


def pools_bytes(spec: ModelExperts, hot: dict[int, list[int]], flex) -> int:
    """Bytes of the pools build_parts makes for `hot` with `flex` (int, None or per group: group_flex)."""
    total = 0
    for qt, layers in spec.groups().items():
        n = sum(len(hot.get(l, [])) for l in layers) + spec.top_k + group_flex(flex, qt, layers, hot, spec.num_experts)
        total += n * spec.expert_size(layers[0])
    return total


def check_fits(spec: ModelExperts, need: int, budget: int, policy: str, what: str) -> None:
    if need > budget:
        raise ConfigError(f"policy {policy}: {what} need {need / 2**20:.1f} MiB of expert pool (with each format "
                          f"group's {spec.top_k} zero slots) but the budget is {budget / 2**20:.1f} MiB; give a "
                          "larger budget")


def unpin(host: HostExperts | None) -> None:
    """HostExperts.unpin, for a backend that may have no host experts."""
    if host is not None:
        host.unpin()


def build_parts(spec: ModelExperts, resident: dict[int, list[int]], on_host: dict[int, list[int]], flex,
                cpu_backend: str):
    """The pools, one per format group (resident experts packed, K zero slots, `flex` slots for
    caches and staging: see group_flex), page-locked host copies of `on_host` in their formats, and a
    CPU pool over them, from one load of each layer."""
    shape13, shape2 = (2 * spec.ffn, spec.hidden), (spec.hidden, spec.ffn)
    hot = {l: sorted(resident.get(l, [])) for l in spec.moe_layers}
    pools = ExpertPools.build(hot, spec.num_layers, spec.num_experts, spec.top_k, flex, shape13, shape2, spec.device,
                              spec.dtype, spec.formats, act=spec.act, bias=spec.bias)
    host_sets = {l: sorted(v) for l, v in on_host.items() if v}
    host = HostExperts(host_sets, spec.num_experts, shape13, shape2, spec.dtype, spec.formats, act=spec.act,
                       bias=spec.bias)
    for layer in spec.moe_layers:
        w = spec.load(layer)
        pools.fill_layer(layer, w)
        if layer in host_sets:
            host.fill_layer(layer, w)
        del w
    cpus = spec.threads.workers if spec.threads is not None else None
    cpu = CpuExperts(host.layers, backend=cpu_backend, cpus=cpus) if host.layers else None
    return pools, host, cpu


@dataclass
class SegmentBuffers:
    """What a captured decode step hands between its segments at one MoE layer (shared by all
    layers: the host finishes with one before the next segment overwrites it)."""

    ids: torch.Tensor  # [1, K] page-locked: the routing, copied by the segment before the cut
    weights: torch.Tensor  # [1, K] page-locked
    x: torch.Tensor  # [1, D] page-locked: the activations, for the CPU branch
    slot_host: torch.Tensor  # [E] int32 page-locked: the plan's slot table, staged for the device
    slot_dev: torch.Tensor  # [E] int32: read by the next segment's GPU branch
    cpu_dev: torch.Tensor  # [1, D] fp32: the CPU branch's partial sum, added by the next segment
    ready: torch.cuda.Event  # recorded after a segment: the host waits for the routing on it
    cpu_dirty: bool = False  # cpu_dev holds a partial sum (zeroed before a layer without one)


TIME_EVERY = 8  # decode steps between two timed ones (events around every cut of the step)


class SlotExperts(MoEBackend):
    """An experts backend over a pool, host experts and a CPU pool; subclasses choose the plan.
    A cache reads every decode step's routing on the host: its decode steps are captured as
    graph segments cut at each MoE layer (module docstring)."""

    name = "slots"
    segmented = True

    def __init__(self, spec: ModelExperts, pools: ExpertPools, host: HostExperts, cpu):
        self.spec, self.pools, self.host, self.cpu = spec, pools, host, cpu
        self.device = pools.device
        self.on_cuda = self.device.type == "cuda"
        self.counters: Counter = Counter()
        self.last_plan: PassPlan | None = None
        pin = self.on_cuda
        self.x_host = torch.empty((spec.max_tokens, spec.hidden), dtype=spec.dtype, pin_memory=pin)
        self.out_host = torch.empty((spec.max_tokens, spec.hidden), dtype=torch.float32, pin_memory=pin)
        self.chain = None  # set by the decode graph while it captures a step (engine/graph.py)
        self.frozen = False  # the capture's warm-up: passes leave the policy's state alone
        self._seg: SegmentBuffers | None = None
        self._steps = 0  # replayed decode steps, for timing every TIME_EVERY-th
        self._timing: list = []  # this step's (gap start, gap end, quiet) events; read at the next timed step
        self._layer0 = spec.moe_layers[0]

    # -- what a policy decides -------------------------------------------------------------
    def static_plan(self, layer: int, T: int) -> PassPlan | None:
        """A plan that does not depend on this pass's routing, or None (then `plan` is asked)."""
        return None

    def plan(self, layer: int, T: int, ids: torch.Tensor) -> PassPlan:
        """ids [T, K] on the host -> the plan of this pass (may update the policy's state)."""
        raise NotImplementedError

    def resident_experts(self) -> int:
        """Experts held in pool slots for reuse across passes (resident or cached)."""
        return self.pools.num_hot

    @property
    def pool(self) -> ExpertPool:
        """The pool of a one-group placement (every float model); ConfigError with several."""
        return self.pools.single("this use of the pool")

    def stats(self) -> dict[str, float]:
        self._read_timing()
        d = dict(self.counters)
        d["pool_hits"] = d.get("routes", 0) - d.get("cold_routes", 0)
        return d

    def before_capture(self) -> None:
        """The capture's warm-up must not move the cache; the segments' buffers are made here,
        outside the capture (the router's ids are int64, its weights fp32: layers/moe/router.py)."""
        self.frozen = True
        if self._seg is None and self.on_cuda:
            K, D, E = self.spec.top_k, self.spec.hidden, self.spec.num_experts
            pinned = {"device": "cpu", "pin_memory": True}
            self._seg = SegmentBuffers(
                torch.empty((1, K), dtype=torch.int64, **pinned), torch.empty((1, K), dtype=torch.float32, **pinned),
                torch.empty((1, D), dtype=self.spec.dtype, **pinned), torch.empty(E, dtype=torch.int32, **pinned),
                torch.full((E,), CPU, dtype=torch.int32, device=self.device),
                torch.zeros((1, D), dtype=torch.float32, device=self.device), torch.cuda.Event())

    def after_capture(self) -> None:
        self.frozen = False

    def close(self) -> None:
        if self.cpu is not None:
            self.cpu.close()
            self.cpu = None
        unpin(self.host)

    # -- helpers for plans -------------------------------------------------------------------
    def plan_of(self, slot: torch.Tensor, uploads=()) -> PassPlan:
        """A plan of this pass only: its device table is made when the synchronous path needs it."""
        return PassPlan(slot.to(torch.int32), None, tuple(uploads))

    def _device_slots(self, plan: PassPlan) -> torch.Tensor | None:
        if plan.slot_dev is not None or not bool((plan.slot >= 0).any()):
            return plan.slot_dev
        return plan.slot.to(self.device)

    def all_cpu_plan(self) -> PassPlan:
        return PassPlan(torch.full((self.spec.num_experts,), CPU, dtype=torch.int32))

    def staging_plan(self, layer: int, ids: torch.Tensor, base: torch.Tensor | None = None) -> PassPlan:
        """Upload every expert this pass uses that `base` does not place in the pool, each once,
        into the staging slots at the end of the layer's pool; then everything runs on the GPU."""
        slot = base.clone() if base is not None else torch.full((self.spec.num_experts,), CPU, dtype=torch.int32)
        used = torch.unique(ids).tolist()
        need = [e for e in used if int(slot[e]) < 0]
        lo = self.pools.of(layer).num_slots - self.spec.num_experts
        uploads = [(e, lo + i) for i, e in enumerate(need)]
        for e, s in uploads:
            slot[e] = s
        return self.plan_of(slot, uploads)

    # -- the executor ------------------------------------------------------------------------
    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        T, K = topk.ids.shape
        if self.chain is not None and T == 1:
            return self._captured(layer, x, topk)
        if self.frozen:  # the capture's warm-up: run the kernels, keep the cache as it is
            ids_h, w_h, x_h, ready = to_host(topk, x, self.x_host, self.on_cuda)
            if ready is not None:
                ready.synchronize()
            plan = self.staging_plan(layer, ids_h)
            self._upload(layer, plan.uploads, count=False)
            return self._gpu_branch(layer, x, topk, self._device_slots(plan)).to(x.dtype)
        self.counters["routes"] += T * K
        self.counters["token_layers"] += T
        plan = self.static_plan(layer, T)
        if plan is not None and plan.slot_dev is not None and plan.all_gpu:
            self.last_plan = plan
            return self._gpu_branch(layer, x, topk, plan.slot_dev).to(x.dtype)
        ids_h, w_h, x_h, ready = to_host(topk, x, self.x_host, self.on_cuda)
        gpu = None
        if plan is not None and plan.slot_dev is not None:
            gpu = self._gpu_branch(layer, x, topk, plan.slot_dev)  # runs while the routing goes to the host
        if ready is not None:
            ready.synchronize()
        if plan is None:
            plan = self.plan(layer, T, ids_h)
            self._upload(layer, plan.uploads)
            slot_dev = self._device_slots(plan)
            if slot_dev is not None:
                gpu = self._gpu_branch(layer, x, topk, slot_dev)
        self.last_plan = plan
        cpu = self._cpu_branch(layer, T, x_h, ids_h, w_h, plan)
        if cpu is None:
            return gpu.to(x.dtype) if gpu is not None else torch.zeros_like(x)
        out = cpu.to(self.device, non_blocking=self.on_cuda, copy=True)
        return (out if gpu is None else gpu + out).to(x.dtype)

    def _gpu_branch(self, layer: int, x, topk: TopKOutput, slot_dev: torch.Tensor) -> torch.Tensor:
        pool = self.pools.of(layer)
        s = slot_dev[topk.ids]  # [T, K]
        slots = torch.where(s >= 0, s, pool.zero_of_position[: topk.ids.shape[1]])
        return pool.forward(x, slots, topk.weights, out_dtype=torch.float32)

    def _upload(self, layer: int, uploads, count: bool = True) -> None:
        if not uploads:
            return
        pool = self.pools.of(layer)
        nbytes = 0
        for e, s in uploads:  # one copy per expert, from page-locked host memory
            nbytes += pool.upload(s, self.host, layer, e)
        if count:
            self.counters["uploaded_experts"] += len(uploads)
            self.counters["bytes_uploaded"] += nbytes

    # -- a decode step as graph segments ---------------------------------------------------------
    def _captured(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """Inside the capture of a step: routing and activations to page-locked memory, the cut,
        then (in the next segment) the GPU branch from the static slot table plus the CPU
        branch's partial sum, both written by the host between the segments."""
        seg = self._seg  # made by before_capture
        seg.ids.copy_(topk.ids, non_blocking=True)
        seg.weights.copy_(topk.weights, non_blocking=True)
        seg.x.copy_(x, non_blocking=True)
        self.chain.cut(lambda: self._between(layer, seg))
        return (self._gpu_branch(layer, x, topk, seg.slot_dev) + seg.cpu_dev).to(x.dtype)

    def _between(self, layer: int, seg: SegmentBuffers) -> None:
        """At replay, after the segment that ends with this layer's routing was launched: wait
        for it (the per-layer sync), plan, upload, hand the slot table and the CPU partial sum
        to the next segment."""
        timed = None
        if layer == self._layer0:
            self._steps += 1
        if self._steps % TIME_EVERY == 0:
            if layer == self._layer0:
                self._read_timing()
            timed = torch.cuda.Event(enable_timing=True)
            timed.record()
        seg.ready.record()
        seg.ready.synchronize()
        K = seg.ids.shape[1]
        self.counters["routes"] += K
        self.counters["token_layers"] += 1
        plan = self.static_plan(layer, 1) or self.plan(layer, 1, seg.ids)
        self.last_plan = plan
        self._upload(layer, plan.uploads)
        seg.slot_host.copy_(plan.slot)
        seg.slot_dev.copy_(seg.slot_host, non_blocking=True)
        cpu = self._cpu_branch(layer, 1, seg.x, seg.ids, seg.weights, plan)
        if cpu is not None:
            seg.cpu_dev.copy_(cpu, non_blocking=True)
        elif seg.cpu_dirty:
            seg.cpu_dev.zero_()
        seg.cpu_dirty = cpu is not None
        if timed is not None:
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            self._timing.append((timed, done, not plan.uploads and cpu is None))

    def _read_timing(self) -> None:
        """Add the last timed step's gaps to the counters."""
        if self._timing:
            self._timing[-1][1].synchronize()  # long done when a step reads them; stats() may come sooner
        for start, end, quiet in self._timing:
            ms = start.elapsed_time(end)
            self.counters["segment_cuts"] += 1
            self.counters["segment_gap_ms"] += ms
            if quiet:
                self.counters["sync_cuts"] += 1
                self.counters["sync_gap_ms"] += ms
        self._timing = []

    def _cpu_branch(self, layer, T, x_h, ids_h, w_h, plan: PassPlan):
        """Counts the pass's cold routes and runs its CPU routes; the CPU partial sum [T, D] fp32
        (a host buffer reused by the next call) or None when the CPU has nothing to do. The
        bookkeeping is numpy: a decode step does it once per MoE layer, between two graph
        segments, where torch's per-op overhead on [K]-sized tensors would be the cost."""
        ids = ids_h.numpy()
        on_cpu = plan.slot.numpy()[ids] < 0  # [T, K]
        r = int(on_cpu.sum())
        cold = r
        if plan.uploads:
            cold += int(np.isin(ids, [e for e, _ in plan.uploads]).sum())
        self.counters["cold_routes"] += cold
        if r == 0:
            return None
        eids = ids[on_cpu]
        self.counters["cpu_experts"] += len(np.unique(eids))
        tok = torch.from_numpy(on_cpu.nonzero()[0].astype(np.int32))
        out_h = self.out_host[:T]
        self.cpu.submit(layer, x_h, tok, self.host.compact[layer][torch.from_numpy(eids)],
                        w_h[torch.from_numpy(on_cpu)], out_h)
        self.cpu.wait()
        return out_h
