"""The launch plan of the split-K decode attention (decode_attention.py), in plain Python: rows a
split program, keys a tl.dot block, warps, the window's splits, and the fp32 partials they leave.
No triton here, so the planner (planner/capacity.py) sizes a captured pass's partials by the rules
the kernel launches by, on a machine without triton.

Legend: T query tokens, G query heads a KV head (T*G rows a KV head), Hkv KV heads, Dv value
width, W window (keys), NS splits of it.

Two plans by the value width, since a split program keeps its fp32 acc [BLOCK_R, Dv] in registers:
- narrow (Dv <= NARROW_DV: the heads of Qwen3, GLM-4-MoE, gpt-oss): T = 1 pads the G heads to
  max(16, G) rows, one block; T > 1 takes blocks of at most 64 rows (an acc [64, 128]: 64 fp32
  registers a thread over 4 warps); BLOCK_N keys a block, NUM_WARPS warps.
- wide (MLA in the latent space: one KV head of R + Dr = 512 + 64 key columns whose first R are
  the values, G = H = 128 query heads as its rows): at most 32 rows, WIDE_BLOCK_N = 32 keys a
  block, 8 warps. With 256 threads the acc [32, 512] takes 64 registers a thread and the bf16
  query [32, 576] about 36, beside the score tiles, within the 255 a thread may hold (64 rows
  would need 128 + 72 and spill); the two pipeline stages of K [576, 32] and V [32, 512] tiles
  take 2 x 68 KiB of shared memory (64 keys: 272 KiB, over an H100's 227). In fp32 those tiles
  double: one stage (136 KiB). Chosen by this count, not by a timing.
Splits (split_plan): the window in chunks of at least MIN_CHUNK keys, at most MAX_SPLITS for the
row blocks of one token. A pass whose rows fill more blocks gets proportionally fewer splits
(max_splits), so its programs stay about a decode step's (Hkv x decode's blocks x MAX_SPLITS: 256
for Qwen3-30B-A3B's 4 KV heads, 4 x 64 for V3's 128 latent rows) and its partials about as large,
until its blocks outnumber those programs and take one split each (partials_bytes).
"""
from __future__ import annotations

from typing import NamedTuple

BLOCK_N = 64  # keys per tl.dot block (narrow)
MIN_CHUNK = 64  # keys per split, at least
MAX_SPLITS = 64  # splits of one token's row blocks, at most
NUM_WARPS = 4  # narrow
NUM_STAGES = 2
NARROW_DV = 128  # the widest value of the narrow plan
WIDE_ROWS, WIDE_BLOCK_N, WIDE_NUM_WARPS = 32, 32, 8  # the wide plan's most rows, keys a block, warps


class LaunchPlan(NamedTuple):
    """How decode_attention launches: rows a split program, keys a block, warps, pipeline stages of the
    K and V tiles, keys a split, splits."""

    block_r: int
    block_n: int
    num_warps: int
    num_stages: int
    chunk: int
    splits: int


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def split_plan(window: int, chunk: int | None = None, block_n: int = BLOCK_N,
               max_splits: int = MAX_SPLITS) -> tuple[int, int]:
    """(CHUNK, NS) for a window of W keys: chunks a multiple of block_n, at most max_splits of them
    (a function of W and the overrides only). NS need not grow with W (W = 4097: 33 chunks of 128),
    but its cap min(max_splits, cdiv(W, MIN_CHUNK)) does: partials_bytes counts that."""
    if chunk is None:
        splits = max(1, min(max_splits, cdiv(window, MIN_CHUNK)))
        chunk = cdiv(cdiv(window, splits), block_n) * block_n
    return chunk, cdiv(window, chunk)


def row_block(T: int, G: int, dv: int) -> int:
    """BLOCK_R, the query rows t*G + g of one split program (tl.dot needs M >= 16): narrow T = 1,
    the G heads padded, one block (as decode always ran); narrow T > 1, at most 64 rows a block;
    wide (dv > NARROW_DV), at most WIDE_ROWS for every T. Each block reads the split's K and V
    (from L2, after the first)."""
    if dv > NARROW_DV:
        return max(16, min(WIDE_ROWS, next_power_of_2(T * G)))
    if T == 1:
        return max(16, next_power_of_2(G))
    return max(16, min(64, next_power_of_2(T * G)))


def max_splits(T: int, G: int, dv: int, block_r: int | None = None) -> int:
    """Splits a KV head's T*G rows may take: MAX_SPLITS for the row blocks of one token, divided
    among the blocks of T tokens (one each beyond), so programs and partials stay about decode's."""
    if block_r is None:
        block_r = row_block(T, G, dv)
    return max(1, MAX_SPLITS * cdiv(G, row_block(1, G, dv)) // cdiv(T * G, block_r))


def launch_plan(T: int, G: int, dv: int, window: int, *, itemsize: int = 2, chunk: int | None = None,
                block_n: int | None = None, block_r: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None) -> LaunchPlan:
    """The plan of T tokens' G rows a KV head over W keys with values Dv wide, of itemsize bytes;
    chunk, block_n, block_r, num_warps, num_stages override the defaults (tests, tuning)."""
    wide = dv > NARROW_DV
    block_n = block_n or (WIDE_BLOCK_N if wide else BLOCK_N)
    block_r = block_r or row_block(T, G, dv)
    for b in (block_n, block_r):
        assert b >= 16 and b & (b - 1) == 0, "tl.dot: blocks a power of two >= 16"
    chunk, splits = split_plan(window, chunk, block_n, max_splits(T, G, dv, block_r))
    return LaunchPlan(block_r, block_n, num_warps or (WIDE_NUM_WARPS if wide else NUM_WARPS),
                      num_stages or (1 if wide and itemsize > 2 else NUM_STAGES), chunk, splits)


def partials_bytes(T: int, G: int, kv_heads: int, dv: int, window: int) -> int:
    """The most bytes of fp32 partials decode_attention allocates under the default plan for T tokens
    over any window of at most W keys: each row's max m and sum l and its Dv sums, for every KV head
    and split, [Hkv, NS, T*G] x (Dv + 2)."""
    splits = max(1, min(max_splits(T, G, dv), cdiv(window, MIN_CHUNK)))
    return kv_heads * splits * T * G * (dv + 2) * 4
