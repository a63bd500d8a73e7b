"""Prefill attention through models/common.causal_attention: the same values as attention with an
explicit causal mask (CPU), and, on a GPU, SDPA's fused kernels take every family that declares
them (AttentionShape.fused_on_gpu), which is what lets the capacity test count no score matrix
for it (planner/capacity.py gpu_score_share)."""
from __future__ import annotations

import math

import pytest
import torch

from ostinato.config import ModelConfig
from ostinato.models.common import FUSED_BACKENDS, causal_attention, fused_attention_available
from ostinato.models.registry import attention_shape
from ostinato.planner.capacity import gpu_score_share
from ostinato.synth.presets import preset_config


def _cfg(preset: str) -> ModelConfig:
    return ModelConfig.from_dict(preset_config(preset))


def _reference(q, k, v, scale):
    """Scores, an explicit mask (query i sees keys [0, L - T + i]), softmax, in fp64."""
    T, L = q.shape[1], k.shape[1]
    s = torch.einsum("htd,hld->htl", q.double(), k.double()) * scale
    allowed = torch.arange(L)[None, :] <= (L - T + torch.arange(T))[:, None]
    return torch.einsum("htl,hld->htd", s.masked_fill(~allowed, -math.inf).softmax(-1), v.double())


@pytest.mark.parametrize("T,L", [(16, 16), (5, 16), (1, 9)])
@pytest.mark.parametrize("dk,dv", [(32, 32), (48, 16)])  # MLA: the value head narrower than q/k
def test_causal_attention_is_attention_with_the_causal_mask(T, L, dk, dv):
    g = torch.Generator().manual_seed(T * L + dk)
    q, k = torch.randn(3, T, dk, generator=g), torch.randn(3, L, dk, generator=g)
    v = torch.randn(3, L, dv, generator=g)
    for scale in (None, 0.3):
        got = causal_attention(q, k, v, scale)
        want = _reference(q, k, v, scale if scale is not None else dk ** -0.5)
        assert got.shape == (3, T, dv)
        assert torch.allclose(got.double(), want, atol=1e-5), (got.double() - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_heads_attend_as_the_repeated_heads(dtype, monkeypatch):
    """K/V heads shared by 4 query heads each (Qwen3's GQA): the same values, to the bit, whether
    SDPA takes the groups (enable_gqa, where the fused kernels do) or the heads are repeated first."""
    import ostinato.models.common as common

    g = torch.Generator().manual_seed(1)
    q = torch.randn(8, 5, 64, generator=g).to(dtype)
    k, v = (torch.randn(2, 12, 64, generator=g).to(dtype) for _ in "kv")
    repeated = causal_attention(q, k.repeat_interleave(4, dim=0), v.repeat_interleave(4, dim=0))
    assert torch.equal(causal_attention(q, k, v), repeated)
    assert torch.equal(causal_attention(q, k[:, :5], v[:, :5]),  # the causal flag (T = L) too
                       causal_attention(q, k[:, :5].repeat_interleave(4, dim=0), v[:, :5].repeat_interleave(4, dim=0)))
    monkeypatch.setattr(common, "fused_attention_available", lambda *a, **kw: False)
    assert torch.equal(common.causal_attention(q, k, v), repeated)


def test_score_share_follows_the_declaration_without_a_gpu():
    qwen, ds, oss = (_cfg(p) for p in ("tiny", "tiny-deepseek-v3", "tiny-gpt-oss"))
    assert attention_shape(qwen).fused_on_gpu and attention_shape(ds).fused_on_gpu
    assert not attention_shape(oss).fused_on_gpu  # sinks and sliding windows: an explicit mask
    if not torch.cuda.is_available():
        assert gpu_score_share(qwen, torch.bfloat16) == 0.0 and gpu_score_share(ds, torch.bfloat16) == 0.0
    assert gpu_score_share(qwen, torch.float32) == 1.0 and gpu_score_share(oss, torch.bfloat16) == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3-shaped"])
def test_the_fused_kernels_take_the_real_head_dims(preset):
    """The probe the capacity test asks, at the real shapes; Qwen3's must hold (every committed plan
    counted no scores for it). DeepSeek-V3's answer (q/k 192, v 128) is the GPU's: printed."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    shape = attention_shape(_cfg(preset))
    ok = fused_attention_available(shape.qk_dim, shape.v_dim, torch.bfloat16, "cuda")
    gqa = fused_attention_available(shape.qk_dim, shape.v_dim, torch.bfloat16, "cuda", gqa=True)
    print(f"{preset}: fused kernels ({', '.join(FUSED_BACKENDS)}) take q/k {shape.qk_dim}, v {shape.v_dim}: {ok}; "
          f"grouped K/V heads as they are: {gqa}")
    if preset == "qwen3-30b-a3b":
        assert ok
    assert gpu_score_share(_cfg(preset), torch.bfloat16) == (0.0 if ok else 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "tiny-deepseek-v3"])
def test_a_prefill_runs_in_the_fused_kernels_alone(preset, tmp_path):
    """A whole prefill (a first chunk, then a chunk after cached tokens) with SDPA restricted to the
    fused kernels: it would raise where the model's attention needed the math kernel."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ostinato.engine.runner import ModelRunner, RunnerSettings
    from ostinato.loader.source import CheckpointSource
    from ostinato.synth.build import write_checkpoint

    shape = attention_shape(_cfg(preset))
    if not fused_attention_available(shape.qk_dim, shape.v_dim, torch.bfloat16, "cuda"):
        pytest.skip(f"this GPU's fused kernels do not take {preset}'s head dims")
    path = write_checkpoint(preset, tmp_path / preset)
    runner = ModelRunner(CheckpointSource(path), RunnerSettings(device="cuda", dtype="bf16", max_context=512,
                                                                prefill_chunk=64, cuda_graph=False))
    ids = torch.randint(0, 4000, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    free = runner.forward(ids, 0, all_logits=True).float()
    with sdpa_kernel([getattr(SDPBackend, b) for b in FUSED_BACKENDS]):
        fused = runner.forward(ids, 0, all_logits=True).float()
    assert torch.isfinite(fused).all()
    assert float((fused - free).abs().max() / free.abs().max()) < 2e-2
