"""The fused kernels of the step's GPU side outside the experts ([Q]) against the modules' torch
expressions, in bf16 and fp32:
- RMSNorm in one launch (kernels/triton/rms_norm.py): both weight orders, rows of a hidden state, of a
  projection's slice and of attention heads, and after a residual add;
- queries and keys normed and rotated in one launch (kernels/triton/qk_rope.py): with and without the
  norm, heads read through the strides of a fused projection's slice, and the key and value rows
  stored into caches at device-side positions;
- Qwen3's softmax top-k router in one launch (kernels/triton/route.py): the same experts, the weights
  within their rounding, ties to the lowest id; and the pool's slot lookup after it, exactly.
On the CPU through Triton's interpreter, which truncates to bf16 where the GPU rounds to nearest (a
place or two allowed there), and on CUDA, where a last-place difference must be rare and the rotary
alone is bit for bit the torch expression's."""
from __future__ import annotations

import pytest

from tests.triton_interpreter import needs_cuda, run_interpreted

RMS_NORM = """
import torch
from ostinato.models.common import RMSNorm
from ostinato.kernels.triton.rms_norm import rms_norm

def torch_norm(x, w, eps, fp32_weight):
    m = RMSNorm(x.shape[-1], eps, fp32_weight).to(device="cpu", dtype=w.dtype)
    m.weight.data.copy_(w.cpu())
    with torch.no_grad():
        return m(x.cpu())

def check(device, exact):
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        for fp32_weight in (False, True):
            for shape, view in (((3, 2048), None), ((1, 2048), None), ((3, 2560), "columns"),
                                ((2, 5, 32 * 128), (2, 5, 32, 128))):
                x = (torch.randn(shape, generator=g) * 3).to(dtype)
                if view == "columns":
                    x = x[:, :2048]  # rows 2560 apart, read in place (a projection's slice)
                elif view is not None:
                    x = x.view(view)[:, 1:]  # heads of 128 of a slice of the token axis
                w = (1 + 0.1 * torch.randn(x.shape[-1], generator=g)).to(dtype)
                want = torch_norm(x, w, 0.5, fp32_weight)  # an eps that moves the result
                got = rms_norm(x.to(device), w.to(device), 0.5, fp32_weight).cpu()
                assert got.shape == want.shape and got.dtype == want.dtype
                diff = (got.float() - want.float()).abs()
                # bf16: a last place or two (one in the norm, one more through the weight's rounding); fp32:
                # a few, the row's mean square summed in another order (a wrong order of operations is far off)
                ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(1e-3)
                places = 2 if dtype == torch.bfloat16 else 8
                assert bool((diff <= places * ulp).all()), (dtype, fp32_weight, shape, float((diff / ulp).max()))
                if dtype == torch.bfloat16 and exact:  # the interpreter truncates to bf16; the GPU
                    assert float((diff > 0).float().mean()) < 0.02  # rounds to nearest, as torch: rarely apart
                worst = max(worst, float(diff.max()))
    empty = rms_norm(torch.zeros(0, 64, device=device), torch.ones(64, device=device), 1e-6)
    assert empty.shape == (0, 64)
    # with a residual: the sum exactly torch's x + r (one rounding of an exact fp32 sum), its norm as above
    for dtype in (torch.bfloat16, torch.float32):
        x, r = (torch.randn(3, 2048, generator=g) * 3).to(dtype), torch.randn(3, 2048, generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(2048, generator=g)).to(dtype)
        total, normed = rms_norm(x.to(device), w.to(device), 1e-6, False, residual=r.to(device))
        want = x + r
        if exact or dtype == torch.float32:
            assert torch.equal(total.cpu(), want)
        else:  # the interpreter truncates the sum to bf16: within one place
            ulp = torch.finfo(dtype).eps * want.float().abs()
            assert bool(((total.cpu().float() - want.float()).abs() <= ulp).all())
        assert torch.equal(normed.cpu(), rms_norm(total, w.to(device), 1e-6).cpu())
    return worst
"""

QK_ROPE = """
import torch
from ostinato.models.common import RMSNorm
from ostinato.models.rope import apply_rotary
from ostinato.kernels.triton.qk_rope import qk_norm_rope

def check(device, exact):
    g = torch.Generator().manual_seed(0)
    T, H, Hkv, Hd = 3, 8, 2, 128
    for dtype in (torch.bfloat16, torch.float32):
        for norm in (False, True):
            for fused in (False, True):
                if fused:  # q and k as slices of one [T, (H + 2 Hkv) Hd] projection: row strides > H Hd
                    qkv = torch.randn(T, (H + 2 * Hkv) * Hd, generator=g).to(dtype)
                    q, k = qkv[:, :H * Hd].view(T, H, Hd), qkv[:, H * Hd:(H + Hkv) * Hd].view(T, Hkv, Hd)
                else:
                    q, k = torch.randn(T, H, Hd, generator=g).to(dtype), torch.randn(T, Hkv, Hd, generator=g).to(dtype)
                ang = torch.randn(T, Hd // 2, generator=g) * 3
                cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dtype), torch.cat((ang.sin(), ang.sin()), -1).to(dtype)
                qn, kn = RMSNorm(Hd, 0.5).to(dtype), RMSNorm(Hd, 0.5).to(dtype)
                with torch.no_grad():
                    qn.weight.copy_(1 + 0.2 * torch.randn(Hd, generator=g))
                    kn.weight.copy_(1 + 0.2 * torch.randn(Hd, generator=g))
                    wq, wk = (qn(q), kn(k)) if norm else (q, k)
                    want = apply_rotary(wq, cos, sin), apply_rotary(wk, cos, sin)
                    args = (qn.weight.to(device), kn.weight.to(device), 0.5) if norm else ()
                    got = qk_norm_rope(q.to(device), k.to(device), cos.to(device), sin.to(device), *args)
                for a, b in zip(got, want):
                    a = a.cpu()
                    assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
                    diff = (a.float() - b.float()).abs()
                    if exact and dtype == torch.bfloat16 and not norm:
                        assert torch.equal(a, b), float(diff.max())
                        continue
                    # a few places of the row's largest value: a sum of two rounded products can cancel
                    places = 4 if dtype == torch.bfloat16 else 8
                    ulp = torch.finfo(dtype).eps * b.float().abs().amax(-1, keepdim=True)
                    assert bool((diff <= places * ulp).all()), (dtype, norm, fused, float((diff / ulp).max()))
                    if exact and dtype == torch.bfloat16:
                        assert float((diff > 0).float().mean()) < 0.02
                # with store: the same q and k, and each token's key and value rows in the caches at its
                # position (v read through the projection's strides), every other row untouched
                v = qkv[:, (H + Hkv) * Hd:].view(T, Hkv, Hd) if fused else torch.randn(T, Hkv, Hd, generator=g).to(dtype)
                kc, vc = torch.randn(16, Hkv, Hd, generator=g).to(dtype), torch.randn(16, Hkv, Hd, generator=g).to(dtype)
                kc_d, vc_d, pos = kc.to(device), vc.to(device), torch.tensor([9, 2, 14])
                stored = qk_norm_rope(q.to(device), k.to(device), cos.to(device), sin.to(device), *args,
                                      store=(v.to(device), kc_d, vc_d, pos.to(device)))
                for a, b in zip(stored, got):
                    assert torch.equal(a.cpu(), b.cpu())
                kc[pos], vc[pos] = stored[1].cpu(), v
                assert torch.equal(kc_d.cpu(), kc) and torch.equal(vc_d.cpu(), vc)
    return True
"""

ROUTE = """
import torch
from ostinato.kernels.triton.route import route_softmax_topk

def torch_route(logits, k, norm, dtype):  # layers/moe/router.py route, the CPU path
    probs = torch.softmax(logits.cpu(), dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, k, dim=-1)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(dtype).float()

def check(device, exact):
    g = torch.Generator().manual_seed(0)
    for E, k in ((128, 8), (60, 4), (256, 8)):
        for dtype in (torch.bfloat16, torch.float32):
            for norm in (True, False):
                # distinct multiples of 1/16 (exact in bf16: no ties), rows E + 32 apart (a wider projection's slice)
                wide = torch.stack([(torch.randperm(E + 32, generator=g) - (E + 32) / 2) / 16 for _ in range(5)])
                logits = wide.to(dtype)[:, :E]
                want_ids, want_w = torch_route(logits, k, norm, dtype)
                ids, w = route_softmax_topk(logits.to(device), k, norm, dtype)
                assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (5, k)
                assert torch.equal(ids.cpu(), want_ids), (E, k, dtype, norm)
                diff = (w.cpu() - want_w).abs()
                assert float(diff.max()) <= 2 * torch.finfo(dtype).eps * float(want_w.max()), float(diff.max())
                if exact and dtype == torch.bfloat16:  # fp32: the sums' order moves the last place often
                    assert float((diff > 0).float().mean()) < 0.05
    # equal logits: the lowest expert id first, as the engine's choice (torch's order among ties is its own)
    tie = torch.zeros(1, 16, device=device)
    tie[0, 3] = tie[0, 9] = tie[0, 12] = 1.0
    ids, w = route_softmax_topk(tie, 4, True, torch.float32)
    assert ids.cpu().tolist() == [[3, 9, 12, 0]]
    empty = route_softmax_topk(torch.zeros(0, 16, device=device), 2, True, torch.float32)
    assert empty[0].shape == (0, 2)
    return True
"""

SLOTS = """
import torch
from ostinato.kernels.triton.route import lookup_slots

def check(device, exact):
    g = torch.Generator().manual_seed(0)
    for E, K, T in ((128, 8, 1), (60, 4, 33), (256, 8, 300)):
        table = torch.full((3, E), -1, dtype=torch.int32)  # rows of a [layers, E] table
        hot = torch.randperm(E, generator=g)[: E // 3]
        table[1, hot] = torch.arange(hot.numel(), dtype=torch.int32) + 7
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        zero_lo = 500
        slot = table[1][ids]  # pool.py slots_in's torch expression
        zero = torch.arange(zero_lo, zero_lo + K, dtype=torch.int32)
        want = torch.where(slot >= 0, slot, zero)
        got = lookup_slots(table.to(device)[1], ids.to(device), zero_lo)
        assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)
        for n in {0, T // 2, T}:  # the rows from a count on (a captured pass's padding): zero slots
            count = torch.tensor([n], dtype=torch.int32, device=device)
            got = lookup_slots(table.to(device)[1], ids.to(device), zero_lo, count)
            assert torch.equal(got.cpu(), torch.where((torch.arange(T) < n)[:, None], want, zero)), n
    assert lookup_slots(table.to(device)[1], torch.zeros(0, 4, dtype=torch.int64, device=device), 9).shape == (0, 4)
    return True
"""

CHECKS = {"rms_norm": RMS_NORM, "qk_rope": QK_ROPE, "route": ROUTE, "slots": SLOTS}


@pytest.mark.parametrize("kernel", list(CHECKS))
def test_matches_the_torch_expression_interpreted(kernel):
    pytest.importorskip("triton")
    run_interpreted(CHECKS[kernel] + "\ncheck('cpu', exact=False)\nprint('INTERPRETER_OK')\n", timeout=300)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", list(CHECKS))
def test_matches_the_torch_expression_on_cuda(kernel):
    scope: dict = {}
    exec(CHECKS[kernel], scope)
    scope["check"]("cuda", exact=True)


def test_the_fused_kernels_can_be_turned_off(monkeypatch):
    """OSTINATO_FUSED_DENSE=0 (scripts/device/run.sh's before/after profile) selects the torch expressions."""
    from ostinato.kernels.triton import fused_dense

    assert fused_dense()
    monkeypatch.setenv("OSTINATO_FUSED_DENSE", "0")
    assert not fused_dense()
