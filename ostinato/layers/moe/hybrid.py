"""The hybrid experts backend: hot routes from the GPU pool, cold routes on the CPU or
over PCIe, chosen by the size of the pass (DESIGN.md, "Three execution paths").

* decode (T = 1) and split (T < Np): the GPU computes every token's K slots from the
  pool (cold positions read a zero slot) while the CPU pool computes the cold routes
  from host memory; the routing and activations go to the host, the CPU branch starts,
  then the GPU branch is launched, so the two overlap; nothing but activations crosses PCIe.
* upload (T >= Np): each distinct cold expert of the pass is copied once into a flex
  slot of the pool, then the GPU computes everything; hot experts are never uploaded. A pass
  of several chunks runs layer by layer (engine/devices.py forward_layer_major) and hands a
  layer every chunk at once (`many`): the chunks on the upload path stage the union of their
  cold experts once (`upload_chunks`), each computing its own routes to them.
  The flex slots are bounded (planner/capacity.py: a DeepSeek-V3 layer's 256 cold experts
  would take 21 GiB; a baseline's staging under a cap smaller than a layer: engine/experts.py
  baseline_staging), so a pass may route to more distinct cold experts than they hold: it then
  uploads them in waves of as many as the slots hold, each wave's copies after the previous
  wave's GEMMs, which read the same slots (counted as `wave_passes`: once per layer and pass,
  however many chunks), as llama.cpp's op offload copies a host layer's weights whatever the
  pass. Every chunk's routes to a wave are computed while it is staged, each chunk summing
  into its own fp32 accumulator over the waves: staged one chunk after the other, only the last
  wave would still be there for the next chunk, and a pass of n chunks copied nearly every cold
  expert n times. Where splitting is cheaper, the split with uploads below takes those sizes
  (by calibration), and Np puts the upload path where it wins.
* split with uploads (`mixed.min_tokens` <= T <= `mixed.max_tokens`, with `mixed` set from a
  calibration; Np then plays no part for those passes): the split path, but the most-routed
  cold experts of the pass cross PCIe into flex slots while the CPU computes the rest, so the
  two links work at once. `MixedPass.choose` takes the count that minimises max(upload, CPU) by
  the calibrated costs: none is the split path, all of them the upload path's transfers (its
  GPU sum in two launches, not one). DESIGN.md's split path sends nothing over PCIe; on the
  H200 machine a 512-token pass took 16.7 ms per layer split and 12.9 ms uploaded, where either
  link alone is idle half the time. It is used only over the sizes at which the calibration
  timed it faster than both plain paths (MixedPass.from_calibration):
  - in session 15's calibration (bf16) it lost below 384 tokens (4.96 against 4.90 ms split at
    64), and a sum over the sizes had let it run there: the replay's prefills of fewer than 128
    new tokens took 18% longer (median) than under KTransformers' rules on the same residency,
    which differ from Ostinato's there only in these uploads (results/2026-12-02-h200-s15/);
  - in session 18's calibration of the Q4_K_M 235B shape it won from 64 to 768 tokens (14.8
    against 25.7 ms uploaded at 256; by 0.003 ms at 768) and lost from 1024 up (35.8 against
    30.0 at 2048), where a quantized cold route costs the CPU 34 µs: a rule that wanted it
    faster at the largest size left every tool turn on the upload path; over 64-768 tokens the
    median TTFT after tool outputs went from 715 to 410 ms (results/2026-12-04-h200-s22/).
  Decode never uploads (an upload exposes its whole transfer).

A cache is the same executor with an `Admission` (policies/caches.py): a residency that
changes at run time. The passes it admits bring their routing to the host, the admission
decides which missing experts to copy into its cache slots (and which entries to evict), the
tables switch (`switch`: the GPU branch's index table and the CPU branch's compact table
together, as borrowed memory switches them), and the pass then runs the split path: cached
experts on the GPU, the rest on the CPU. Passes it does not admit run the split or upload path
over the cache as it stands. A cache's upload path stages in the top slots of the flex region
(`staging`), below which the cache keeps its entries.

Both branches accumulate in fp32; the layer output is rounded to the activations'
dtype once, after the sum. On a machine without CUDA the "GPU" side runs on the CPU
device through the same code (torch path of the slot kernel), so CI covers all paths.

Legend: T tokens, K top-k, D hidden, R cold routes.
"""
from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ostinato.config import ConfigError
from ostinato.layers.moe.backend import MoEBackend, StepRows
from ostinato.layers.moe.pool import COLD, ExpertPool, ExpertPools, HostExperts
from ostinato.layers.moe.types import TopKOutput


def to_host(topk: TopKOutput, x: torch.Tensor, x_host: torch.Tensor, on_cuda: bool):
    """Start copying a pass's routing and activations to the host (x into the page-locked
    x_host) -> (ids, weights, x on the host, an event recorded after the copies, or None
    off CUDA). Synchronise on the event before reading them; the GPU may go on meanwhile."""
    ids_h = topk.ids.to("cpu", non_blocking=on_cuda)
    w_h = topk.weights.to("cpu", non_blocking=on_cuda)
    x_h = x_host[:x.shape[0]]
    x_h.copy_(x, non_blocking=on_cuda)
    done = torch.cuda.Event() if on_cuda else None
    if done is not None:
        done.record()
    return ids_h, w_h, x_h, done


@dataclass(frozen=True)
class MixedPass:
    """Calibrated costs (ms) that split a pass's cold experts between PCIe and the CPU:
    an upload costs `upload_ms` per expert; the CPU branch alpha + beta_expert per distinct
    expert + beta_route per route (the calibration's cpu_pass fit). It applies to passes of
    `min_tokens` to `max_tokens` tokens (None: no upper bound); the others take the plain paths
    (a decode step never uploads)."""
    upload_ms: float
    alpha_ms: float
    beta_expert_ms: float
    beta_route_ms: float
    min_tokens: int = 2
    max_tokens: int | None = None

    @classmethod
    def from_calibration(cls, cal: dict, measured: bool = True) -> "MixedPass | None":
        """The costs of a calibration; None without them. measured: only where the calibration
        timed the split path with uploads (passes.mixed_ms) faster than both plain paths, over the
        run of consecutive measured sizes at which it is faster that ends at the largest such size
        (min_tokens to max_tokens; no upper bound where that is the largest size measured); None
        where it is faster at none. Where the calibration timed it in pairs with the split path
        (planner/measure/prefill.py measure_mixed), faster means faster than the paired split on
        every layer timed: a single layer's loss says the gain is within the machine's noise.
        Unmeasured (the calibration's own timing of it): every pass of more than one token."""
        cp, gbps, nbytes = cal.get("cpu_pass") or {}, cal.get("upload_gbps"), cal.get("expert_bytes")
        if not (gbps and nbytes and cp.get("beta_route_ms")):
            return None
        costs = (nbytes / (gbps * 1e9) * 1e3, cp["alpha_ms"], cp["beta_expert_ms"], cp["beta_route_ms"])
        if not measured:
            return cls(*costs)
        p = cal.get("passes") or {}
        if not p.get("mixed_ms"):
            return None
        order = sorted(range(len(p["sizes"])), key=lambda i: p["sizes"][i])
        split = p.get("split_paired_ms") or p["split_ms"]
        wins = p.get("mixed_wins") or [None] * len(order)
        pays = [p["mixed_ms"][i] < min(split[i], p["upload_ms"][i])
                and (wins[i] is None or wins[i] >= p.get("paired_layers", 0)) for i in order]
        if not any(pays):
            return None
        j = max(i for i, won in enumerate(pays) if won)
        i = j
        while i > 0 and pays[i - 1]:
            i -= 1
        top = None if j == len(pays) - 1 else p["sizes"][order[j]]
        return cls(*costs, min_tokens=max(2, p["sizes"][order[i]]), max_tokens=top)

    def applies(self, T: int) -> bool:
        return T >= self.min_tokens and (self.max_tokens is None or T <= self.max_tokens)

    def window(self) -> str:
        """The pass sizes it applies to, as a report says them."""
        return window_text(self.min_tokens, self.max_tokens)

    def _ms(self, uploads: int, cpu_experts: int, cpu_routes: int) -> float:
        if not cpu_experts:
            return uploads * self.upload_ms
        cpu = self.alpha_ms + self.beta_expert_ms * cpu_experts + self.beta_route_ms * cpu_routes
        return max(uploads * self.upload_ms, cpu)

    def cost_ms(self, routes: list[int], k: int) -> float:
        """Upload the first k experts (routes: cold routes per expert, most first), CPU the rest."""
        return self._ms(k, len(routes) - k, sum(routes[k:]))

    def choose(self, routes: np.ndarray, limit: int) -> int:
        """How many of the most-routed cold experts to upload (at most limit flex slots; routes:
        cold routes per expert, most first): the count of least cost_ms, the smallest on a tie.
        The uploads' time grows with the count, so the search stops at the first count whose
        uploads alone cost as much as the best so far. A loop over Python ints: this runs on the
        host between a layer's routing and its branches, and numpy's dozen calls over arrays of
        at most E took 77-95 us there on the development host, the loop 5-15."""
        counts = np.asarray(routes).tolist()
        n, left = len(counts), sum(counts)  # left: the routes the CPU keeps
        best_k, best = 0, self._ms(0, n, left)
        for k in range(1, min(n, limit) + 1):
            left -= counts[k - 1]
            up = k * self.upload_ms
            if up >= best:
                break  # this count and every larger one cost at least their uploads
            cost = self._ms(k, n - k, left)
            if cost < best:
                best_k, best = k, cost
        return best_k


def defer_combine() -> bool:
    """Whether split passes without uploads join their CPU branch on the GPU stream
    (HybridExperts._defers): on unless OSTINATO_DEFER_COMBINE=0, which keeps the host's wait (to
    time one against the other: scripts/device/run.sh ab_gguf with AB_ENV="OSTINATO_DEFER_COMBINE=0")."""
    v = os.environ.get("OSTINATO_DEFER_COMBINE", "1")
    if v not in ("0", "1", ""):
        raise ConfigError(f"OSTINATO_DEFER_COMBINE must be 1 (on) or 0 (off), not {v!r}")
    return v != "0"


def window_text(lo: int, hi: int | None) -> str:
    """Pass sizes lo to hi (None: no upper bound), as a report says them."""
    return f"{lo}-{hi}" if hi is not None else f"from {lo}"


def choose_path(T: int, has_cold: bool, upload_threshold: int | None, mixed: MixedPass | None) -> str:
    """The path of a pass of T tokens through a layer (DESIGN.md, "Three execution paths"):
    "gpu" (every expert of the layer resident), "upload" (T >= upload_threshold; never with
    None; a split pass with uploads takes over from the upload path where `mixed` applies to
    T), or "split" (GPU branch || CPU branch; with uploads where `mixed` applies to T)."""
    if not has_cold:
        return "gpu"
    if upload_threshold is not None and T >= upload_threshold and (mixed is None or not mixed.applies(T)):
        return "upload"
    return "split"


def cpu_routes(cid: np.ndarray, cold: np.ndarray, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The CPU branch's routes of a pass, on the host: cid [T, K] each route's compact index in
    host memory, cold [T, K] the routes it computes -> (token int32, compact expert, weight) each.
    numpy: a cache's decode step does this once per MoE layer between two graph segments, where
    torch's per-op overhead on [K]-sized tensors would be most of the cost."""
    return (torch.from_numpy(cold.nonzero()[0].astype(np.int32)), torch.from_numpy(cid[cold]),
            torch.from_numpy(weights.numpy()[cold]))


def upload_plan(ids: np.ndarray, cold: np.ndarray, num_experts: int, choose: Callable[[np.ndarray, int], int],
                limit: int) -> np.ndarray:
    """The cold experts a split pass uploads (ids, cold [T, K] on the host): the most-routed
    first (a tie: the lower id), as many as `choose` says given their cold routes, most first,
    and the `limit` flex slots (MixedPass.choose). numpy: this runs on the host
    between a layer's routing and its branches, while the GPU waits; the host's whole part of a
    split pass with uploads took 777 µs a layer with torch's ops and 398 µs with numpy's at 256
    tokens, 1554 and 467 µs at 1024, on the 2-core development host (scripts/bench_split_host.py)."""
    counts = np.bincount(ids[cold], minlength=num_experts)
    experts = np.flatnonzero(counts)
    order = experts[np.argsort(-counts[experts], kind="stable")]
    return order[:choose(counts[order], limit)]


def flex_slots(ids: np.ndarray, cold: np.ndarray, up: np.ndarray, dst, zero: np.ndarray):
    """The slots of a split pass whose experts `up` go into the flex slots `dst` (ids, cold [T, K]
    on the host; zero: the zero slot of each top-k position), built on the host: nothing here may
    wait for the GPU, or the CPU branch would start only after the copies (measured so: no overlap
    at all). -> (slots [T, K] int32: an uploaded expert's flex slot, else the zero slot; the cold
    routes left to the CPU)."""
    lookup = np.full(int(ids.max()) + 1, -1, dtype=np.int32)  # over every expert id the pass routes to
    lookup[up] = dst
    slot = lookup[ids]
    return torch.from_numpy(np.where(slot >= 0, slot, zero)), cold & (slot < 0)


def staging(pool: ExpertPool, n: int) -> range:
    """The slots a pass stages n uploaded experts in: the top of the pool's flex region, so that a
    cache (which keeps its entries at the bottom of it) and the upload path never meet."""
    if n > pool.num_slots - pool.flex_lo:
        raise RuntimeError(f"{n} experts to stage exceed the {pool.num_slots - pool.flex_lo} flex slots")
    return range(pool.num_slots - n, pool.num_slots)


class Admission:
    """A residency that changes at run time (a cache, policies/caches.py), run by HybridExperts:
    for each pass it admits, which of the pass's missing experts enter the pool. It changes the
    placement through HybridExperts.switch only, and returns the copies to make."""

    hybrid: "HybridExperts"

    def admits(self, T: int) -> bool:
        """Whether a pass of T tokens may change the cache."""
        raise NotImplementedError

    def admit(self, layer: int, ids: np.ndarray) -> list[tuple[int, int]]:
        """ids [T, K] of an admitted pass -> (expert, slot) to copy from host memory before it
        runs; the tables already place them there (and no longer place what they evicted)."""
        raise NotImplementedError

    def entries(self, pool: ExpertPool) -> int:
        """The slots of `pool`'s flex region the cache keeps its entries in (the bottom ones)."""
        raise NotImplementedError

    def resident_experts(self) -> int:
        """The cache's slots."""
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        return {}


class HybridWrapper(MoEBackend):
    """A decode-graph form of a HybridExperts (the handshake, layers/moe/graph_hybrid.py; a cache's
    segments, layers/moe/segmented.py): it answers for the executor it wraps and hands it every
    pass it does not capture itself."""

    def __init__(self, hybrid: "HybridExperts"):
        self.hybrid, self.device = hybrid, hybrid.device

    @property
    def unwrapped(self) -> "HybridExperts":
        return self.hybrid

    def many(self, layer: int, xs: list[torch.Tensor], topks: list[TopKOutput]) -> list[torch.Tensor]:
        """A pass of several chunks is host-driven, never a captured step's or a capture's warm-up
        (MoEBackend.many): the executor takes it, as __call__ hands it such passes."""
        return self.hybrid.many(layer, xs, topks)

    @property
    def offload_threshold(self) -> int | None:
        return self.hybrid.offload_threshold

    @offload_threshold.setter
    def offload_threshold(self, n: int | None) -> None:
        self.hybrid.offload_threshold = n

    @property
    def cpu(self):
        return self.hybrid.cpu

    def resident_experts(self) -> int:
        return self.hybrid.resident_experts()

    def graph_rows(self, rows: int) -> int:
        return self.hybrid.graph_rows(rows)

    def after_decode_step(self) -> None:
        self.hybrid.after_decode_step()

    def before_prefill(self) -> None:
        self.hybrid.before_prefill()

    def settle(self) -> None:
        self.hybrid.settle()

    def close(self) -> None:
        self.hybrid.close()

    def stats(self) -> dict[str, float]:
        return self.hybrid.stats()


class HybridExperts(MoEBackend):
    """The one executor of a static placement (Ostinato and the static baselines): the pool's
    resident experts on the GPU in every pass, the rest by the pass's path (choose_path).
    upload_threshold: Np, or None for a placement without an upload path; upload_all: the upload
    path copies every cold expert of the layer, not only those the pass routes to
    (KTransformers' rule). Every layer's experts come from its pool (`pools.of(layer)`: one per
    expert format, so no code here knows the format)."""

    def __init__(self, pools: ExpertPools | ExpertPool, host: HostExperts, cpu, upload_threshold: int | None,
                 max_tokens: int, layers: list[int] | None = None, upload_all: bool = False):
        """pools: the GPU's pools (one ExpertPool is read as a single group); layers: the MoE layers
        this backend serves (default: every layer of the host tables; a device of a split model
        serves its own range, its HostExperts holds every layer's)."""
        self.pools = pools if isinstance(pools, ExpertPools) else ExpertPools([pools])
        self.host, self.cpu = host, cpu
        self.upload_threshold = upload_threshold  # Np
        self.upload_all = upload_all
        self.device = self.pools.device
        self.on_cuda = self.device.type == "cuda"
        D = self.pools.hidden
        pin = self.on_cuda
        # host staging for the CPU branch, allocated once
        self.x_host = torch.empty((max_tokens, D), dtype=self.pools.dtype, pin_memory=pin)
        self.out_host = torch.empty((max_tokens, D), dtype=torch.float32, pin_memory=pin)
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self.counters: Counter = Counter()
        # routes and cold routes of captured decode steps and passes: device counters that every
        # replay updates (Python code runs once, at capture)
        self.graph_counts = torch.zeros(2, dtype=torch.int64, device=self.device)
        self.step_rows: StepRows | None = None  # a captured pass's real rows, while it is captured
        layers = sorted(host.compact) if layers is None else layers
        self.has_cold = {l: bool((host.compact[l] >= 0).any()) for l in layers}  # in layer order
        self.borrow = None  # Borrowing, when decode may lend the flex slots to cold experts
        self.mixed: MixedPass | None = None  # split passes may upload their most-routed cold experts
        # captured passes may stage their most-routed cold experts (the split with uploads as a graph does it,
        # layers/moe/staging.py): Ostinato's placements (engine/placement.py apply_calibration), no baseline
        self.stage_passes = False
        self.stage_costs: MixedPass | None = None  # the calibrated costs, for the "balance" rule (staging.py)
        self.admission: Admission | None = None  # a cache's run-time residency (policies/caches.py)
        # numpy views of the index table rows and the compact tables (the same memory): the host
        # work of a cache's pass switches and reads them per expert
        self._table = {l: self.pools.of(l).table_host[l].numpy() for l in layers}
        self._compact = {l: host.compact[l].numpy() for l in layers}
        self._dirty: set[int] = set()  # layers whose index table row the device has not seen yet
        # the deferred combine (_defers), unless OSTINATO_DEFER_COMBINE=0
        self.defer_combine = defer_combine()
        self._last_layer = next((l for l in reversed(self.has_cold) if self.has_cold[l]), None)
        self._word = self._hs = None  # the page-locked word the CPU pool announces a deferred call's end in
        self._word_value = 0
        if self.on_cuda and cpu is not None and getattr(cpu, "backend", None) == "native":
            from ostinato.kernels.triton import handshake

            self._hs = handshake
            self._word = handshake.HostPointer(torch.zeros(16, dtype=torch.int32, pin_memory=True))  # a 64-byte line

    @property
    def pool(self) -> ExpertPool:
        """The pool of a one-group placement (every float model); ConfigError with several."""
        return self.pools.single("this use of the pool")

    @property
    def max_tokens(self) -> int:
        """The most tokens one pass may have: the rows of the host staging buffers."""
        return self.x_host.shape[0]

    def hot_experts(self, layer: int) -> torch.Tensor:
        """The experts of a layer with a slot in its pool now (resident, or lent a flex slot)."""
        return (self.pools.of(layer).table_host[layer] >= 0).nonzero().flatten()

    def cold_experts(self, layer: int) -> torch.Tensor:
        """The experts of a layer held in host memory (the CPU branch's and the upload path's)."""
        return (self.host.compact[layer] >= 0).nonzero().flatten()

    def after_decode_step(self) -> None:
        if self.borrow is not None:
            self.borrow.end_step()

    def before_prefill(self) -> None:
        if self.borrow is not None:
            self.borrow.release_all()

    def settle(self) -> None:
        if self.cpu is not None:
            self.cpu.settle()

    def graph_rows(self, rows: int) -> int:
        """At most `rows`, below the dequantized path of any quantized pool (ExpertPools.graph_rows)."""
        return int(min(rows, self.pools.graph_rows()))

    def captures_pass(self, T: int) -> bool:
        """Every expert resident: any pass is the GPU branch alone (with cold experts, the handshake's
        wrapper says: graph_hybrid.py)."""
        return self.capturable and self.admission is None

    def splits(self, T: int) -> bool:
        """A pass of T tokens takes the split path without uploads in every layer with cold experts:
        below the upload threshold and outside the mixed passes' window."""
        return ((self.upload_threshold is None or T < self.upload_threshold)
                and not (self.mixed is not None and self.mixed.applies(T)))

    @property
    def capturable(self) -> bool:
        """A decode step can be captured as a graph when no layer needs the CPU (all experts
        resident); with cold experts the graph needs the handshake backend (graph_hybrid)."""
        return not any(self.has_cold.values())

    @property
    def offload_threshold(self) -> int | None:
        """Np (upload_threshold), as every backend names it."""
        return self.upload_threshold

    @offload_threshold.setter
    def offload_threshold(self, n: int | None) -> None:
        self.upload_threshold = n

    def resident_experts(self) -> int:
        return self.admission.resident_experts() if self.admission is not None else self.pools.num_hot

    def table_row(self, layer: int) -> np.ndarray:
        """The layer's index table on the host, expert -> pool slot or COLD (a numpy view: read it;
        change it through switch)."""
        return self._table[layer]

    def switch(self, layer: int, expert: int, slot: int) -> None:
        """Serve one expert from a pool slot (slot >= 0), or from host memory again (COLD), in both
        branches at once: the host tables now, the GPU branch's device table at the next publish()."""
        self._table[layer][expert] = slot
        self._compact[layer][expert] = COLD if slot >= 0 else int(self.host.rows[layer][expert])
        self._dirty.add(layer)

    def publish(self) -> None:
        """The switched rows of the index table to the device, in stream order: every kernel
        launched after this reads them."""
        for layer in self._dirty:
            pool = self.pools.of(layer)
            pool.table[layer].copy_(pool.table_host[layer], non_blocking=self.on_cuda)
        self._dirty.clear()

    def close(self) -> None:
        """Stop the CPU pool's threads, return the host experts' page-locked memory (both may be
        shared with the other devices' backends of a split model: closing twice is harmless)."""
        if self.cpu is not None:
            self.cpu.close()
        self.host.unpin()

    def stats(self) -> dict[str, float]:
        out = Counter(self.counters)
        routes, cold = self.graph_counts.tolist()
        out["routes"] += routes
        out["cold_routes"] += cold  # their CPU experts: the graph worker's count (graph_hybrid.py)
        out = dict(out)
        if self.borrow is not None:
            out |= self.borrow.stats()
        if self.admission is not None:
            out |= self.admission.stats()
        return out

    def before_step(self, rows: StepRows | None = None) -> None:
        self.step_rows = rows

    def after_step(self) -> None:
        self.step_rows = None

    def count_captured(self, layer: int, ids: torch.Tensor) -> None:
        """Count a captured step's routes on the device (capturable): a decode step's, or the real
        rows of a captured pass (step_rows). A step runs every layer this backend serves, each with
        the same routes per token: all of them are counted at the first, one launch a step rather
        than one a layer."""
        rows, n = self.step_rows, len(self.has_cold)
        if layer == next(iter(self.has_cold)):
            self.graph_counts[0] += ids.numel() * n if rows is None else (rows.count[0] * (ids.shape[1] * n)).long()
        if self.has_cold[layer]:
            cold = self.pools.of(layer).table[layer][ids] < 0
            self.graph_counts[1] += (cold if rows is None else cold & rows.valid[:, None]).sum()

    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        T, K = topk.ids.shape
        if self.on_cuda and torch.cuda.is_current_stream_capturing():
            self.count_captured(layer, topk.ids)
        else:
            self.counters["routes"] += T * K
        path = choose_path(T, self.has_cold[layer], self.upload_threshold, self.mixed)
        if path == "gpu":
            return self._gpu_only(layer, x, topk)
        if path == "upload":
            return self.upload_path(layer, x, topk)
        return self.split_path(layer, x, topk)

    def many(self, layer: int, xs: list[torch.Tensor], topks: list[TopKOutput]) -> list[torch.Tensor]:
        """The chunks of one pass through a layer (engine/devices.py forward_layer_major): those that take
        the upload path stage the layer's cold experts together, each wave once for all of them
        (upload_chunks); the others run one by one as __call__ runs them (the split path, with a cache's
        admission or a split with uploads; the GPU alone), after those."""
        up = [i for i, x in enumerate(xs)
              if choose_path(x.shape[0], self.has_cold[layer], self.upload_threshold, self.mixed) == "upload"]
        if len(up) < 2:
            return super().many(layer, xs, topks)
        for i in up:
            self.counters["routes"] += topks[i].ids.numel()
        outs = dict(zip(up, self.upload_chunks(layer, [xs[i] for i in up], [topks[i] for i in up])))
        return [outs.pop(i) if i in outs else self(layer, x, topk) for i, (x, topk) in enumerate(zip(xs, topks))]

    def _gpu_only(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        pool = self.pools.of(layer)
        # the fp32 sum rounded once to x's dtype in the combine: the value the split path's cast gives
        return pool.forward(x, pool.slots_for(layer, topk.ids), topk.weights, out_dtype=x.dtype)

    def split_path(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """Decode and split path: GPU branch || CPU branch, then combine. The CPU branch is
        handed its routes first and the GPU branch launched while it computes (launching a
        prefill's GPU branch takes the host about 0.6 ms, measured on the H200 machine). A
        cache admits the pass first: its copies and the table switch come before the GPU branch.
        Uploads part of the cold experts where `mixed` applies (MixedPass.choose says how many).
        Then the order is: the CPU branch (its routes
        are known once the uploads are chosen), the copies on the copy stream (issuing them takes
        the host two copy launches an expert), the GPU branch over the pool's experts, and only
        then the wait for the copies and the GEMM of the uploaded experts: the pool's experts never
        wait for copies they do not read (session 23's profile of the 235B shape: 7.7 ms of copies
        and 4.4 ms of expert kernels a layer, which had run one after the other)."""
        T = x.shape[0]
        if T == 1 and self.borrow is not None:
            self.borrow.observe(layer, topk.ids)
        ids_h, w_h, x_h, done = to_host(topk, x, self.x_host, self.on_cuda)
        if done is not None:
            done.synchronize()  # routing and activations are on the host
        cid, cold = self.route_cold(layer, ids_h)
        pool = self.pools.of(layer)
        up, slots = None, None
        if self.mixed is not None and self.mixed.applies(T) and cold.any():
            up = upload_plan(ids_h.numpy(), cold, pool.table.shape[1], self.mixed.choose, self.stage_room(pool))
            if len(up):
                self.counters["mixed_passes"] += 1
                dst, copies = self._stage(pool, layer, up.tolist())
                zero = np.arange(pool.zero_lo, pool.zero_hi, dtype=np.int32)[:topk.ids.shape[1]]
                slots, cold = flex_slots(ids_h.numpy(), cold, up, dst, zero)
        deferred = slots is None and self._defers(layer, T)
        out_h = self.submit_cold(layer, x_h, cid, cold, w_h, deferred)  # the CPU starts before the copies are issued
        uploaded = self._upload(layer, x, topk, copies, slots, done) if slots is not None else None
        gpu = pool.forward(x, pool.slots_for(layer, topk.ids), topk.weights, out_dtype=torch.float32)
        if uploaded is not None:
            gpu = gpu + uploaded()
        if out_h is not None and deferred:  # the stream, not the host, waits for the CPU branch's announced end
            self._hs.wait_value(self._word, self._word_value)
            self.counters["deferred_combines"] += 1
        elif self.cpu is not None:
            self.cpu.wait()  # this layer's call, or an earlier layer's deferred one: none outlives this layer
        if out_h is None:
            return gpu.to(x.dtype)
        return (gpu + out_h.to(self.device, non_blocking=self.on_cuda)).to(x.dtype)

    def _defers(self, layer: int, T: int) -> bool:
        """Whether this split pass joins its CPU branch on the stream (the deferred combine): the
        stream spins until the CPU pool announces the call's end in a page-locked word, and the host
        meanwhile launches the combine and the next layer up to its routing, where it syncs anyway;
        the next submit settles the call (CpuExperts.submit). On CUDA with the native CPU experts,
        for passes of more than one token (a decode step outside a graph keeps the host's wait), and
        never at the last layer this backend serves, whose pass must leave the CPU pool idle for the
        decode graph's worker and the next device. split_path asks only for passes that upload
        nothing. Why: at 64-253 tokens the host waited 0.9-2.2 ms a layer for the CPU branch, then
        spent 1.4-1.6 ms launching the next layer, in series (results/2026-12-05-h100-s31/). Deferred,
        the held-out turns of 64-255 new tokens took 0.73-0.76x as long and those below 64 as long
        (results/2026-12-05-h200-s32/: A/B/A on the H200); turns with uploads, whose CPU branch is
        short, took 1.03-1.10x as long (A's two runs differed by 0.94x), so they keep the host's wait."""
        return self.defer_combine and self._word is not None and T > 1 and layer != self._last_layer

    def route_cold(self, layer: int, ids_h: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """A pass's routing on the host (ids_h [T, K]) -> (cid, cold): each route's compact index in
        host memory (-1 for an expert in the pool) and the routes the CPU computes, after a cache
        admitted the pass; its routes that were cold when it began are counted."""
        missed = self.admit(layer, ids_h)
        cid = self._compact[layer][ids_h.numpy()]
        cold = cid >= 0
        self.counters["cold_routes"] += int(cold.sum()) + missed
        return cid, cold

    def admit(self, layer: int, ids_h: torch.Tensor) -> int:
        """A cache's admission of this pass's routing (ids_h [T, K] on the host), if it admits the
        pass: the copies into its slots and the switched tables, in stream order before the GPU
        branch. -> the pass's routes to the experts it copied (they were cold when it began)."""
        if self.admission is None or not self.admission.admits(ids_h.shape[0]):
            return 0
        ids = ids_h.numpy()
        uploads = self.admission.admit(layer, ids)
        self.publish()
        if not uploads:
            return 0
        pool = self.pools.of(layer)
        self.counters["bytes_uploaded"] += pool.upload([s for _, s in uploads], self.host, layer, [e for e, _ in uploads])
        self.counters["uploaded_experts"] += len(uploads)
        return int(np.isin(ids, [e for e, _ in uploads]).sum())

    def submit_cold(self, layer: int, x_h: torch.Tensor, cid: np.ndarray, cold: np.ndarray, w_h: torch.Tensor,
                    deferred: bool = False):
        """Hand the CPU pool the `cold` routes of a pass (cid [T, K] compact indices, on the host)
        -> the host buffer its partial sum lands in (ready after cpu.wait(), or, `deferred`, once the
        pool has stored the next `_word_value` into `_word`, its first int32), or None if none."""
        if not cold.any():
            return None
        tok, eids, wts = cpu_routes(cid, cold, w_h)
        self.counters["cpu_experts"] += int(np.count_nonzero(np.bincount(cid[cold])))
        out_h = self.out_host[:x_h.shape[0]]
        notify = None
        if deferred:
            self._word_value = self._word_value % (2**31 - 1) + 1  # never 0, the word's first value
            notify = (self._word.t, self._word_value)
        self.cpu.submit(layer, x_h, tok, eids, wts, out_h, notify=notify)
        return out_h

    def cpu_branch(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> Callable[[], None]:
        """A callable that runs the split path's CPU branch alone: the same cold routes from the
        same page-locked staging buffers (x is copied there now), with nothing else running and
        nothing counted (calibration times it against split_path's host part)."""
        ids_h, w_h = topk.ids.cpu(), topk.weights.cpu()
        x_h = self.x_host[:x.shape[0]]
        x_h.copy_(x)
        cid = self._compact[layer][ids_h.numpy()]
        tok, eids, wts = cpu_routes(cid, cid >= 0, w_h)
        out = self.out_host[:x.shape[0]]

        def run() -> None:
            self.cpu.submit(layer, x_h, tok, eids, wts, out)
            self.cpu.wait()

        return run

    def _upload(self, layer, x, topk, copies: tuple[list[int], list[int]], slots: torch.Tensor,
                ready) -> Callable[[], torch.Tensor]:
        """Make the copies (flex slots, experts: _stage's) on the copy stream, after `ready` (recorded
        behind every earlier reader of the flex slots). -> a callable that makes the current stream
        wait for the copies and returns the partial sum [T, D] fp32 of the experts staged for the pass
        over `slots` (flex_slots; the caller launches its other GPU work first)."""
        pool = self.pools.of(layer)
        if self.on_cuda:
            slots = slots.pin_memory().to(self.device, non_blocking=True)
        self._copy_in(layer, *copies, ready)

        def part() -> torch.Tensor:
            self.copies_landed()
            return pool.forward(x, slots, topk.weights, out_dtype=torch.float32)

        return part

    def forget_staged(self) -> None:
        """The next passes copy every expert they upload (ExpertPool.forget_staged)."""
        for pool in self.pools.groups:
            pool.forget_staged()

    def _stage(self, pool: ExpertPool, layer: int, experts: list[int]) -> tuple[list[int], tuple[list[int], list[int]]]:
        """Flex slots for the cold experts a pass uploads -> (a slot per expert, the copies to make: their
        slots and experts). A cache stages in the top of its flex region and copies them all (`staging`:
        its own entries lie below); every other placement finds a layer's experts still staged where a
        pass runs layer by layer (ExpertPool.stage), and they are not copied again."""
        if self.admission is not None:
            dst = list(staging(pool, len(experts)))
            return dst, (dst, experts)
        dst, todo = pool.stage(layer, experts)
        self.counters["restaged_experts"] += len(experts) - len(todo)
        return dst, ([dst[i] for i in todo], [experts[i] for i in todo])

    def _copy_in(self, layer: int, dst: list[int], experts: list[int], ready=None) -> None:
        """Issue the copies of `experts` (host ids) into the flex slots `dst` on the copy stream, once
        `ready` has passed (an event recorded behind the flex slots' earlier readers; None: all the
        current stream's work so far), and count them. The GEMM that reads them waits first
        (copies_landed)."""
        pool = self.pools.of(layer)
        with self.on_copy_stream(ready):
            nbytes = pool.upload(dst, self.host, layer, experts)
        self.counters["uploaded_experts"] += len(experts)
        self.counters["bytes_uploaded"] += nbytes

    @contextlib.contextmanager
    def on_copy_stream(self, ready=None, stream=None):
        """Work issued inside goes to the copy stream (or `stream`), once `ready` has passed (an event; None:
        all the current stream's work so far); off CUDA, in order. The uploads' copies (_copy_in) and a
        captured pass's staging copies (layers/moe/staging.py)."""
        stream = self.copy_stream if stream is None else stream
        if stream is None:
            yield
            return
        if ready is None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            stream.wait_event(ready)
        with torch.cuda.stream(stream):
            yield

    def copies_landed(self, event=None) -> None:
        """The current stream waits for the copies issued so far (on_copy_stream), or for those before
        `event` (an event recorded on the copy stream)."""
        if self.copy_stream is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_stream(self.copy_stream) if event is None else stream.wait_event(event)

    def stage_room(self, pool: ExpertPool) -> int:
        """How many experts one pass may stage at once in `pool`: its flex region, less a cache's
        entries (which lie below the slots it stages in: `staging`)."""
        return pool.num_slots - pool.flex_lo - (self.admission.entries(pool) if self.admission is not None else 0)

    def upload_path(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """Upload path of a pass of one chunk (upload_chunks)."""
        return self.upload_chunks(layer, [x], [topk])[0]

    def upload_chunks(self, layer: int, xs: list[torch.Tensor], topks: list[TopKOutput]) -> list[torch.Tensor]:
        """Upload path of the chunks of a pass through a layer (one, or several run layer by layer: many):
        each distinct cold expert of the chunks (upload_all: of the layer) once into a flex slot, then every
        chunk's routes to it, all on the GPU; with more of them than the pass may stage at once (stage_room),
        in waves of that many (module docstring), each wave's GEMMs for every chunk before the next wave's
        copies take the slots; with no slot to stage in, the split path. Each chunk keeps its fp32 sum until
        the last wave (planner/capacity.py activation_bytes counts every chunk's)."""
        pool = self.pools.of(layer)
        table = pool.table[layer]
        cold = [table[t.ids] < 0 for t in topks]
        if self.upload_all:
            cold_ids = self.cold_experts(layer)
        else:
            cold_ids = torch.unique(torch.cat([t.ids[c] for t, c in zip(topks, cold)])).cpu()
        n, room = cold_ids.numel(), self.stage_room(pool)
        if not n:
            return [pool.forward(x, pool.slots_for(layer, t.ids), t.weights, out_dtype=x.dtype)
                    for x, t in zip(xs, topks)]
        if not room:
            return [self.split_path(layer, x, t) for x, t in zip(xs, topks)]
        # counted now, while the stream is idle after the sync above: a host read after the GEMMs
        # below would hold the host until they end
        self.counters["cold_routes"] += int(sum(c.sum() for c in cold))
        if n > room:  # the experts an earlier pass left staged go first, in the wave that finds them there
            self.counters["wave_passes"] += 1
            held = pool.staged(layer)
            cold_ids = cold_ids[torch.tensor([e not in held for e in cold_ids.tolist()]).argsort(stable=True)]
        outs = None
        for lo in range(0, n, room):
            wave = cold_ids[lo:lo + room]
            dst, copies = self._stage(pool, layer, wave.tolist())
            self._copy_in(layer, *copies)  # once the slots' earlier readers (the previous wave's GEMMs) are done
            if outs is None:  # the pool's experts while the first wave's copies run, then each wave's (split_path)
                outs = [pool.forward(x, pool.slots_for(layer, t.ids), t.weights, out_dtype=torch.float32)
                        for x, t in zip(xs, topks)]
            flex = torch.full((table.shape[0],), -1, dtype=torch.int32, device=self.device)
            flex[wave.to(self.device)] = torch.tensor(dst, dtype=torch.int32).to(self.device)
            self.copies_landed()
            for x, t, out in zip(xs, topks, outs):
                out += pool.forward(x, pool.slots_in(flex, t.ids), t.weights, out_dtype=torch.float32)
        for i, x in enumerate(xs):  # one chunk's fp32 sum let go at a time
            outs[i] = outs[i].to(x.dtype)
        return outs
