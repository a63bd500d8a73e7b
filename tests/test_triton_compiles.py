"""Triton's compiles counted per turn (kernels/triton compiles): the hooks count and chain, and
the kernels whose integer arguments change from pass to pass do not compile again for them."""
from __future__ import annotations

import sys

import pytest
import torch

from ostinato.kernels.triton import _CompileCounter


def test_no_counters_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    c = _CompileCounter()
    assert c.install() is False
    assert c.counters() == {}


def test_hooks_count_time_and_chain(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(("before", kw["repr"])) or False)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(("after", kw["repr"])))
    c = _CompileCounter()
    assert c.install() and c.install()  # once: a second install does not chain us twice
    assert c.counters() == {"triton_compiles": 0, "triton_compile_s": 0.0}
    for name in ("a", "b"):
        assert not knobs.runtime.jit_cache_hook(repr=name)  # a true answer would skip the compile
        knobs.runtime.jit_post_compile_hook(repr=name)
    assert c.counters()["triton_compiles"] == 2 and c.counters()["triton_compile_s"] >= 0
    assert [r for r, _ in c.recent] == ["a", "b"]  # triton's repr where the hook gives no kernel
    assert seen == [("before", "a"), ("after", "a"), ("before", "b"), ("after", "b")]


def test_label_names_the_constexprs():
    from types import SimpleNamespace

    from ostinato.kernels.triton import _label

    fn = SimpleNamespace(name="_w13_kernel", jit_function=SimpleNamespace(arg_names=["x_ptr", "R", "BLOCK_M"]))
    hook = {"repr": "r", "fn": fn, "compile": {"constants": {(2,): 64}, "num_warps": 4, "num_stages": 3}}
    assert _label(hook) == "_w13_kernel(BLOCK_M=64, num_warps=4, num_stages=3)"
    assert _label({"repr": "r", "fn": fn}) == "r"


@pytest.mark.gpu
def test_route_counts_do_not_respecialise():
    """Passes of odd and even token counts (routes divisible by 16 or not) reuse one compile of the
    index-table lookup and of the prefill alignment: before do_not_specialize, each new
    divisibility compiled the kernel again in the middle of a replay."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ostinato.kernels.triton import compiles
    from ostinato.kernels.triton.moe_prefill import align_forward
    from ostinato.kernels.triton.route import lookup_slots
    from ostinato.layers.moe.gpu_experts import DEFAULT_TUNING, padded_size

    assert compiles.install()
    dev = torch.device("cuda")
    E, K, slots_n, block_m = 128, 8, 64, 64
    table = torch.arange(E, dtype=torch.int32, device=dev) % slots_n
    cfg = DEFAULT_TUNING["align"]

    def run(T):
        ids = torch.randint(0, E, (T, K), dtype=torch.int32, device=dev)
        slots = lookup_slots(table, ids, 0)
        size = padded_size(T * K, block_m, slots_n)
        align_forward(slots, 0, 0, slots_n, block_m, size, cfg)

    run(200)  # the first: compiles
    torch.cuda.synchronize()
    before = compiles.count
    for T in (201, 202, 208, 257, 333, 512):
        run(T)
    torch.cuda.synchronize()
    assert compiles.count == before, compiles.recent[-(compiles.count - before):]
