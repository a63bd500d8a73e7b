"""The synthetic generator (synth/hashrand.py) and its CUDA kernel (kernels/triton/uniform.py): the kernel's
values are the torch expression's bit for bit, under Triton's interpreter on the CPU and on CUDA, over
indices on both sides of 2**32 (where the high word changes) and lengths that end mid-block."""
from __future__ import annotations

import pytest
import torch

from ostinato.synth import hashrand
from tests.triton_interpreter import needs_cuda, run_interpreted

KEY = 0x8C3F_5A21_D00D_BEEF  # both words non-zero, the low one above 2**31
KEY_LOW = 0x8C3F_5A21_100D_BEEF  # the low word below 2**31


def test_the_high_word_and_the_key_change_the_values():
    """What the kernel must get right can be got wrong: the index's high word and each key word matter."""
    base = hashrand.uniform_bits(KEY, 5, 64, "cpu")
    assert not torch.equal(base, hashrand.uniform_bits(KEY, 5 + 2**32, 64, "cpu"))
    assert not torch.equal(base, hashrand.uniform_bits(KEY ^ 1, 5, 64, "cpu"))
    assert not torch.equal(base, hashrand.uniform_bits(KEY ^ (1 << 40), 5, 64, "cpu"))
    assert 0 <= base.min() and base.max() < 1


INTERPRETED = """
    import torch
    from ostinato.synth import hashrand
    from ostinato.kernels.triton.uniform import uniform_
    SCALE = 2.0 * 0.02 * 3.0 ** 0.5  # as fill_uniform_ scales std 0.02: not a power of two
    for KEY in (%d, %d):
        for start, n in ((0, 3000), (12345, 1024), (2**32 - 1500, 1500), (2**32 + 7, 2100)):
            flat = torch.empty(n)
            uniform_(flat, start, KEY & 0xFFFFFFFF, hashrand._high_word(KEY, start), SCALE)
            want = (hashrand.uniform_bits(KEY, start, n, "cpu") - 0.5) * SCALE
            assert torch.equal(flat, want), (KEY, start, (flat - want).abs().max())
    print("INTERPRETER_OK")
""" % (KEY, KEY_LOW)


def test_every_word_reaches_the_kernel_with_one_signature():
    """Triton compiles a kernel per argument signature and types an int from 2**31 up as int64: the words
    travel as int32 of the same bits, so that random keys do not compile the generator again."""
    pytest.importorskip("triton")
    from triton.runtime.jit import mangle_type

    from ostinato.kernels.triton.uniform import _int32

    for word in (0, 1, 2**31 - 1, 2**31, 0xD00DBEEF, 2**32 - 1):
        assert mangle_type(_int32(word)) == "i32", hex(word)
        assert _int32(word) & 0xFFFFFFFF == word


def test_kernel_equals_the_torch_expression_under_interpreter():
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED, timeout=300)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fill_equals_the_cpu_fill(dtype, monkeypatch):
    """fill_uniform_ on CUDA (the kernel, segment by segment) against the CPU's torch path, bit for bit;
    small segments so that several launches, each with its own first index, fill one tensor."""
    monkeypatch.setattr(hashrand, "_SEGMENT", 4096)
    for shape, std in (((3, 5000), 0.02), ((1, 777), 1.0)):
        cpu = hashrand.fill_uniform_(torch.empty(shape, dtype=dtype), KEY, std)
        gpu = hashrand.fill_uniform_(torch.empty(shape, dtype=dtype, device="cuda"), KEY, std)
        assert torch.equal(gpu.cpu(), cpu)
