"""Oracle tests of the quantized-expert kernels (kernels/triton/moe_quant.py, layers/moe/gpu_quant.py).

Legend: T tokens, K routes per token, D hidden, F expert FFN size, E experts, N pool slots.
Pools are random bytes with their scale fields set to small fp16 values (MXFP4: E8M0
exponents), so every payload bit pattern occurs, which no quantizer's output guarantees. The
oracle dequantizes them with gguf.quants.dequantize and runs plain fp32 torch per distinct
slot: gate/up, silu(gate) * up rounded to the activation dtype, down, weighted sum over k.
Zero slots hold 0xFF bytes (NaN scales): any read of one shows in the output. One hot slot
holds zero bytes, which must dequantize to zeros.

Where triton is importable the kernels run here under TRITON_INTERPRET=1 in subprocesses
(the variable must be set before triton loads): dequantization bitwise against gguf on fully
random bytes; the MoE paths on small shapes for each format on each side (decode in bf16 and
fp32, prefill in fp32 and fp16: the interpreter gets bf16 tl.dot wrong, and it truncates
fp32 -> bf16 instead of rounding, hence bf16's looser tolerance). CUDA (marked gpu) runs real
shapes (D=2048, F=768, K=8) for T in {1, 7, 64, 512} and CUDA-graph replays.
"""
from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F_
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from ostinato.config import ConfigError
from ostinato.layers.moe import gpu_experts as ge
from ostinato.layers.moe import gpu_quant as gq
from ostinato.quant import formats
from tests.triton_interpreter import capture, needs_cuda, run_interpreted

REPO = Path(__file__).resolve().parents[1]
K, E = 4, 8  # small tests; the gpu tests use K=8, E=16
# Each format once on each side; (Q4_K, Q6_K) is Q4_K_M's pairing on its Q6_K layers.
PAIRS = [("Q4_K", "Q6_K"), ("Q6_K", "Q5_K"), ("Q5_K", "Q8_0"), ("Q8_0", "MXFP4"),
         ("MXFP4", "Q4_K")]
# Typical |w| ~ unit / sqrt(n) for the payload's random codes.
UNIT = {"Q8_0": 1 / 64, "Q4_K": 1 / 256, "Q5_K": 1 / 512, "Q6_K": 1 / 1024}


def small_shape(qtypes):
    """D, F: whole blocks, and for 32-value formats sizes that tiles of 64 do not divide."""
    D = 256 if formats.block_size(qtypes[0]) == 256 else 160
    F = 256 if formats.block_size(qtypes[1]) == 256 else 96
    return D, F


def random_rows(shape, n, qtype, g):
    """uint8 [*shape, row_bytes(qtype, n)]: random payload, sane random scales."""
    bb = formats.block_bytes(qtype)
    q = torch.randint(0, 256, (*shape, formats.row_bytes(qtype, n)), generator=g,
                      dtype=torch.uint8)
    blocks = q.view(-1, bb)
    nb = blocks.shape[0]
    if qtype == "MXFP4":
        blocks[:, 0] = torch.randint(122 - int(np.log2(n) / 2), 126, (nb,), generator=g)
        return q
    for offset in {"Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[qtype]:
        d = (torch.rand(nb, generator=g) + 0.5) * UNIT[qtype] / n**0.5
        blocks[:, offset:offset + 2] = d.half().view(torch.uint8).view(nb, 2)
    return q


def gguf_dense(q, qtype):
    """uint8 [..., row_bytes] -> float32 [..., n] by gguf.quants (the oracle's reading)."""
    with np.errstate(all="ignore"):
        return torch.from_numpy(gguf_dequantize(q.cpu().numpy(), GGMLQuantizationType[qtype]))


class Case:
    """Pools of N = E + K slots: zero slots [zero_lo, zero_hi) in the middle (0xFF bytes),
    slot 0 a hot expert of zero bytes; dense copies of the hot slots for the oracle."""

    def __init__(self, qtypes, D, F, K, E, device, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.qtypes, self.D, self.F, self.K, self.E = qtypes, D, F, K, E
        N = E + K
        self.zero_lo, self.zero_hi = E // 2, E // 2 + K
        w13 = random_rows((N, 2 * F), D, qtypes[0], g)
        w2 = random_rows((N, D), F, qtypes[1], g)
        for w in (w13, w2):
            w[self.zero_lo:self.zero_hi] = 0xFF
            w[0] = 0
        self.table = [s for s in range(N) if not self.zero_lo <= s < self.zero_hi]
        self.dense13 = {s: gguf_dense(w13[s], qtypes[0]).to(device) for s in self.table}
        self.dense2 = {s: gguf_dense(w2[s], qtypes[1]).to(device) for s in self.table}
        self.w13, self.w2 = w13.to(device), w2.to(device)
        self.device = device

    def routing(self, T, hot, seed=0):
        """slots[T, K] int32, weights[T, K] f32: about hot * T*K routes hot."""
        g = torch.Generator().manual_seed(seed + 1)
        ids = torch.stack([torch.randperm(self.E, generator=g)[:self.K] for _ in range(T)])
        slots = torch.tensor(self.table)[ids]
        cold = torch.rand(T, self.K, generator=g) >= hot
        zero = (self.zero_lo + torch.arange(self.K)).expand(T, self.K)
        slots = torch.where(cold, zero, slots).to(torch.int32)
        weights = torch.softmax(torch.randn(T, self.K, generator=g), -1)
        return slots.to(self.device), weights.to(self.device)

    def oracle(self, x, slots, weights):
        """fp32 per distinct hot slot, h rounded to x's dtype; summed over k in order."""
        T, K = slots.shape
        flat = slots.reshape(-1).long()
        y = torch.zeros(T * K, self.D, dtype=torch.float32, device=x.device)
        for s in torch.unique(flat).tolist():
            if self.zero_lo <= s < self.zero_hi:
                continue
            routes = (flat == s).nonzero().squeeze(1)
            gate, up = (x[routes // K].float() @ self.dense13[s].t()).chunk(2, dim=-1)
            h = (F_.silu(gate) * up).to(x.dtype).float()
            y[routes] = (h @ self.dense2[s].t()) * weights.reshape(-1)[routes, None].float()
        return y.view(T, K, -1).sum(1)

    def run(self, x, slots, weights, **kw):
        return gq.slot_experts_quant_triton(x, slots, weights, self.w13, self.w2, self.zero_lo,
                                            self.zero_hi, qtypes=self.qtypes, max_distinct=self.E,
                                            **kw)


def assert_close(got, want, dtype):
    err = (got.float().cpu() - want.float().cpu()).abs().max().item()
    scale = want.abs().max().item() + 1e-6
    assert err / scale < (1e-5 if dtype == torch.float32 else 1e-2), (err, scale)


def forced(path, tuning=None, device="cpu"):
    """The device's tuning (or tuning), with decode, the quantized prefill kernels or the
    dequantized path ("dequant": bf16 kernels on the dequantized experts) forced for every T."""
    tuning = copy.deepcopy(tuning or gq.load_quant_tuning(ge.device_tag(torch.device(device))))
    tuning["decode_max_tokens"] = 10**9 if path == "decode" else 0
    tuning["dequant_min_tokens"] = 1 if path == "dequant" else None
    return tuning


@pytest.mark.parametrize("hot", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("T", [1, 7, 64])
@pytest.mark.parametrize("qtypes", PAIRS, ids="-".join)
def test_torch_path_matches_gguf_oracle(qtypes, T, hot):
    case = Case(qtypes, *small_shape(qtypes), K, E, "cpu")
    x = torch.randn(T, case.D).bfloat16()
    slots, weights = case.routing(T, hot, seed=T)
    out = gq.slot_experts_quant_forward(x, slots, weights, case.w13, case.w2, case.zero_lo,
                                        case.zero_hi, qtypes=qtypes, out_dtype=torch.float32)
    assert out.shape == (T, case.D) and out.dtype == torch.float32
    assert_close(out, case.oracle(x, slots, weights), torch.bfloat16)
    if hot == 0.0:
        assert not out.any()


def test_quant_pool_errors_say_what_to_do():
    case = Case(("Q4_K", "Q6_K"), 256, 256, K, E, "cpu")
    x = torch.randn(2, 256).bfloat16()
    slots, weights = case.routing(2, 1.0)
    args = (x, slots, weights, case.w13, case.w2, case.zero_lo, case.zero_hi)
    with pytest.raises(ConfigError, match="requantize"):
        gq.slot_experts_quant_forward(*args, qtypes=("Q4_K", "BF16"))
    with pytest.raises(ConfigError, match="w2 pool of Q4_K"):
        gq.slot_experts_quant_forward(*args, qtypes=("Q4_K", "Q4_K"))  # Q6_K rows are longer
    with pytest.raises(ConfigError, match="multiple of 256"):
        gq.slot_experts_quant_forward(torch.randn(2, 160), *args[1:], qtypes=("Q4_K", "Q6_K"))


def test_tuned_file_overrides_defaults(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(ge, "TUNED_DIR", tmp_path)
    (tmp_path / "moe_quant_fake.json").write_text(json.dumps({
        "_meta": {"device": "fake"}, "decode_max_tokens": 3, "decode_w2": {"GROUPS": 4},
        "prefill": {"10": {"BLOCK_M": 16, "BLOCK_N": 32, "GROUPS": 2, "num_warps": 4,
                           "num_stages": 2}}}))
    gq.load_quant_tuning.cache_clear()
    ge.load_tuning.cache_clear()
    try:
        tuning = gq.load_quant_tuning("fake")
        assert "_meta" not in tuning and tuning["decode_max_tokens"] == 3
        assert tuning["decode_w2"]["GROUPS"] == 4
        assert tuning["decode_w2"]["BLOCK_D"] == gq.DEFAULT_QUANT_TUNING["decode_w2"]["BLOCK_D"]
        assert tuning["align"] == ge.DEFAULT_TUNING["align"]  # from gpu_experts' tuning
        assert gq.prefill_config(tuning, 5000, torch.bfloat16)["BLOCK_N"] == 32
        assert gq.prefill_config(tuning, 5, torch.float32)["GROUPS"] == 1
    finally:
        gq.load_quant_tuning.cache_clear()
        ge.load_tuning.cache_clear()


def test_package_imports_without_triton():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # any import of triton now fails
        import torch
        from ostinato.layers.moe.gpu_quant import slot_experts_quant_forward
        w13 = torch.zeros(2, 64, 34, dtype=torch.uint8)  # Q8_0 rows of 32 values
        w2 = torch.zeros(2, 32, 34, dtype=torch.uint8)
        out = slot_experts_quant_forward(torch.randn(3, 32), torch.zeros(3, 1, dtype=torch.int32),
                                         torch.ones(3, 1), w13, w2, 1, 2, qtypes=("Q8_0", "Q8_0"))
        assert out.shape == (3, 32) and not out.any()  # slot 0 holds zero bytes
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr


DEQUANT_SCRIPT = """
    import numpy as np, torch
    import test_moe_quant_triton as t
    from ostinato.kernels.triton.moe_quant import dequantize_rows
    from ostinato.quant import formats
    g = torch.Generator().manual_seed(0)
    for qtype in ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]:
        n = 512
        q = torch.randint(0, 256, (6, formats.row_bytes(qtype, n)), generator=g, dtype=torch.uint8)
        q[1] = 0  # zero bytes: zeros
        got = dequantize_rows(q, qtype, n, block_r=4, groups=4)  # masked rows and groups
        np.testing.assert_array_equal(got.numpy(), t.gguf_dense(q, qtype).numpy())  # NaNs too
        assert not got[1].any()
        q = t.random_rows((3,), n, qtype, g)
        np.testing.assert_array_equal(dequantize_rows(q, qtype, n).numpy(),
                                      t.gguf_dense(q, qtype).numpy())
    # rows a byte past a word (Q4_K: heads load as words) or past a half (Q6_K: its scale d loads as one fp16)
    for qtype, nbytes, align in (("Q4_K", 144, 4), ("Q6_K", 210, 2)):
        odd = torch.zeros(2, nbytes + 2, dtype=torch.uint8)[:, 1:nbytes + 1]
        try:
            dequantize_rows(odd, qtype, 256)
        except ValueError as e:
            assert f"{align}-byte boundaries" in str(e), e
        else:
            raise AssertionError(f"{qtype} rows off a {align}-byte boundary were accepted")
    half = torch.zeros(2, 212, dtype=torch.uint8)[:, 2:212]  # Q6_K on a 2-byte boundary, not a word's: taken
    assert not dequantize_rows(half, "Q6_K", 256).any()
    print("INTERPRETER_OK")
"""


def test_dequantize_rows_under_interpreter():
    pytest.importorskip("triton")
    run_interpreted(DEQUANT_SCRIPT, timeout=300)


MOE_SCRIPT = """
    import torch
    import test_moe_quant_triton as t
    qtypes = QTYPES
    # Large tiles: the interpreter's cost is per program and operation, hardly per element.
    tiny = dict(decode_w13={"BLOCK_F": 256, "GROUPS": 16, "num_warps": 4, "num_stages": 2},
                decode_w2={"BLOCK_D": 256, "GROUPS": 4, "num_warps": 4, "num_stages": 1},
                combine={"BLOCK_D": 256, "num_warps": 4},
                align={"backend": "triton", "CHUNK": 32, "SUB": 16, "TILE": 16, "ROWS": 2,
                       "num_warps": 4, "scan_warps": 4},
                prefill={"1": {"BLOCK_M": 64, "BLOCK_N": 256, "GROUPS": 4, "num_warps": 4,
                               "num_stages": 2}})
    case = t.Case(qtypes, *t.small_shape(qtypes), t.K, t.E, "cpu")
    cases = [("decode", torch.bfloat16, 1, 1.0), ("decode", torch.float32, 7, 0.5),
             ("prefill", torch.float16, 7, 0.5), ("prefill", torch.float32, 64, 0.5)]
    for path, dtype, T, hot in cases:
        x = torch.randn(T, case.D).to(dtype)
        slots, weights = case.routing(T, hot, seed=T)
        out = case.run(x, slots, weights, out_dtype=torch.float32, tuning=t.forced(path, tiny))
        t.assert_close(out, case.oracle(x, slots, weights), dtype)
    # the dequantized path (16-bit activations: fp32 keeps the quantized kernels), through the tuning's
    # threshold, and in chunks of 3 of the pass's distinct slots (a token's routes across chunks); fp16
    # only: the interpreter's tl.dot gets bf16 wrong (test_gpu_experts), bf16 is the GPU tests'
    from ostinato.layers.moe import gpu_experts as ge, gpu_quant as gq
    for dtype, T, hot in ((torch.float16, 12, 0.5), (torch.float16, 9, 1.0)):
        x = torch.randn(T, case.D).to(dtype)
        slots, weights = case.routing(T, hot, seed=T)
        want = case.oracle(x, slots, weights)
        out = case.run(x, slots, weights, out_dtype=torch.float32, tuning=t.forced("dequant", tiny))
        t.assert_close(out, want, dtype)
        xs, ss, ws, o = ge.triton_inputs(x, slots, weights, None, torch.float32)
        chunked = gq.slot_experts_dequant_triton(xs, ss, ws, case.w13, case.w2, case.zero_lo, case.zero_hi, o,
                                                 qtypes=qtypes, epi=ge.Epilogue.of(None, None, gq.SILU), chunk=3)
        t.assert_close(chunked, want, dtype)
    # every route on the zero-byte hot slot: exactly zero (and its bytes are read)
    x = torch.randn(1, case.D).to(torch.bfloat16)
    slots = torch.zeros(1, t.K, dtype=torch.int32)
    out = case.run(x, slots, torch.ones(1, t.K), tuning=t.forced("decode", tiny))
    assert not out.any()
    print("INTERPRETER_OK")
"""


@pytest.mark.parametrize("qtypes", PAIRS, ids="-".join)
def test_moe_kernels_under_interpreter(qtypes):
    pytest.importorskip("triton")
    run_interpreted(MOE_SCRIPT.replace("QTYPES", repr(qtypes)), timeout=300)


GPU_K, GPU_E = 8, 16
GPU_D, GPU_F = 2048, 768  # Qwen3-30B-A3B


@functools.cache
def gpu_case(qtypes, D=GPU_D, F=GPU_F):
    return Case(qtypes, D, F, GPU_K, GPU_E, "cuda", seed=1)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"])
def test_cuda_dequantize_rows_matches_gguf(qtype):
    from ostinato.kernels.triton.moe_quant import dequantize_rows

    g = torch.Generator().manual_seed(3)
    q = random_rows((100,), GPU_D, qtype, g)
    want = gguf_dense(q, qtype)
    got = dequantize_rows(q.cuda(), qtype, GPU_D).cpu()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ["auto", "decode", "prefill", "dequant"])
@pytest.mark.parametrize("T", [1, 7, 64, 512])
@pytest.mark.parametrize("qtypes", PAIRS, ids="-".join)
def test_cuda_matches_oracle(qtypes, T, path):
    case = gpu_case(qtypes)
    x = torch.randn(T, GPU_D, device="cuda").bfloat16()
    slots, weights = case.routing(T, 0.75, seed=T)
    tuning = None if path == "auto" else forced(path, device="cuda")
    out = case.run(x, slots, weights, tuning=tuning)
    assert out.dtype == torch.bfloat16 and out.shape == (T, GPU_D)
    assert_close(out, case.oracle(x, slots, weights), torch.bfloat16)
    assert torch.equal(out, case.run(x, slots, weights, tuning=tuning))  # deterministic


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("qtypes", [("Q8_0", "MXFP4"), ("MXFP4", "Q8_0")], ids="-".join)
def test_cuda_masked_shapes_and_fp32(qtypes, path):
    """Sizes the tiles do not divide (masks on the GPU), and fp32 activations."""
    case = gpu_case(qtypes, 160, 96)
    tuning = forced(path, device="cuda")
    for dtype, T in [(torch.bfloat16, 7), (torch.float32, 7), (torch.bfloat16, 70)]:
        x = torch.randn(T, 160, device="cuda").to(dtype)
        slots, weights = case.routing(T, 0.5, seed=T)
        out = case.run(x, slots, weights, out_dtype=torch.float32, tuning=tuning)
        assert_close(out, case.oracle(x, slots, weights), dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path,T", [("decode", 1), ("decode", 4), ("prefill", 64),
                                    ("prefill", 512)])
@pytest.mark.parametrize("qtypes", PAIRS, ids="-".join)
def test_cuda_graph_replay_with_new_routing(qtypes, path, T):
    case = gpu_case(qtypes)
    tuning = forced(path, device="cuda")
    x = torch.randn(T, GPU_D, device="cuda").bfloat16()
    slots, weights = case.routing(T, 0.5, seed=100)
    out = torch.empty(T, GPU_D, dtype=torch.bfloat16, device="cuda")

    def step():
        case.run(x, slots, weights, out=out, tuning=tuning)

    graph = capture(step)
    for seed, hot in [(1, 0.5), (2, 1.0), (3, 0.0), (4, 0.25)]:
        new_slots, new_weights = case.routing(T, hot, seed=seed)
        slots.copy_(new_slots)
        weights.copy_(new_weights)
        x.copy_(torch.randn(T, GPU_D, device="cuda").bfloat16())
        graph.replay()
        eager = case.run(x, slots, weights, tuning=tuning)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        assert_close(out, case.oracle(x, slots, weights), torch.bfloat16)
        if hot == 0.0:
            assert not out.any()
