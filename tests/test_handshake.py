"""The GPU half of the handshake's captured passes (kernels/triton/handshake.py post_rows,
wait_add_rows) under TRITON_INTERPRET=1 on the CPU, against what the worker's protocol expects:
the B rows' routing and activations in the shared buffers, n and has_cold over the n real rows
only, the flag last; then the worker's partial added to the n rows alone. (On CUDA they run inside
tests/test_graph.py's captured passes.)

Legend: B rows of the pass, n real ones, T rows of the shared buffers, K top-k, D hidden, E experts.
"""
from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton")

SCRIPT = """
import torch
from ostinato.kernels.triton import handshake as hs

B, T, K, D, E = 6, 8, 4, 96, 16
g = torch.Generator().manual_seed(0)
for case in ("cold", "cold only in padding", "hot"):
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)])  # int64, as the router's
    w = torch.rand(B, K, generator=g)
    x = torch.randn(B, D, generator=g)
    table = torch.arange(E, dtype=torch.int32)  # every expert in a slot
    n = 4
    if case == "cold":
        table[ids[1, 2]] = -1
    elif case == "cold only in padding":  # expert 15, routed by row 5 alone
        ids[:n] = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(n)])
        ids[5] = torch.tensor([15, 0, 1, 2])
        table[15] = -1
    seq = torch.tensor([7], dtype=torch.int32)
    count = torch.tensor([n], dtype=torch.int32)
    h_ids, h_w = torch.full((T, K), -5, dtype=torch.int32), torch.zeros(T, K)
    h_x, h_out = torch.zeros(T, D), torch.randn(T, D, generator=g)
    flags = torch.zeros(4, 16, dtype=torch.int32)  # has_cold, post, tokens, done
    h_has, h_post, h_tok, h_done = (flags[i, :1] for i in range(4))
    hs.post_rows(ids, w, x, table, seq, count, h_ids, h_w, h_x, h_has, h_post, h_tok)
    assert torch.equal(h_ids[:B], ids.int()) and torch.equal(h_w[:B], w) and torch.equal(h_x[:B], x), case
    assert (h_ids[B:] == -5).all(), case  # rows past B untouched
    cold = case == "cold"
    assert int(h_tok) == n and int(h_post) == 7 and int(h_has) == (7 if cold else 0), (case, flags)
    h_done.fill_(7)  # the worker answered step 7
    gpu = torch.randn(B, D, generator=g)
    y = torch.empty(B, D)
    hs.wait_add_rows(gpu, h_out, h_has, h_done, seq, count, y)
    want = gpu.clone()
    if cold:
        want[:n] += h_out[:n]
    assert torch.equal(y, want), case
print("INTERPRETER_OK")
"""


def test_post_rows_and_wait_add_rows_under_interpreter():
    run_interpreted(SCRIPT, timeout=300)
