"""The GPU half of the handshake's captured passes (kernels/triton/handshake.py post_rows,
wait_add_rows) under TRITON_INTERPRET=1 on the CPU, against what the worker's protocol expects:
the B rows' routing and the n real rows' activations in the shared buffers (with a staging pass's marks of the experts
it computes on the GPU), n and has_cold over the n real rows only, the flag last; then the worker's partial copied into the join's device rows and added to the n
rows alone. (On CUDA they run inside
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
    h_x, h_out = torch.full((T, D), -7.0), torch.randn(T, D, generator=g)
    flags = torch.zeros(4, 16, dtype=torch.int32)  # has_cold, post, tokens, done
    h_has, h_post, h_tok, h_done = (flags[i, :1] for i in range(4))
    pick = torch.rand(E, generator=g) < 0.5  # the experts a staging pass computes on the GPU
    h_staged = torch.full((E + 3,), 9, dtype=torch.uint8)
    marks = (pick.view(torch.uint8), h_staged) if case == "cold" else ()
    hs.post_rows(ids, w, x, table, seq, count, h_ids, h_w, h_x, h_has, h_post, h_tok, *marks)
    assert torch.equal(h_ids[:B], ids.int()) and torch.equal(h_w[:B], w) and torch.equal(h_x[:n], x[:n]), case
    assert (h_x[n:] == -7).all(), case  # the padding rows' activations stay on the device
    if marks:  # posted as they are; past E untouched
        assert torch.equal(h_staged[:E], pick.to(torch.uint8)) and (h_staged[E:] == 9).all(), h_staged
    else:
        assert (h_staged == 9).all(), case
    assert (h_ids[B:] == -5).all(), case  # rows past B untouched
    cold = case == "cold"
    assert int(h_tok) == n and int(h_post) == 7 and int(h_has) == (7 if cold else 0), (case, flags)
    h_done.fill_(7)  # the worker answered step 7
    gpu = torch.randn(B, D, generator=g)
    want = gpu.clone()
    if cold:
        want[:n] += h_out[:n]
    for h in (h_out, hs.HostPointer(h_out)):  # the worker's buffer as a tensor, or as the kernels' pointer
        join = hs.CopyJoin(T, D, "cpu")  # the B rows copied first, then added
        join.rows.fill_(float("nan"))
        join.cold.fill_(-1)
        y = torch.empty(B, D)
        hs.wait_add_rows(gpu, h, h_has, h_done, seq, count, y, join)
        assert torch.equal(y, want) and torch.equal(join.rows[:B], h_out[:B]), case
        assert join.rows[B:].isnan().all(), case  # rows past B are not copied
        assert int(join.cold) == int(h_has), case  # has_cold as the wait read it
print("INTERPRETER_OK")
"""


def test_post_rows_and_wait_add_rows_under_interpreter():
    run_interpreted(SCRIPT, timeout=300)


WRAPPER_SCRIPT = """
import atexit
import torch
from ostinato.kernels.triton import handshake as hs
from ostinato.layers.moe.backend import StepRows
from ostinato.layers.moe.graph_hybrid import GraphHybridExperts
from ostinato.layers.moe.hybrid import cpu_routes
from ostinato.layers.moe.types import TopKOutput
from test_hybrid import LAYERS, E, K, D, _hybrid

# The interpreter runs a kernel on copies of its arguments and writes them back at its end (the flag
# last: post_rows passes it last), so a spin inside a kernel never sees the worker: the join's spin
# runs here, on the live memory, and the add kernel after it as on the GPU.
hs.HostPointer = lambda t: t


class Spin:
    def __getitem__(self, grid):
        def spin(h_has_cold, h_done, seq, cold, num_warps=1):
            cold[0] = h_has_cold[0]
            if int(h_has_cold[0]) != 0:
                while int(h_done[0]) != int(seq[0]):
                    pass
        return spin


hs._wait_rows = Spin()


def toward_zero(t):
    return (t.view(torch.int32) & -65536).view(torch.float32).bfloat16()

hybrid, _ = _hybrid(0.5, None, backend="native", dtype=torch.bfloat16)
graphed = GraphHybridExperts(hybrid, max_rows=16)
atexit.unregister(graphed.stop)  # its stop() synchronises CUDA; the worker alone is stopped here
g = torch.Generator().manual_seed(3)
try:
    for B, n in ((16, 11), (8, 8), (16, 3), (4, 1)):
        x = torch.randn(B, D, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)])
        w = torch.rand(B, K, generator=g)
        topk = TopKOutput(ids, w / w.sum(1, keepdim=True))
        rows = StepRows(torch.tensor([n], dtype=torch.int32), torch.arange(B) < n)
        graphed.before_step(rows)
        got = [graphed(l, x, topk) for l in LAYERS]  # the handshake: post, the worker, the join
        graphed.after_step()
        for l, y in zip(LAYERS, got):
            # the fp32 sum of both branches, as split_path forms it from the same pieces (the worker's
            # partial of the n rows: CpuExperts on their cold routes), rounded as this interpreter rounds
            # fp32 to bf16 (toward zero; a GPU rounds to nearest even, as split_path's cast does)
            pool = hybrid.pools.of(l)
            gpu = pool.forward(x, pool.slots_for(l, ids), topk.weights, out_dtype=torch.float32)[:n]
            cid = hybrid._compact[l][ids[:n].numpy()]
            cpu = hybrid.cpu.forward(l, x[:n].contiguous(), *cpu_routes(cid, cid >= 0, topk.weights[:n]))
            assert torch.equal(y[:n], toward_zero(gpu + cpu)), (B, n, l)
            split = hybrid.split_path(l, x, topk)[:n].float()
            assert ((y[:n].float() - split).abs() <= 2**-7 * split.abs()).all(), (B, n, l)
    s = graphed.worker.stats()
    assert s["steps"] == 4 and s["bad_tokens"] == s["errors"] == s["desync"] == 0, s
finally:
    graphed.worker.stop()
print("INTERPRETER_OK")
"""


def test_graph_wrapper_rows_match_split_path_under_interpreter():
    """GraphHybridExperts' captured passes end to end on the CPU: its handshake kernels under the
    interpreter beside the native worker (both on host memory; the join's spin in Python, see the
    script), passes of n of B rows: each layer's real rows are the fp32 sum of the GPU branch over the B
    rows and CpuExperts' partial of the n rows, bit for bit, rounded once (as split_path joins them), and
    within a bf16 step of split_path itself; the worker's steps are counted."""
    from ostinato.kernels.cpu import build

    if build.load_cpu_extension() is None or not build.load_cpu_extension().cpu_features()["avx512"]:
        pytest.skip("needs the native CPU experts (AVX-512)")
    run_interpreted(WRAPPER_SCRIPT, timeout=600)

