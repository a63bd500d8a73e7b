"""The KV of other conversations than the slot's, kept in host memory for when they return.

An agent sends side requests (a title, a summary, a sub-agent) between the turns of its
session; each would overwrite the slot, and the next turn would prefill the whole
conversation again. `Conversations` keeps copies of the slot's KV for the most recent
other conversations, least recently used dropped first; the engine (session.py) decides
when to copy out and back.

The copies live in `HostBlocks`: host memory in blocks of positions, page-locked in place
beside a GPU (cudaHostRegister). It keeps what it grew, so a freed block serves the next
copy: the session's conversation is copied out at every side request, a little longer each
time, and registering memory costs far more than reusing it. For the same reason the engine
reserves one slot's worth of blocks when it is told to keep conversations, at load: new
memory is touched and registered then, while no request waits, and not by the request that
switches conversations first (a new session, or an agent's first side request), which would
pay the whole growth before its prefill. The price is that memory, held from the start even
by a server that never switches. Beyond it, the pool grows by what a copy needs.
torch's pinned allocator would reuse too, but it rounds every allocation up to a power of
two and keeps freed blocks cached outside any count. A block holds `block` positions of
every layer's cache tensors, so a copy wastes less than one block and takes L x tensors
copy calls per block. `--kv-cache-memory` caps the pool, the reserve and the blocks of the
copy being restored included: the host memory held never passes it, not even while a
request switches conversations.

Legend: L layers, B positions a block, S a cache tensor's per-token shape (kv_cache.py).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ostinato.layers.moe.pool import pin_in_place

log = logging.getLogger("ostinato.engine")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def kv_bytes(layers, n: int) -> int:
    """Bytes of n positions of every cache tensor of the slot's layers."""
    return n * sum(t[0].numel() * t.element_size() for layer in layers for t in layer.tensors.values())


def block_tokens(max_tokens: int) -> int:
    """Positions a block holds for a slot of max_tokens: a 32nd of it, between 16 and 2048."""
    return max(16, min(2048, max_tokens // 32))


def _slot_tokens(layers) -> int:
    return next(iter(layers[0].tensors.values())).shape[0]


def _sync(layers) -> None:
    for device in {layer.device for layer in layers if layer.device.type == "cuda"}:
        torch.cuda.synchronize(device)


class HostBlocks:
    """Blocks of host memory for copies of the slot's KV: block b holds, per cache tensor,
    [L, B, *S] (views[b][name]). Grown ahead (`reserve`) or on demand up to `max_bytes` (None:
    no cap), never shrunk."""

    def __init__(self, layers, block: int, max_bytes: int | None = None):
        first = layers[0].tensors
        self.layers, self.block, self.max_bytes = len(layers), block, max_bytes
        self.shapes = {name: tuple(t.shape[1:]) for name, t in first.items()}
        self.dtype = next(iter(first.values())).dtype
        self.gpu = any(layer.device.type == "cuda" for layer in layers)  # copies overlap, page-locked
        self.block_bytes = kv_bytes(layers, block)
        self.views: list[dict[str, torch.Tensor]] = []
        self.free: list[int] = []
        self.pinned = True  # every chunk is page-locked (False once one could not be)
        self._chunks: list[torch.Tensor] = []  # the allocations the views are carved from

    @property
    def nbytes(self) -> int:
        """Host memory the pool holds, free blocks included."""
        return len(self.views) * self.block_bytes

    def blocks_for(self, n: int) -> int:
        return -(-n // self.block)

    def fits(self, blocks: int) -> bool:
        return self.max_bytes is None or blocks * self.block_bytes <= self.max_bytes

    def take(self, count: int) -> list[int] | None:
        """`count` blocks, the pool grown if the cap allows; None: not without freeing some."""
        short = count - len(self.free)
        if short > 0:
            if not self.fits(len(self.views) + short):
                return None
            self._grow(short)
        out = self.free[len(self.free) - count:]
        del self.free[len(self.free) - count:]
        return out

    def give_back(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    def reserve(self, count: int) -> None:
        """Grow to `count` blocks, or as many as the cap allows, their pages faulted in now (beside
        a GPU, registering them does that too) rather than by the first copies into them."""
        if self.max_bytes is not None:
            count = min(count, self.max_bytes // self.block_bytes)
        if count > len(self.views):
            self._grow(count - len(self.views))
            self._chunks[-1].zero_()

    def _grow(self, count: int) -> None:
        per_block = self.layers * self.block * sum(math.prod(s) for s in self.shapes.values())
        flat = torch.empty(count * per_block, dtype=self.dtype)
        if self.gpu:
            try:
                self.pinned = self.pinned and pin_in_place(flat) is not None
            except RuntimeError as e:  # e.g. over the locked-memory limit: the copies are synchronous
                log.warning("page-locking %d bytes for saved conversations failed (%s)", flat.nbytes, e)
                self.pinned = False
        for b in range(count):
            at, views = b * per_block, {}
            for name, shape in self.shapes.items():
                size = self.layers * self.block * math.prod(shape)
                views[name], at = flat[at:at + size].view(self.layers, self.block, *shape), at + size
            self.free.append(len(self.views))
            self.views.append(views)
        self._chunks.append(flat)

    def copy_out(self, blocks: list[int], n: int, layers) -> None:
        """Positions [0, n) of the slot into `blocks`, in order."""
        for j, b in enumerate(blocks):
            start, end = j * self.block, min(n, (j + 1) * self.block)
            for name, view in self.views[b].items():
                for i, layer in enumerate(layers):
                    view[i, :end - start].copy_(layer.tensors[name][start:end], non_blocking=self.gpu)
        _sync(layers)  # the next forward overwrites what was copied

    def copy_in(self, blocks: list[int], start: int, n: int, layers) -> None:
        """Positions [start, n) from `blocks` back into the slot."""
        for j in range(start // self.block, self.blocks_for(n)):
            lo, hi = max(start, j * self.block), min(n, (j + 1) * self.block)
            for name, view in self.views[blocks[j]].items():
                for i, layer in enumerate(layers):
                    layer.tensors[name][lo:hi].copy_(view[i, lo - j * self.block:hi - j * self.block],
                                                     non_blocking=self.gpu)
        _sync(layers)


@dataclass
class SavedKV:
    tokens: list[int]
    blocks: list[int]  # in HostBlocks, in order: the j-th holds positions [jB, (j+1)B)


class Conversations:
    """The KV of up to `capacity` conversations besides the slot's, most recent last, in
    host memory of at most `max_bytes` (None: no cap but the count)."""

    def __init__(self, capacity: int = 0, max_bytes: int | None = None):
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.saved: list[SavedKV] = []
        self.taken: SavedKV | None = None  # out of the store, on its way into the slot
        self.host: HostBlocks | None = None  # made by reserve or the first copy, from the slot's shapes

    @property
    def nbytes(self) -> int:
        """Host memory the copies hold (the one being restored included)."""
        if self.host is None:
            return 0
        return sum(len(s.blocks) for s in self.kept()) * self.host.block_bytes

    @property
    def pool_bytes(self) -> int:
        """Host memory taken for copies, free blocks included (what the cap bounds)."""
        return 0 if self.host is None else self.host.nbytes

    def kept(self) -> list[SavedKV]:
        return self.saved + ([self.taken] if self.taken is not None else [])

    def clear(self) -> None:
        """Forget every copy; the pool keeps its blocks for the next ones."""
        for s in self.kept():
            self.host.give_back(s.blocks)
        self.saved, self.taken = [], None

    def reserve(self, layers) -> None:
        """The pool made now, with blocks for the whole slot (as many as the cap allows)."""
        if self.capacity > 0:
            host = self._pool(layers)
            host.reserve(host.blocks_for(_slot_tokens(layers)))

    def _pool(self, layers) -> HostBlocks:
        if self.host is None:
            self.host = HostBlocks(layers, block_tokens(_slot_tokens(layers)), self.max_bytes)
        return self.host

    def save(self, tokens: list[int], layers) -> None:
        """Copy the KV of `tokens` (the slot's first len(tokens) positions) out of the slot,
        dropping the least recently used copies to make room; a conversation larger than the
        room the cap can give it is not kept (and nothing is dropped for it)."""
        if self.capacity < 1 or not tokens:
            return
        host = self._pool(layers)
        need = host.blocks_for(len(tokens))
        if not host.fits(need + (len(self.taken.blocks) if self.taken is not None else 0)):
            return
        # a saved prefix of this conversation says nothing more: this one replaces it
        for s in [s for s in self.saved if common_prefix(s.tokens, tokens) == len(s.tokens)]:
            self._drop(s)
        while len(self.saved) >= self.capacity:
            self._drop(self.saved[0])
        while (blocks := host.take(need)) is None:
            self._drop(self.saved[0])  # fits() said dropping all of them makes room
        host.copy_out(blocks, len(tokens), layers)
        self.saved.append(SavedKV(list(tokens), blocks))

    def _drop(self, saved: SavedKV) -> None:
        self.saved.remove(saved)
        self.host.give_back(saved.blocks)

    def take(self, prompt: list[int], beyond: int) -> int:
        """The longest prefix `prompt` shares with a saved conversation, if longer than
        `beyond` (else 0); that conversation leaves the store for `restore`."""
        n, i = max(((common_prefix(s.tokens, prompt), i) for i, s in enumerate(self.saved)), default=(0, -1))
        if n <= beyond:
            return 0
        if self.taken is not None:  # a restore that failed half-way
            self.host.give_back(self.taken.blocks)
        self.taken = self.saved.pop(i)
        return n

    def restore(self, start: int, n: int, layers) -> None:
        """Copy positions [start, n) of the taken conversation back into the slot; its blocks
        are free then."""
        self.host.copy_in(self.taken.blocks, start, n, layers)
        self.host.give_back(self.taken.blocks)
        self.taken = None
