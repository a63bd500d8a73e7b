"""What every placement builds from: the model's experts as a spec (ModelExperts), the bytes of
its pools (pools_bytes), and the expert pools, page-locked host copies and CPU pool made from
one load of each layer (build_parts), which a placement hands to the one executor
(HybridExperts, layers/moe/hybrid.py): Ostinato's plan (engine/placement.py build_hybrid), the
static baselines (policies/static.py) as they are, the caches (policies/caches.py) with an
admission on it.

Experts keep their format: a GGUF file's experts stay in its block formats
(`ModelExperts.formats`, loader.build.expert_formats), one pool per format group (ExpertPools,
layers/moe/pool.py), host copies per format. So a budget is bytes, not slots: every group's
pool (its resident or cached experts, K zero slots and its staging slots) costs that group's
expert bytes per slot (`pools_bytes`), and a policy chooses its residency so that the sum fits
the budget. A float model is one group, where bytes // expert bytes is the old slot count.

Legend: T tokens, K top-k, E experts per layer, D hidden, F expert FFN, L model layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ostinato.config import SILU, ConfigError, ExpertAct
from ostinato.engine.sizes import FLEX_SHARE
from ostinato.layers.moe.cpu_experts import CpuExperts
from ostinato.layers.moe.hybrid import HybridExperts
from ostinato.layers.moe.pool import ExpertPools, HostExperts, Qtypes, expert_nbytes, group_flex, group_layers
from ostinato.layers.moe.types import ExpertWeights, QuantExpertWeights
from ostinato.loader.build import expert_formats, load_jobs, load_layer_experts
from ostinato.threads import ThreadLayout, on_workers


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
    load_jobs: int = 1  # layers loaded at once (loader/build.load_jobs)
    store: HostExperts | None = None  # a kept store of every expert (stored_experts): `load` reads it

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
    def of(cls, source, device: torch.device, dtype: torch.dtype, max_tokens: int, threads: ThreadLayout | None,
           experts: str = "native") -> "ModelExperts":
        """experts: "native" keeps a GGUF file's block formats, "bf16" dequantizes them at load."""
        cfg = source.config
        formats = expert_formats(source, experts)
        store = stored_experts(source, formats, dtype)
        return cls(cfg.num_hidden_layers, list(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok,
                   cfg.hidden_size, cfg.moe_intermediate_size, device, dtype,
                   expert_loader(source, formats, device, dtype, store),
                   max_tokens, threads, {l: qt for l, qt in formats.items() if qt is not None},
                   cfg.expert_act, cfg.expert_bias, load_jobs(source, device), store)

    @classmethod
    def from_source(cls, source, runner_settings, graphs: bool = True, experts: str = "native") -> "ModelExperts":
        """graphs: the policy decodes through the graph handshake (a poller core is kept for it)."""
        return cls.of(source, runner_settings.torch_device(), runner_settings.torch_dtype(source.config.torch_dtype),
                      runner_settings.prefill_chunk, runner_settings.thread_layout(graphs=graphs), experts)


def keep_host_experts(source, host: HostExperts | None) -> bool:
    """Keep `host`, where it holds every expert of each MoE layer of `source`, as the store that every
    placement built on `source` from now on takes its host copies (views) and pool fills from
    (HostExperts.keep says why); -> whether it was kept. The bench keeps its profiling placement's
    copies (bench.py prepare); release_host_experts ends it."""
    cfg = source.config
    if host is None or set(host.layers) != set(cfg.moe_layers) or not host.holds_every_expert():
        return False
    host.keep()
    source.host_store = host
    return True


def release_host_experts(source) -> None:
    """Placements built on `source` load their experts again; the store's buffers are freed, and
    unpinned, with the last placement that reads them."""
    source.host_store = None


def stored_experts(source, formats: dict[int, Qtypes | None], dtype: torch.dtype) -> HostExperts | None:
    """The store kept on `source` (keep_host_experts), where it holds the experts in these formats and
    dtype; else None (a placement then loads them from the source)."""
    store = getattr(source, "host_store", None)
    if store is None:
        return None
    for layer, w in store.layers.items():
        qt = (w.qt13, w.qt2) if isinstance(w, QuantExpertWeights) else None
        if qt != formats.get(layer) or (qt is None and w.w13.dtype != dtype):
            return None
    return store


def expert_loader(source, formats: dict[int, Qtypes | None], device: torch.device, dtype: torch.dtype,
                  store: HostExperts | None) -> Callable[[int], ExpertWeights | QuantExpertWeights]:
    """One layer's stacked experts, every one in id order, in its format: from the store where there is
    one (page-locked host memory), else loaded from the source onto `device` (loader/build.py)."""
    if store is not None:
        return lambda layer: store.layers[layer]
    return lambda layer: load_layer_experts(source, layer, formats[layer], device, dtype)


def baseline_staging(spec: ModelExperts, budget: int) -> int | None:
    """A baseline's staging slots in each format group (a `flex` for build_parts): None, one layer's
    (the group's most cold experts of a layer, E with none resident), where the budget holds them with
    the K zero slots; else FLEX_SHARE of the budget split evenly over the groups, in the largest group's
    expert bytes (Ostinato's bound on its flex slots, planner/capacity.py), and a pass that uploads more
    experts than that runs in waves (layers/moe/hybrid.py upload_chunks, once for all the chunks of a pass). Why: a DeepSeek-V3 layer of bf16
    experts is 22.5 GB, more than a 24 GiB cap leaves the pools (session 49), and llama.cpp's op offload
    needs only one expert tensor's room, not a layer's."""
    if pools_bytes(spec, {}, None) <= budget:
        return None
    sizes = [spec.expert_size(layers[0]) for layers in spec.groups().values()]
    return int(FLEX_SHARE * budget) // (len(sizes) * max(sizes))


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
    host = host_copies(spec.store, host_sets, spec.num_experts, shape13, shape2, spec.dtype, spec.formats,
                       act=spec.act, bias=spec.bias)

    def fill(layer: int) -> None:
        w = spec.load(layer)
        pools.fill_layer(layer, w)
        if layer in host_sets and spec.store is None:
            host.fill_layer(layer, w)

    on_workers(fill, spec.moe_layers, spec.threads, spec.load_jobs)
    cpus = spec.threads.workers if spec.threads is not None else None
    cpu = CpuExperts(host.layers, backend=cpu_backend, cpus=cpus) if host.layers else None
    return pools, host, cpu


def host_copies(store: HostExperts | None, cold: dict[int, list[int]], num_experts: int, shape13, shape2, dtype,
                formats, **math) -> HostExperts:
    """The page-locked host copies of the `cold` experts: views of the store where there is one (nothing
    to fill), else new buffers that the placement fills from each layer's load."""
    if store is not None:
        return HostExperts.over(store, cold)
    return HostExperts(cold, num_experts, shape13, shape2, dtype, formats, **math)


def hybrid_from_parts(spec: ModelExperts, hot: dict[int, list[int]], upload_threshold: int | None,
                      cpu_backend="auto", flex: int | dict | None = None, upload_all: bool = False) -> HybridExperts:
    """A static placement over the one executor, from a spec: `hot` resident, the others on the
    host for the CPU branch, `flex` slots for the upload path (default: each format group's most
    cold experts of a layer; 0 without an upload path; per group, pool.group_flex: Ostinato's,
    bounded by its plan)."""
    cold = {l: sorted(set(range(spec.num_experts)) - set(hot.get(l, []))) for l in spec.moe_layers}
    pools, host, cpu = build_parts(spec, hot, cold, flex, cpu_backend)
    for l in spec.moe_layers:  # HybridExperts reads every layer's host tables, resident-only layers too
        host.compact.setdefault(l, torch.full((spec.num_experts,), -1, dtype=torch.int32))
        host.rows.setdefault(l, host.compact[l].clone())
    return HybridExperts(pools, host, cpu, upload_threshold, spec.max_tokens, upload_all=upload_all)
