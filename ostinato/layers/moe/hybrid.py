"""The hybrid experts backend: hot routes from the GPU pool, cold routes on the CPU or
over PCIe, chosen by the size of the pass (DESIGN.md, "Three execution paths").

* decode (T = 1) and split (T < Np): the GPU computes every token's K slots from the
  pool (cold positions read a zero slot) while the CPU pool computes the cold routes
  from host memory; the routing and activations go to the host before the GPU branch
  is launched, so the two branches overlap; nothing but activations crosses PCIe.
* upload (T >= Np): each distinct cold expert of the pass is copied once into a flex
  slot of the pool, then the GPU computes everything; hot experts are never uploaded.

Both branches accumulate in fp32; the layer output is rounded to the activations'
dtype once, after the sum. On a machine without CUDA the "GPU" side runs on the CPU
device through the same code (torch path of the slot kernel), so CI covers all paths.

Legend: T tokens, K top-k, D hidden, R cold routes.
"""
from __future__ import annotations

from collections import Counter

import torch

from ostinato.layers.moe.gpu_experts import slot_experts_forward
from ostinato.layers.moe.pool import ExpertPool, HostExperts
from ostinato.layers.moe.types import TopKOutput


class HybridExperts:
    def __init__(self, pool: ExpertPool, host: HostExperts, cpu, upload_threshold: int, max_tokens: int,
                 layers: list[int] | None = None):
        """layers: the MoE layers this backend serves (default: every layer of the host tables;
        a device of a split model serves its own range, its HostExperts holds every layer's)."""
        self.pool, self.host, self.cpu = pool, host, cpu
        self.upload_threshold = upload_threshold  # Np
        self.device = pool.device
        self.on_cuda = self.device.type == "cuda"
        D = pool.w2.shape[1]
        pin = self.on_cuda
        # host staging for the CPU branch, allocated once
        self.x_host = torch.empty((max_tokens, D), dtype=pool.w13.dtype, pin_memory=pin)
        self.out_host = torch.empty((max_tokens, D), dtype=torch.float32, pin_memory=pin)
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self.counters: Counter = Counter()
        # routes and cold routes of captured decode steps: device counters that every replay
        # updates (Python code runs once, at capture)
        self.graph_counts = torch.zeros(2, dtype=torch.int64, device=self.device)
        layers = sorted(host.compact) if layers is None else layers
        self.has_cold = {l: bool((host.compact[l] >= 0).any()) for l in layers}  # in layer order
        self.borrow = None  # Borrowing, when decode may lend the flex slots to cold experts

    def after_decode_step(self) -> None:
        if self.borrow is not None:
            self.borrow.end_step()

    def before_prefill(self) -> None:
        if self.borrow is not None:
            self.borrow.release_all()

    @property
    def capturable(self) -> bool:
        """A decode step can be captured as a graph when no layer needs the CPU (all experts
        resident); with cold experts the graph needs the handshake backend (graph_hybrid)."""
        return not any(self.has_cold.values())

    def stats(self) -> dict[str, float]:
        out = Counter(self.counters)
        routes, cold = self.graph_counts.tolist()
        out["routes"] += routes
        out["cold_routes"] += cold
        out = dict(out)
        if self.borrow is not None:
            out |= self.borrow.stats()
        return out

    def count_captured(self, layer: int, ids: torch.Tensor) -> None:
        """Count a captured step's routes on the device (capturable)."""
        self.graph_counts[0] += ids.numel()
        if self.has_cold[layer]:
            self.graph_counts[1] += (self.pool.table[layer][ids] < 0).sum()

    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        T, K = topk.ids.shape
        if self.on_cuda and torch.cuda.is_current_stream_capturing():
            self.count_captured(layer, topk.ids)
        else:
            self.counters["routes"] += T * K
        if not self.has_cold[layer]:
            return self._gpu_only(layer, x, topk)
        if T >= self.upload_threshold:
            return self.upload_path(layer, x, topk)
        return self.split_path(layer, x, topk)

    def _gpu_only(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        slots = self.pool.slots_for(layer, topk.ids)
        return slot_experts_forward(x, slots, topk.weights, self.pool.w13, self.pool.w2, self.pool.zero_lo,
                                    self.pool.zero_hi, out_dtype=torch.float32).to(x.dtype)

    def split_path(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """Decode and split path: GPU branch || CPU branch, then combine."""
        T = x.shape[0]
        if T == 1 and self.borrow is not None:
            self.borrow.observe(layer, topk.ids)
        compact = self.host.compact[layer]
        ids_h = topk.ids.to("cpu", non_blocking=self.on_cuda)
        w_h = topk.weights.to("cpu", non_blocking=self.on_cuda)
        x_h = self.x_host[:T]
        x_h.copy_(x, non_blocking=self.on_cuda)
        done = torch.cuda.Event() if self.on_cuda else None
        if done is not None:
            done.record()
        slots = self.pool.slots_for(layer, topk.ids)
        gpu = slot_experts_forward(x, slots, topk.weights, self.pool.w13, self.pool.w2,
                                   self.pool.zero_lo, self.pool.zero_hi, out_dtype=torch.float32)
        if done is not None:
            done.synchronize()  # routing and activations are on the host; the GPU branch runs on
        cid = compact[ids_h]  # [T, K] compact index of cold experts, -1 for hot
        cold = cid >= 0
        r = int(cold.sum())
        if r == 0:
            return gpu.to(x.dtype)
        tok = cold.nonzero()[:, 0].to(torch.int32)
        self.counters["cold_routes"] += r
        self.counters["cpu_experts"] += int(torch.unique(cid[cold]).numel())
        out_h = self.out_host[:T]
        self.cpu.submit(layer, x_h, tok, cid[cold], w_h[cold], out_h)
        self.cpu.wait()
        return (gpu + out_h.to(self.device, non_blocking=self.on_cuda)).to(x.dtype)

    def upload_path(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """Upload path: each distinct cold expert once into a flex slot, all on the GPU."""
        pool = self.pool
        table = pool.table[layer]
        slot = table[topk.ids]
        cold_ids = torch.unique(topk.ids[slot < 0]).cpu()
        n = cold_ids.numel()
        if n > pool.num_slots - pool.flex_lo:
            raise RuntimeError(f"upload path: {n} cold experts exceed the {pool.num_slots - pool.flex_lo} flex slots")
        if n:
            dst = torch.arange(pool.flex_lo, pool.flex_lo + n)
            nbytes = sum(pool.upload(int(s), self.host, layer, int(e)) for s, e in zip(dst, cold_ids))
            lookup = table.clone()
            lookup[cold_ids.to(self.device)] = dst.to(self.device, torch.int32)
            slot = lookup[topk.ids]
            self.counters["cold_routes"] += int((table[topk.ids] < 0).sum())
            self.counters["uploaded_experts"] += n
            self.counters["bytes_uploaded"] += nbytes
        out = slot_experts_forward(x, slot, topk.weights, pool.w13, pool.w2, pool.zero_lo, pool.zero_hi,
                                   out_dtype=torch.float32)
        return out.to(x.dtype)
