"""Oracle tests of the GPU branch: slot experts against a plain per-token fp32 loop.

Legend: T tokens, K routes per token, D hidden, F expert FFN size, N pool slots.
CPU runs the torch path; CUDA (marked gpu) runs the Triton kernels, also under CUDA-graph
replay and repeated runs (bitwise). Where triton is importable, the kernels also run here
under TRITON_INTERPRET=1 in a subprocess (the variable must be set before triton loads).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F_

from ostinato.layers.moe.gpu_experts import (DEFAULT_TUNING, align_routes, padded_size,
                                             slot_experts_forward,
                                             slot_experts_triton)
from tests.triton_interpreter import capture, needs_cuda, run_interpreted

REPO = Path(__file__).resolve().parents[1]
D, F, K, E = 64, 32, 4, 16  # E: experts of the test layer, all resident
ZERO_LO, ZERO_HI = 10, 10 + K  # zero slots sit inside the pool: hot slots on both sides
N = E + K


def make_pool(dtype, device, nan_zero_slots=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(N, 2 * F, D, generator=g) / D**0.5
    w2 = torch.randn(N, D, F, generator=g) / F**0.5
    fill = float("nan") if nan_zero_slots else 0.0  # NaN proves the kernels never read them
    w13[ZERO_LO:ZERO_HI] = fill
    w2[ZERO_LO:ZERO_HI] = fill
    return w13.to(dtype).to(device), w2.to(dtype).to(device)


def make_routing(T, hot_fraction, device, seed=0):
    """slots[T, K] int32, weights[T, K] f32: round(hot_fraction * T*K) routes are hot."""
    g = torch.Generator().manual_seed(seed + 1)
    table = [s for s in range(N) if not ZERO_LO <= s < ZERO_HI]  # expert id -> slot
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, K]
    slots = torch.tensor(table)[ids]
    num_hot = round(hot_fraction * T * K)
    cold = torch.ones(T * K, dtype=torch.bool)
    cold[torch.randperm(T * K, generator=g)[:num_hot]] = False
    zero = (ZERO_LO + torch.arange(K)).expand(T, K)  # a cold route -> zero slot of its k
    slots = torch.where(cold.view(T, K), zero, slots).to(torch.int32)
    weights = torch.softmax(torch.randn(T, K, generator=g), -1)
    return slots.to(device), weights.to(device)


def reference_loop(x, slots, weights, w13, w2):
    """Per token, per route, fp32; cold routes skipped (their slot holds zeros)."""
    out = torch.zeros(x.shape[0], D, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(K):
            s = int(slots[t, k])
            if ZERO_LO <= s < ZERO_HI:
                continue
            xt = x[t].float().cpu()
            gate = w13[s, :F].float().cpu() @ xt
            up = w13[s, F:].float().cpu() @ xt
            out[t] += float(weights[t, k]) * (w2[s].float().cpu() @ (F_.silu(gate) * up))
    return out


def assert_close(got, want, dtype):
    err = (got.float().cpu() - want).abs().max().item()
    scale = want.abs().max().item() + 1e-6
    assert err / scale < (1e-2 if dtype != torch.float32 else 1e-5), (err, scale)


def forced(path: str, **overrides) -> dict:
    tuning = copy.deepcopy(DEFAULT_TUNING)
    tuning["decode_max_tokens"] = 10**9 if path == "decode" else 0
    tuning.update(overrides)
    return tuning


TOKENS = [1, 7, 64, 512]
HOT = [0.0, 0.5, 1.0]
DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hot", HOT)
@pytest.mark.parametrize("T", TOKENS)
def test_torch_path_matches_loop(T, hot, dtype):
    w13, w2 = make_pool(dtype, "cpu")
    x = torch.randn(T, D).to(dtype)
    slots, weights = make_routing(T, hot, "cpu", seed=T)
    out = slot_experts_forward(x, slots, weights, w13, w2, ZERO_LO, ZERO_HI)
    assert out.dtype == dtype and out.shape == (T, D)
    assert_close(out, reference_loop(x, slots, weights, w13, w2), dtype)
    if hot == 0.0:
        assert not out.any()


def test_torch_path_out_buffer_and_fp32_output():
    w13, w2 = make_pool(torch.bfloat16, "cpu")
    x = torch.randn(7, D).bfloat16()
    slots, weights = make_routing(7, 0.5, "cpu")
    ref = reference_loop(x, slots, weights, w13, w2)
    out = torch.empty(7, D, dtype=torch.float32)
    assert slot_experts_forward(x, slots, weights, w13, w2, ZERO_LO, ZERO_HI, out) is out
    assert_close(out, ref, torch.bfloat16)
    out2 = slot_experts_forward(x, slots, weights, w13, w2, ZERO_LO, ZERO_HI,
                                out_dtype=torch.float32)
    assert out2.dtype == torch.float32 and torch.equal(out, out2)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("hot", HOT)
@pytest.mark.parametrize("T", [1, 7, 64, 512])
def test_align_routes_invariants(T, hot, block_m):
    slots, _ = make_routing(T, hot, "cpu", seed=T + 7)
    aligned = align_routes(slots, ZERO_LO, ZERO_HI, block_m, max_distinct=E)
    R = T * K
    size = padded_size(R, block_m, E)
    assert aligned.sorted_routes.shape == (size,)
    assert aligned.block_slots.shape == (size // block_m,)
    used = int(aligned.num_padded)
    assert used % block_m == 0
    flat = slots.reshape(-1)
    hot_routes = [r for r in range(R) if not ZERO_LO <= int(flat[r]) < ZERO_HI]
    seen = []
    for b in range(used // block_m):
        routes = aligned.sorted_routes[b * block_m:(b + 1) * block_m].tolist()
        valid = [r for r in routes if r < R]
        assert valid and routes[:len(valid)] == valid  # padding only at a group's end
        assert all(int(flat[r]) == int(aligned.block_slots[b]) for r in valid)
        seen += valid
    assert sorted(seen) == hot_routes  # every hot route exactly once, no cold one


def test_tuned_file_overrides_defaults(tmp_path, monkeypatch):
    import json

    from ostinato.layers.moe import gpu_experts as ge

    monkeypatch.setattr(ge, "TUNED_DIR", tmp_path)
    (tmp_path / "moe_fake.json").write_text(json.dumps({
        "_meta": {"device": "fake"}, "decode_max_tokens": 3, "decode_w13": {"BLOCK_F": 8},
        "prefill": {"10": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4,
                           "num_stages": 2}}}))
    ge.load_tuning.cache_clear()
    try:
        tuning = ge.load_tuning("fake")
        assert "_meta" not in tuning and tuning["decode_max_tokens"] == 3
        assert tuning["decode_w13"]["BLOCK_F"] == 8  # merged over the defaults' other keys
        assert tuning["decode_w13"]["BLOCK_D"] == DEFAULT_TUNING["decode_w13"]["BLOCK_D"]
        assert ge.prefill_config(tuning, 5)["BLOCK_N"] == 32
        assert ge.prefill_config(tuning, 5000)["BLOCK_N"] == 32  # past the last bucket
        assert ge.prefill_config(tuning, 5, torch.float32)["BLOCK_K"] == 16
        assert ge.load_tuning("absent") == DEFAULT_TUNING
    finally:
        ge.load_tuning.cache_clear()


def check_align_kernels(device, cfg):
    """moe_prefill.align_forward lays routes out exactly as align_routes does."""
    from ostinato.kernels.triton.moe_prefill import align_forward

    for T, hot, block_m in [(1, 1.0, 16), (9, 0.5, 16), (20, 1.0, 16), (70, 0.5, 32), (6, 0.0, 16)]:
        slots, _ = make_routing(T, hot, device, seed=T)
        size = padded_size(T * K, block_m, E)
        want = align_routes(slots, ZERO_LO, ZERO_HI, block_m, E)
        got = align_forward(slots.int(), ZERO_LO, ZERO_HI, N, block_m, size, cfg)
        used = int(want.num_padded)
        assert int(got[2]) == used
        assert torch.equal(got[0][:used], want.sorted_routes[:used])
        assert torch.equal(got[1][:used // block_m], want.block_slots[:used // block_m])


def test_package_imports_without_triton():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # any import of triton now fails
        import torch
        from ostinato.layers.moe.gpu_experts import slot_experts_forward
        x = torch.randn(2, 8)
        slots = torch.zeros(2, 1, dtype=torch.int32)
        out = slot_experts_forward(x, slots, torch.ones(2, 1), torch.randn(1, 4, 8),
                                   torch.randn(1, 8, 2), 0, 1)
        assert not out.any()
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr


INTERPRETER_SCRIPT = """
    import torch
    import test_gpu_experts as t
    from ostinato.layers.moe.gpu_experts import slot_experts_triton
    ALIGN = {"backend": "triton", "CHUNK": 32, "SUB": 16, "TILE": 16, "ROWS": 2,
             "num_warps": 4, "scan_warps": 4}
    tiny = dict(decode_w13={"BLOCK_F": 16, "BLOCK_D": 32, "num_warps": 4, "num_stages": 3},
                decode_w2={"BLOCK_D": 16, "BLOCK_F": 16, "num_warps": 4, "num_stages": 2},
                combine={"BLOCK_D": 32, "num_warps": 4},
                align=ALIGN,
                prefill={"1": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16,
                                 "num_warps": 4, "num_stages": 2}})
    # The interpreter stores bf16 as uint16 and its tl.dot gets bf16 wrong, so prefill
    # (tl.dot) runs in fp32 and fp16 here; bf16 prefill is covered by the gpu tests.
    cases = [(torch.float32, p) for p in ("decode", "prefill")]
    cases += [(torch.float16, p) for p in ("decode", "prefill")] + [(torch.bfloat16, "decode")]
    for dtype, path in cases:
        w13, w2 = t.make_pool(dtype, "cpu", nan_zero_slots=True)
        for T, hot in [(1, 1.0), (7, 0.5), (20, 0.5), (5, 0.0)]:
            x = torch.randn(T, t.D).to(dtype)
            slots, weights = t.make_routing(T, hot, "cpu", seed=T)
            out = slot_experts_triton(x, slots, weights, w13, w2, t.ZERO_LO, t.ZERO_HI,
                                      out_dtype=torch.float32, max_distinct=t.E,
                                      tuning=t.forced(path, **tiny))
            ref = t.reference_loop(x, slots, weights, w13, w2)
            t.assert_close(out, ref, torch.bfloat16 if dtype != torch.float32 else dtype)
            if hot == 0.0:
                assert not out.any()
    t.check_align_kernels("cpu", ALIGN)
    print("INTERPRETER_OK")
"""


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    run_interpreted(INTERPRETER_SCRIPT, timeout=600)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ["auto", "decode", "prefill", "prefill_torch_align"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hot", HOT)
@pytest.mark.parametrize("T", TOKENS)
def test_cuda_matches_loop(T, hot, dtype, path):
    w13, w2 = make_pool(dtype, "cuda", nan_zero_slots=True)
    x = torch.randn(T, D).to(dtype).cuda()
    slots, weights = make_routing(T, hot, "cuda", seed=T)
    if path == "auto":
        out = slot_experts_forward(x, slots, weights, w13, w2, ZERO_LO, ZERO_HI, max_distinct=E)
    else:
        tuning = forced("decode" if path == "decode" else "prefill")
        if path == "prefill_torch_align":
            tuning["align"] = {"backend": "torch"}
        out = slot_experts_triton(x, slots, weights, w13, w2, ZERO_LO, ZERO_HI, max_distinct=E,
                                  tuning=tuning)
    assert out.dtype == dtype and out.shape == (T, D)
    assert_close(out, reference_loop(x.cpu(), slots.cpu(), weights.cpu(), w13.cpu(), w2.cpu()),
                 dtype)


@pytest.mark.gpu
@needs_cuda
def test_cuda_align_kernels_match_torch_align():
    check_align_kernels("cuda", DEFAULT_TUNING["align"])
    check_align_kernels("cuda", {"backend": "triton", "CHUNK": 64, "SUB": 32, "TILE": 32,
                                 "ROWS": 4, "num_warps": 4, "scan_warps": 4})


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path,T", [("decode", 4), ("prefill", 64), ("prefill", 512)])
def test_cuda_graph_replay_with_new_routing(path, T):
    dtype = torch.bfloat16
    w13, w2 = make_pool(dtype, "cuda", nan_zero_slots=True)
    tuning = forced(path)
    x = torch.randn(T, D, device="cuda").to(dtype)
    slots, weights = make_routing(T, 0.5, "cuda", seed=100)
    out = torch.empty(T, D, dtype=dtype, device="cuda")

    def step():
        slot_experts_triton(x, slots, weights, w13, w2, ZERO_LO, ZERO_HI, out,
                            max_distinct=E, tuning=tuning)

    graph = capture(step)
    for seed, hot in [(1, 0.5), (2, 1.0), (3, 0.0), (4, 0.25)]:
        new_slots, new_weights = make_routing(T, hot, "cuda", seed=seed)
        slots.copy_(new_slots)
        weights.copy_(new_weights)
        x.copy_(torch.randn(T, D, device="cuda").to(dtype))
        graph.replay()
        eager = slot_experts_triton(x, slots, weights, w13, w2, ZERO_LO, ZERO_HI,
                                    max_distinct=E, tuning=tuning)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        assert_close(out, reference_loop(x.cpu(), slots.cpu(), weights.cpu(), w13.cpu(), w2.cpu()),
                     dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path,T",
                         [("decode", 1), ("decode", 16), ("prefill", 64), ("prefill", 512)])
def test_cuda_bitwise_deterministic(path, T):
    dtype = torch.bfloat16
    w13, w2 = make_pool(dtype, "cuda")
    x = torch.randn(T, D, device="cuda").to(dtype)
    slots, weights = make_routing(T, 0.5, "cuda", seed=5)
    runs = [slot_experts_triton(x, slots, weights, w13, w2, ZERO_LO, ZERO_HI, max_distinct=E,
                                tuning=forced(path)) for _ in range(5)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("table", ["moe_h200.json", "moe_quant_h200.json", None])
def test_bucket_sizes_reach_every_prefill_config(table):
    """A warm-up of bucket_sizes' passes meets each tile config once (load.warm_up): the committed
    tuned tables, and the defaults."""
    import json

    from ostinato.layers.moe.gpu_experts import DEFAULT_TUNING, TUNED_DIR, bucket_sizes, prefill_config

    tuning = json.loads((TUNED_DIR / table).read_text()) if table else DEFAULT_TUNING
    sizes = bucket_sizes(tuning)
    configs = [prefill_config(tuning, n) for n in sizes]
    assert len(sizes) == len(tuning["prefill"])
    assert all(configs[i] is not configs[j] for i in range(len(sizes)) for j in range(i))
    assert {id(c) for c in configs} == {id(c) for c in tuning["prefill"].values()}
    assert bucket_sizes({"prefill": {"1000000": {}}}) == [1]
