"""The expert pool of one GPU and the host copies of the cold experts.

Pool slots (equal size, one tensor per weight, allocated once, before anything else):

  [0, S)            hot experts of every MoE layer placed on this GPU, packed
  [S, S + K)        K zero slots: a cold route at top-k position j reads slot S + j,
                    so the GPU always computes exactly K slots per token (fixed shapes)
  [S + K, S + K + U) flexible slots: the upload path stages a long pass's cold experts
                    here; decode may lend them to borrowed experts

The index table maps (layer, expert) -> slot, or -1 for "cold". Host memory holds only
the cold experts (page-locked once, in place), compacted per layer, so a resident
expert keeps no second copy.

Legend: S hot slots, K top-k, U flexible slots, E experts, F expert FFN, D hidden.
"""
from __future__ import annotations

import weakref

import torch

from ostinato.layers.moe.types import ExpertWeights

COLD = -1


class ExpertPool:
    def __init__(self, hot: dict[int, list[int]], num_layers: int, num_experts: int, top_k: int,
                 flex_slots: int, shape13: tuple[int, int], shape2: tuple[int, int], device, dtype):
        self.num_hot = sum(len(v) for v in hot.values())
        self.zero_lo, self.zero_hi = self.num_hot, self.num_hot + top_k
        self.flex_lo, self.num_slots = self.zero_hi, self.zero_hi + flex_slots
        self.device = torch.device(device)
        self.w13 = torch.empty((self.num_slots, *shape13), device=device, dtype=dtype)  # [N, 2F, D]
        self.w2 = torch.empty((self.num_slots, *shape2), device=device, dtype=dtype)  # [N, D, F]
        self.w13[self.zero_lo:self.zero_hi].zero_()
        self.w2[self.zero_lo:self.zero_hi].zero_()
        table = torch.full((num_layers, num_experts), COLD, dtype=torch.int32)
        slot = 0
        for layer in sorted(hot):
            for e in sorted(hot[layer]):
                table[layer, e] = slot
                slot += 1
        self.table = table.to(device)  # [layers, E] int32
        self.table_host = table
        self.zero_of_position = torch.arange(self.zero_lo, self.zero_hi, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    @staticmethod
    def bytes_for(slots: int, expert_bytes: int) -> int:
        return slots * expert_bytes

    def fill_layer(self, layer: int, experts: ExpertWeights) -> None:
        """Copy the hot experts of one layer (from any device) into their slots."""
        row = self.table_host[layer]
        ids = (row >= 0).nonzero().flatten()
        if ids.numel():
            slots = row[ids].long().to(self.device)
            src = ids.to(experts.w13.device)
            self.w13[slots] = experts.w13[src].to(self.device, non_blocking=True)
            self.w2[slots] = experts.w2[src].to(self.device, non_blocking=True)

    def upload(self, slot: int, host: "HostExperts", layer: int, expert: int) -> int:
        """Copy one cold expert from page-locked host memory into `slot`, asynchronously on the
        current stream; returns the bytes copied."""
        hw, i = host.layers[layer], int(host.compact[layer][expert])
        nb = self.device.type == "cuda"
        self.w13[slot].copy_(hw.w13[i], non_blocking=nb)
        self.w2[slot].copy_(hw.w2[i], non_blocking=nb)
        return hw.w13[i].nbytes + hw.w2[i].nbytes

    def slots_for(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, K] -> slots [T, K] int32: hot experts' slots, cold ones the zero slot of
        their top-k position. No host sync: capturable."""
        slot = self.table[layer][ids]
        return torch.where(slot >= 0, slot, self.zero_of_position[: ids.shape[1]])


def pin_in_place(t: torch.Tensor) -> weakref.finalize | None:
    """Page-lock an existing host tensor without copying it (cudaHostRegister).

    torch's pinned allocator rounds every block up to a power of two, which would cost
    tens of GB on top of the 35 GB of cold experts; registering the memory we already
    have costs nothing extra. Returns the unregistration (call it to unpin early; it runs
    by itself when t is collected, so freed memory never stays registered: a later
    registration at the same address would fail with "already mapped"), or None where
    there is no CUDA.
    """
    if not torch.cuda.is_available() or t.numel() == 0:
        return None
    # cudaHostRegisterPortable: page-locked for every GPU's context (a split model uploads to each)
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 1)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed with error {int(rc)}")
    return weakref.finalize(t, torch.cuda.cudart().cudaHostUnregister, t.data_ptr())


class HostExperts:
    """The cold experts of every layer, compacted, in one page-locked host buffer each for
    w13 and w2; compact[layer][e] is the expert's index in its layer's stack, or -1."""

    def __init__(self, cold: dict[int, list[int]], num_experts: int, shape13, shape2, dtype):
        total = sum(len(v) for v in cold.values())
        self.w13_all = torch.empty((total, *shape13), dtype=dtype)
        self.w2_all = torch.empty((total, *shape2), dtype=dtype)
        self._pins = [p for p in (pin_in_place(self.w13_all), pin_in_place(self.w2_all)) if p is not None]
        self.pinned = len(self._pins) == 2
        self.layers: dict[int, ExpertWeights] = {}
        self.compact: dict[int, torch.Tensor] = {}
        start = 0
        for layer in sorted(cold):
            ids = sorted(cold[layer])
            n = len(ids)
            self.layers[layer] = ExpertWeights(self.w13_all[start:start + n], self.w2_all[start:start + n])
            c = torch.full((num_experts,), COLD, dtype=torch.int32)
            c[ids] = torch.arange(n, dtype=torch.int32)
            self.compact[layer] = c
            start += n

    def unpin(self) -> None:
        """Unregister the page-locked buffers now (before they are freed, so that a later
        placement in the same process can register memory at the same addresses)."""
        for p in self._pins:
            p()
        self._pins, self.pinned = [], False

    def fill_layer(self, layer: int, experts: ExpertWeights) -> None:
        c = self.compact[layer]
        ids = (c >= 0).nonzero().flatten()
        if ids.numel():
            dst = self.layers[layer]
            src = ids.to(experts.w13.device)
            dst.w13.copy_(experts.w13[src])  # straight into page-locked memory, from any device
            dst.w2.copy_(experts.w2[src])
