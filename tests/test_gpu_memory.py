"""The GPU memory cap as nvidia-smi counts it (engine/gpu_memory.py): parsing its process list,
and the allocator's share of a cap beside what lies outside it."""
from __future__ import annotations

import pytest
import torch

from ostinato.config import ConfigError
from ostinato.engine.gpu_memory import MiB, allocator_limit, apply_memory_cap, parse_compute_apps

LISTING = """\
4242, 12206, GPU-5b0f7c2e-0000-1111-2222-333344445555
977, 500, GPU-5b0f7c2e-0000-1111-2222-333344445555
4242, 300, GPU-aaaaaaaa-0000-1111-2222-333344445555
4242, [N/A], GPU-bbbbbbbb-0000-1111-2222-333344445555
"""


def test_parse_compute_apps_sums_one_process_per_gpu():
    assert parse_compute_apps(LISTING, 4242) == 12206 + 300  # [N/A] (no permission) is not a figure
    assert parse_compute_apps(LISTING, 4242, uuid="5b0f7c2e-0000-1111-2222-333344445555") == 12206
    assert parse_compute_apps(LISTING, 4242, uuid="aaaaaaaa") == 300
    assert parse_compute_apps(LISTING, 977) == 500
    assert parse_compute_apps(LISTING, 1) is None and parse_compute_apps("", 4242) is None


def test_allocator_limit_leaves_room_for_what_lies_outside():
    GiB = 2**30
    assert allocator_limit(12 * GiB, 140 * GiB, 512 * MiB) == 12 * GiB - 512 * MiB
    with pytest.raises(ConfigError, match="exceeds the device"):
        allocator_limit(160 * GiB, 140 * GiB, 0)
    with pytest.raises(ConfigError, match="outside its allocator"):
        allocator_limit(256 * MiB, 140 * GiB, 512 * MiB)


def test_no_cap_off_cuda():
    apply_memory_cap(torch.device("cpu"), 2**30)  # nothing to hold: the CPU has no allocator cap
    apply_memory_cap(torch.device("cpu"), None)


@pytest.mark.gpu
def test_cap_holds_the_process_as_nvidia_smi_counts_it():
    """Under a cap the allocator gets less than the cap by what lies outside it, and allocating up
    to its limit keeps the process (nvidia-smi) under the cap."""
    from ostinato.engine.gpu_memory import memory_figures, outside_allocator_bytes

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda", 0)
    torch.cuda.empty_cache()  # earlier tests' cached blocks would serve the allocation that must fail (s10)
    outside = outside_allocator_bytes(dev)
    assert outside > 0  # at least the CUDA context
    cap = 4 * 2**30
    apply_memory_cap(dev, cap)
    try:
        total = torch.cuda.get_device_properties(dev).total_memory
        free_for_torch = cap - outside - torch.cuda.memory_reserved(dev)
        x = torch.empty(int(free_for_torch * 0.9), dtype=torch.uint8, device=dev)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(free_for_torch * 0.2), dtype=torch.uint8, device=dev)
        figures = memory_figures(dev)
        if figures["process_mib"] is not None:
            assert figures["process_mib"] * MiB <= cap
        del x
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()
        assert total > cap


def test_no_allocator_counters_off_cuda():
    from ostinato.engine.gpu_memory import allocator_counters

    assert allocator_counters(["cpu", "cpu:1"]) == {}


@pytest.mark.gpu
def test_allocator_counters_count_the_mallocs_and_the_retries_under_a_cap():
    """A replayed turn carries the allocator's cudaMalloc calls and retries (runner.placement_stats):
    an allocation the cached blocks cannot serve is a cudaMalloc; one that meets the cap with blocks
    cached frees them and retries."""
    from ostinato.engine.gpu_memory import allocator_counters, outside_allocator_bytes

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    before = allocator_counters([dev])
    cap = 4 * 2**30
    free_for_torch = cap - outside_allocator_bytes(dev) - torch.cuda.memory_reserved(dev)
    apply_memory_cap(dev, cap)
    try:
        a = torch.empty(int(free_for_torch * 0.5), dtype=torch.uint8, device=dev)
        del a  # cached, not freed
        b = torch.empty(int(free_for_torch * 0.7), dtype=torch.uint8, device=dev)  # fits once a's block goes
        del b
        after = allocator_counters([dev, "cpu"])
        assert after["cuda_mallocs"] - before["cuda_mallocs"] >= 2
        assert after["cuda_malloc_retries"] - before["cuda_malloc_retries"] >= 1
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()
