"""The expert pools of one GPU and the host copies of the cold experts.

Pool slots (equal size, one tensor per weight, allocated once, before anything else):

  [0, S)            hot experts of every MoE layer the pool serves, packed
  [S, S + K)        K zero slots: a cold route at top-k position j reads slot S + j,
                    so the GPU always computes exactly K slots per token (fixed shapes)
  [S + K, S + K + U) flexible slots: the upload path stages a long pass's cold experts
                    here; decode may lend them to borrowed experts

Ostinato's U is a format group's most cold experts of a layer (what a pass routing to all of them
stages), at most the plan's bound `max_flex` (planner/capacity.py: a DeepSeek-V3 layer's 256 cold
experts would take 21 GiB); an upload-path pass with more distinct cold experts than U uploads them
in waves of U (layers/moe/hybrid.py). `bounded_flex` says how many.

The index table maps (layer, expert) -> slot, or -1 for "cold". Host memory holds only
the cold experts (page-locked once, in place), compacted per layer, so a resident
expert keeps no second copy.

A pool knows its format: bf16 (or fp32) weights, or GGUF blocks (uint8 rows of
(qt13, qt2), ostinato/quant/formats.py) that the kernels dequantize inside; `forward` is
the one GPU-branch call, so no caller knows which. Slots must be of one size, and a
Q4_K_M file gives some layers Q6_K down projections, so the layers of a GPU are grouped
by their format, one pool per group (`ExpertPools`, `of(layer)`); a bf16 model is one
group. Zero slots are zero bytes: every block format here decodes them to 0.

The experts' activation (config.ExpertAct, e.g. gpt-oss's clamped SwiGLU) is a property of the
pool and of the host copies, and experts with biases (gpt-oss) keep them beside the weights,
fp32, slot for slot: b13[N, 2F] and b2[N, D] in a pool, [n, 2F] and [n, D] per layer on the
host; a zero slot's biases are zeros and never read.

Legend: S hot slots, K top-k, U flexible slots, E experts, F expert FFN, D hidden.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from ostinato.config import ConfigError
from ostinato.kernels.triton import fused_dense
from ostinato.layers.moe.gpu_experts import slot_experts_forward
from ostinato.layers.moe.gpu_quant import dequant_from, quant_tuning, slot_experts_quant_forward
from ostinato.config import SILU, ExpertAct
from ostinato.layers.moe.types import ExpertWeights, QuantExpertWeights
from ostinato.quant.formats import row_bytes

COLD = -1

Qtypes = tuple[str, str] | None  # (qt13, qt2) of GGUF blocks, or None for float weights


def gather_rows(src: torch.Tensor, ids: torch.Tensor, chunk: int = 8):
    """(i, src[ids[i:i + chunk]]) for i = 0, chunk, ...: a layer's chosen experts gathered a few at
    a time, so that copying them out never holds a second copy of the whole layer on src's device
    (a cache's host copies take all 128 experts of a layer generated on the GPU: 768 MiB for the 30B
    model's w13, which a pool near the cap cannot spare)."""
    ids = ids.to(src.device)
    for i in range(0, ids.numel(), chunk):
        yield i, src[ids[i:i + chunk]]


def stored_shapes(shape13, shape2, qtypes: Qtypes):
    """The per-expert tensor shapes as stored: [2F, D] and [D, F] floats, or their byte rows
    [2F, row_bytes(qt13, D)] and [D, row_bytes(qt2, F)]."""
    if qtypes is None:
        return tuple(shape13), tuple(shape2)
    return (shape13[0], row_bytes(qtypes[0], shape13[1])), (shape2[0], row_bytes(qtypes[1], shape2[1]))


def expert_nbytes(shape13, shape2, qtypes: Qtypes, dtype: torch.dtype, bias: bool = False) -> int:
    """Bytes of one expert (gate, up, down, and its fp32 biases if `bias`) as a pool slot holds it:
    in dtype, or in its blocks."""
    s13, s2 = stored_shapes(shape13, shape2, qtypes)
    elt = 1 if qtypes is not None else torch.empty((), dtype=dtype).element_size()
    return (s13[0] * s13[1] + s2[0] * s2[1]) * elt + (bias_floats(shape13, shape2) * 4 if bias else 0)


def bias_floats(shape13, shape2) -> int:
    """fp32 values of one expert's biases: 2F + D."""
    return shape13[0] + shape2[0]


class ExpertPool:
    def __init__(self, hot: dict[int, list[int]], num_layers: int, num_experts: int, top_k: int,
                 flex_slots: int, shape13: tuple[int, int], shape2: tuple[int, int], device, dtype,
                 qtypes: Qtypes = None, *, act: ExpertAct = SILU, bias: bool = False):
        """hot: the experts resident in this pool per layer it serves (its keys are its layers);
        dtype: the activations' dtype, and the weights' unless qtypes gives their block formats;
        act: the experts' activation; bias: the experts have biases (slots for them beside)."""
        self.layers = sorted(hot)
        self.qtypes = tuple(qtypes) if qtypes is not None else None
        self.dtype = dtype
        self.act = act
        self.top_k, self.hidden = top_k, shape2[0]
        self.num_hot = sum(len(v) for v in hot.values())
        self.zero_lo, self.zero_hi = self.num_hot, self.num_hot + top_k
        self.flex_lo, self.num_slots = self.zero_hi, self.zero_hi + flex_slots
        self.device = torch.device(device)
        s13, s2 = stored_shapes(shape13, shape2, self.qtypes)
        wdtype = dtype if self.qtypes is None else torch.uint8
        self.w13 = torch.empty((self.num_slots, *s13), device=device, dtype=wdtype)  # [N, 2F, D] (or bytes)
        self.w2 = torch.empty((self.num_slots, *s2), device=device, dtype=wdtype)  # [N, D, F] (or bytes)
        self.w13[self.zero_lo:self.zero_hi].zero_()
        self.w2[self.zero_lo:self.zero_hi].zero_()
        self.b13 = torch.zeros((self.num_slots, shape13[0]), device=device) if bias else None  # [N, 2F] fp32
        self.b2 = torch.zeros((self.num_slots, shape2[0]), device=device) if bias else None  # [N, D] fp32
        table = torch.full((num_layers, num_experts), COLD, dtype=torch.int32)
        slot = 0
        for layer in sorted(hot):
            for e in sorted(hot[layer]):
                table[layer, e] = slot
                slot += 1
        self.table = table.to(device)  # [layers, E] int32
        self.table_host = table
        self.zero_of_position = torch.arange(self.zero_lo, self.zero_hi, dtype=torch.int32, device=device)
        self._slot_views = None
        # whose copy each flex slot holds, kept by upload() (the only writer of flex slots): slot -> (layer, expert)
        self._flex: dict[int, tuple[int, int]] = {}

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes + (self.b13.nbytes + self.b2.nbytes if self.b13 is not None else 0)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one slot (one expert in this pool's format, its biases included)."""
        biases = self.b13[0].nbytes + self.b2[0].nbytes if self.b13 is not None else 0
        return self.w13[0].nbytes + self.w2[0].nbytes + biases

    @property
    def format(self) -> str:
        """'Q4_K/Q6_K' or 'bfloat16': for reports and messages."""
        return "/".join(self.qtypes) if self.qtypes else str(self.dtype).removeprefix("torch.")

    def graph_rows(self) -> float:
        """The most rows a captured pass may run through this pool's kernels: below the device's
        dequant_min_tokens where its quantized experts would take the dequantized path there, which finds
        a pass's distinct experts on the host (torch.unique) and so cannot be captured; else unbounded."""
        if self.qtypes is None:
            return float("inf")
        return dequant_from(quant_tuning(self.device), self.dtype) - 1

    @staticmethod
    def bytes_for(slots: int, expert_bytes: int) -> int:
        return slots * expert_bytes

    def forward(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, out_dtype=None, out=None,
                max_distinct=None) -> torch.Tensor:
        """The GPU branch over this pool's slots: out[T, D] = sum over the K slots of each token
        (x[T, D], slots[T, K] from slots_for, weights[T, K] fp32), in the pool's format's kernels
        (Triton on CUDA, capturable; plain torch on the CPU)."""
        epi = dict(b13_pool=self.b13, b2_pool=self.b2, act=self.act)
        if self.qtypes is None:
            return slot_experts_forward(x, slots, weights, self.w13, self.w2, self.zero_lo, self.zero_hi, out,
                                        out_dtype=out_dtype, max_distinct=max_distinct, **epi)
        return slot_experts_quant_forward(x, slots, weights, self.w13, self.w2, self.zero_lo, self.zero_hi, out,
                                          qtypes=self.qtypes, out_dtype=out_dtype, max_distinct=max_distinct, **epi)

    def fill_layer(self, layer: int, experts: ExpertWeights | QuantExpertWeights) -> None:
        """Copy the hot experts of one layer (from any device, in this pool's format) into their slots."""
        self._check_format(layer, experts)
        row = self.table_host[layer]
        ids = (row >= 0).nonzero().flatten()
        slots = row[ids].long().to(self.device)
        pairs = [(self.w13, experts.w13), (self.w2, experts.w2)]
        if self.b13 is not None:
            pairs += [(self.b13, experts.b13), (self.b2, experts.b2)]
        for dst, src in pairs:
            for i, rows in gather_rows(src, ids):
                dst[slots[i:i + len(rows)]] = rows.to(self.device, dst.dtype, non_blocking=True)

    def _check_format(self, layer: int, experts) -> None:
        qtypes = (experts.qt13, experts.qt2) if isinstance(experts, QuantExpertWeights) else None
        if qtypes != self.qtypes:
            got = "/".join(qtypes) if qtypes else "float"
            raise ConfigError(f"layer {layer}: experts in {got} cannot fill a pool of {self.format} slots")
        check_same_math(layer, experts, self.act, self.b13 is not None, "pool")

    def upload(self, slots: Sequence[int], host: "HostExperts", layer: int, experts: Sequence[int]) -> int:
        """Copy cold experts of `layer` from page-locked host memory into pool slots (slots[i] gets
        experts[i]), asynchronously on the current stream; returns the bytes copied. One
        torch._foreach_copy_ over views made once, whose loop issues the copies in C++: the host
        issues them while the GPU branch waits to be launched (HybridExperts.split_path), and two
        copy_ calls from Python an expert, with their indexing, took it 36 us an expert on the
        development host against 3-6 for the batch (scripts/bench_split_host.py --uploads 30)."""
        if not len(experts):
            return 0
        rows = host.row_list(layer)
        src_rows = [rows[e] for e in experts]
        if min(src_rows) < 0:
            raise ValueError(f"layer {layer}: experts {[e for e, r in zip(experts, src_rows) if r < 0]} have no host copy")
        dst, src = [], []
        for pool_rows, host_rows in zip(self.slot_views(), host.row_views(layer)):
            dst += [pool_rows[s] for s in slots]
            src += [host_rows[i] for i in src_rows]
        torch._foreach_copy_(dst, src, non_blocking=self.device.type == "cuda")
        self._flex.update((s, (layer, e)) for s, e in zip(slots, experts) if s >= self.flex_lo)
        return len(src_rows) * self.expert_bytes

    def forget_staged(self) -> None:
        """Stage as if every flex slot held someone else's copy (a calibration timing one layer's pass
        again and again must copy its experts each time, as a pass whose other layers ran between)."""
        self._flex.clear()

    def staged(self, layer: int) -> set[int]:
        """The experts of `layer` whose copies flex slots still hold (stage keeps them there)."""
        return {e for l, e in self._flex.values() if l == layer}

    def stage(self, layer: int, experts: Sequence[int]) -> tuple[list[int], list[int]]:
        """Flex slots for cold experts of `layer` that a pass uploads: an expert whose copy a flex slot
        still holds keeps that slot (a pass run layer by layer whose chunks stage one by one, as
        splits with uploads do, finds the previous chunk's there: engine/devices.py
        forward_layer_major), the others take the other flex slots from the top down. -> (a slot per
        expert, the positions in `experts` whose copies must still be made)."""
        if len(experts) > self.num_slots - self.flex_lo:
            raise RuntimeError(f"{len(experts)} experts to stage exceed the {self.num_slots - self.flex_lo} flex slots")
        held = {e: s for s, (l, e) in self._flex.items() if l == layer}
        slots = [held.get(e, -1) for e in experts]
        taken = {s for s in slots if s >= 0}
        free = (s for s in range(self.num_slots - 1, self.flex_lo - 1, -1) if s not in taken)
        todo = [i for i, s in enumerate(slots) if s < 0]
        for i in todo:
            slots[i] = next(free)
        return slots, todo

    def slot_views(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Each weight tensor's slots as views (w13, w2, and the biases if any), made once."""
        if self._slot_views is None:
            weights = (self.w13, self.w2) + ((self.b13, self.b2) if self.b13 is not None else ())
            self._slot_views = tuple(w.unbind(0) for w in weights)
        return self._slot_views

    def slots_for(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, K] -> slots [T, K] int32: hot experts' slots, cold ones the zero slot of
        their top-k position. No host sync: capturable. On CUDA in one launch (kernels/triton/route.py)."""
        return self.slots_in(self.table[layer], ids)

    def slots_in(self, row: torch.Tensor, ids: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
        """slots_for through another index row [E] int32 (a slot, or < 0 for the zero slot): the
        upload path's row of the experts it copied into flex slots. count [1] int32 on the device (a
        captured pass's StepRows.count): the rows from it on, padding, get the zero slots, so the
        kernels skip them."""
        if ids.is_cuda and fused_dense():
            from ostinato.kernels.triton.route import lookup_slots

            return lookup_slots(row, ids, self.zero_lo, count)
        slot = row[ids]
        use = slot >= 0
        if count is not None:
            use &= (torch.arange(ids.shape[0], device=ids.device) < count)[:, None]
        return torch.where(use, slot, self.zero_of_position[: ids.shape[1]])


def group_layers(layers, qtypes: dict[int, Qtypes] | None) -> dict[Qtypes, list[int]]:
    """Layers by expert format (qtypes: each layer's (qt13, qt2), None or absent: float), in layer
    order: one pool per group, the order of ExpertPools.groups."""
    groups: dict[Qtypes, list[int]] = {}
    for layer in sorted(layers):
        groups.setdefault((qtypes or {}).get(layer), []).append(layer)
    return groups


def group_flex(flex, qt: Qtypes, layers: list[int], hot: dict[int, list[int]], num_experts: int) -> int:
    """A format group's flex slots: `flex` slots, a dict {qtypes: slots}, or None for the group's
    most cold experts of a layer."""
    if isinstance(flex, dict):
        return flex[qt]
    if flex is None:
        return max(num_experts - len(hot.get(l, [])) for l in layers)
    return flex


def bounded_flex(hot: dict[int, list[int]], num_experts: int, qtypes: dict[int, Qtypes] | None,
                 max_flex: int | None) -> dict[Qtypes, int]:
    """Ostinato's flex slots per format group (a `flex` dict for ExpertPools.build and pools_bytes):
    the group's most cold experts of a layer, at most `max_flex` (the plan's bound, Residency.max_flex;
    None: unbounded, as plans made before the bound)."""
    out = {}
    for qt, layers in group_layers(hot, qtypes).items():
        n = group_flex(None, qt, layers, hot, num_experts)
        out[qt] = n if max_flex is None else min(n, max_flex)
    return out


class ExpertPools:
    """The expert pools of one GPU, one per expert format (a group of layers whose experts
    have one byte size); `of(layer)` is the pool that serves a layer. A bf16 model has one."""

    def __init__(self, pools: list[ExpertPool]):
        if not pools:
            raise ValueError("ExpertPools needs at least one pool")
        self.groups = list(pools)
        self._of = {l: p for p in self.groups for l in p.layers}
        first = self.groups[0]
        self.device, self.dtype, self.hidden, self.top_k = first.device, first.dtype, first.hidden, first.top_k

    @classmethod
    def build(cls, hot: dict[int, list[int]], num_layers: int, num_experts: int, top_k: int,
              flex: int | dict | None, shape13, shape2, device, dtype, qtypes: dict[int, Qtypes] | None = None, *,
              act: ExpertAct = SILU, bias: bool = False) -> "ExpertPools":
        """A pool per format of the layers in `hot` (qtypes: each layer's (qt13, qt2) or None; default:
        all float); flex: each pool's flex slots (group_flex); act, bias: the experts' activation and
        whether they have biases (every pool alike)."""
        return cls([ExpertPool({l: hot[l] for l in layers}, num_layers, num_experts, top_k,
                               group_flex(flex, qt, layers, hot, num_experts), shape13, shape2, device, dtype, qt,
                               act=act, bias=bias)
                    for qt, layers in group_layers(hot, qtypes).items()])

    def of(self, layer: int) -> ExpertPool:
        if len(self.groups) == 1:
            return self.groups[0]
        return self._of[layer]

    def single(self, what: str) -> ExpertPool:
        """The one pool, for what works on one pool only (ConfigError naming `what` otherwise)."""
        if len(self.groups) > 1:
            fmts = ", ".join(p.format for p in self.groups)
            raise ConfigError(f"{what} works on one expert pool, but this placement has {len(self.groups)} "
                              f"(one per expert format: {fmts}); turn it off, or load the experts as bf16")
        return self.groups[0]

    @property
    def num_hot(self) -> int:
        return sum(p.num_hot for p in self.groups)

    def graph_rows(self) -> float:
        """The most rows a captured pass may run through every pool (ExpertPool.graph_rows)."""
        return min(p.graph_rows() for p in self.groups)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.groups)

    def fill_layer(self, layer: int, experts) -> None:
        self.of(layer).fill_layer(layer, experts)

    def describe(self) -> dict[str, dict]:
        """Per group: its layers, slots and bytes (for reports)."""
        return {p.format: {"layers": p.layers, "hot": p.num_hot, "slots": p.num_slots, "flex": p.num_slots - p.flex_lo,
                           "expert_bytes": p.expert_bytes, "bytes": p.nbytes} for p in self.groups}


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
    # cudaHostRegisterPortable (1): page-locked for every GPU's context (a split model uploads to each);
    # cudaHostRegisterMapped (2): in the devices' address space, where a captured pass's staging kernel reads
    # it through the host pointer (layers/moe/staging.py; the same address under UVA on x86-64 Linux)
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 1 | 2)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed with error {int(rc)}")
    return weakref.finalize(t, torch.cuda.cudart().cudaHostUnregister, t.data_ptr())


class HostExperts:
    """The cold experts of every layer, compacted, each layer in its format (float, or GGUF blocks
    as QuantExpertWeights), in one page-locked host buffer per format for w13 and one for w2
    (and fp32 ones for the biases of experts that have them); rows[layer][e] is the expert's
    index in its layer's stack, or -1; compact[layer][e] the same for the experts the CPU branch
    computes (-1 also for a copy now served from a pool slot: borrowed, or cached)."""

    def __init__(self, cold: dict[int, list[int]], num_experts: int, shape13, shape2, dtype,
                 qtypes: dict[int, Qtypes] | None = None, *, act: ExpertAct = SILU, bias: bool = False):
        """qtypes: each layer's (qt13, qt2) of GGUF blocks, or None (default for all): dtype weights;
        act, bias: the experts' activation and whether they have biases."""
        self.act, self.bias = act, bias
        groups = group_layers(cold, qtypes)
        self._pins = []
        self.pinned = True
        self.layers: dict[int, ExpertWeights | QuantExpertWeights] = {}
        # compact: what the CPU branch computes (an expert switched into a pool slot reads COLD here);
        # rows: where each expert's copy lies, for good (uploads read it)
        self.compact: dict[int, torch.Tensor] = {}
        self.rows: dict[int, torch.Tensor] = {}
        for qt, layers in groups.items():
            s13, s2 = stored_shapes(shape13, shape2, qt)
            wdtype = dtype if qt is None else torch.uint8
            total = sum(len(cold[l]) for l in layers)
            w13_all = torch.empty((total, *s13), dtype=wdtype)
            w2_all = torch.empty((total, *s2), dtype=wdtype)
            buffers = [w13_all, w2_all]
            if bias:
                b13_all, b2_all = torch.zeros((total, shape13[0])), torch.zeros((total, shape2[0]))  # fp32
                buffers += [b13_all, b2_all]
            pins = [p for p in map(pin_in_place, buffers) if p is not None]
            self._pins += pins
            self.pinned = self.pinned and len(pins) == len(buffers)
            start = 0
            for layer in layers:
                ids = sorted(cold[layer])
                n = len(ids)
                w13, w2 = w13_all[start:start + n], w2_all[start:start + n]
                b13, b2 = (b13_all[start:start + n], b2_all[start:start + n]) if bias else (None, None)
                self.layers[layer] = (ExpertWeights(w13, w2, b13, b2, act) if qt is None
                                      else QuantExpertWeights(qt[0], w13, qt[1], w2, b13, b2, act))
                c = torch.full((num_experts,), COLD, dtype=torch.int32)
                c[ids] = torch.arange(n, dtype=torch.int32)
                self.compact[layer] = c
                self.rows[layer] = c.clone()
                start += n
        self.pinned = self.pinned and bool(self._pins)
        self.kept = False  # keep(): a store whose buffers other placements' copies are views of
        self._row_views: dict[int, tuple] = {}
        self._row_lists: dict[int, list[int]] = {}

    def holds_every_expert(self) -> bool:
        """Whether every layer's stack holds all its experts in id order (a placement with none resident):
        a store that any placement's host copies can be views of (`over`)."""
        return bool(self.rows) and all(torch.equal(r, torch.arange(r.numel(), dtype=r.dtype))
                                       for r in self.rows.values())

    def keep(self) -> None:
        """Make these copies a store (holds_every_expert) that outlives the placement that built them: its
        unpin() does nothing from now on, as placements built later read views of its buffers, and
        the buffers stay page-locked until they are collected with the last view (pin_in_place). Why: a
        bench builds one placement per policy, and each loaded its experts from the model's files again: the
        placement took 167 s of a 175 s build for DeepSeek-V3-shaped under 24 GiB on an H100
        (results/2026-12-07-h100-s51/; likely the page cache unable to hold the 90 GB file beside 80 GB of
        page-locked copies)."""
        if not self.holds_every_expert():
            raise ValueError("only host copies of every expert of each layer can be kept as a store")
        self.kept = True

    @classmethod
    def over(cls, store: "HostExperts", cold: dict[int, list[int]]) -> "HostExperts":
        """Host copies of the `cold` experts as views of a kept store's stacks: nothing copied, nothing
        pinned again. Each layer's stack holds every expert (its hot ones too, never read: compact and
        rows name the cold ones alone); fill_layer is not needed."""
        if not store.kept:
            raise ValueError("HostExperts.over takes a kept store (keep())")
        self = cls.__new__(cls)
        self.act, self.bias, self.kept = store.act, store.bias, False
        self._pins, self.pinned = [], store.pinned  # the store's pins, released with its buffers
        self.layers, self.compact, self.rows = {}, {}, {}
        for layer, ids in cold.items():
            if not ids:
                continue
            self.layers[layer] = store.layers[layer]
            c, ids = torch.full_like(store.rows[layer], COLD), sorted(ids)
            c[ids] = store.rows[layer][ids]
            self.compact[layer] = c
            self.rows[layer] = c.clone()
        self._row_views, self._row_lists = {}, {}
        return self

    def row_list(self, layer: int) -> list[int]:
        """rows[layer] as Python ints (made once: rows never change)."""
        if layer not in self._row_lists:
            self._row_lists[layer] = self.rows[layer].tolist()
        return self._row_lists[layer]

    def row_views(self, layer: int) -> tuple[tuple[torch.Tensor, ...], ...]:
        """A layer's stacks as views of each expert's row (w13, w2, and the biases if any), made once."""
        if layer not in self._row_views:
            w = self.layers[layer]
            self._row_views[layer] = tuple(t.unbind(0) for t in (w.w13, w.w2) + ((w.b13, w.b2) if self.bias else ()))
        return self._row_views[layer]

    def unpin(self) -> None:
        """Unregister the page-locked buffers now (before they are freed, so that a later
        placement in the same process can register memory at the same addresses); not for a kept
        store (keep())."""
        if self.kept:
            return
        for p in self._pins:
            p()
        self._pins, self.pinned = [], False

    def fill_layer(self, layer: int, experts: ExpertWeights | QuantExpertWeights) -> None:
        c = self.compact[layer]
        ids = (c >= 0).nonzero().flatten()
        if ids.numel():
            dst = self.layers[layer]
            if isinstance(dst, QuantExpertWeights) != isinstance(experts, QuantExpertWeights):
                raise ConfigError(f"layer {layer}: host experts and the loaded experts differ in format")
            check_same_math(layer, experts, self.act, self.bias, "host copy")
            pairs = [(dst.w13, experts.w13), (dst.w2, experts.w2)]
            if self.bias:
                pairs += [(dst.b13, experts.b13), (dst.b2, experts.b2)]
            for d, src in pairs:  # straight into page-locked memory, from any device
                for i, rows in gather_rows(src, ids):
                    d[i:i + len(rows)].copy_(rows)


def check_same_math(layer: int, experts, act: ExpertAct, bias: bool, where: str) -> None:
    """ConfigError unless the loaded experts compute what the pool or host copy was built for."""
    if experts.act != act or (experts.b13 is not None) != bias:
        got = f"{experts.act.kind}{' with biases' if experts.b13 is not None else ''}"
        want = f"{act.kind}{' with biases' if bias else ''}"
        raise ConfigError(f"layer {layer}: experts computing {got} cannot fill a {where} built for {want}")
