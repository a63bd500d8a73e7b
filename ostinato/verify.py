"""The capacity plan checked in the engine: the largest pass of the longest request run under
the cap, its peak allocation read back (planner/capacity.py computes the plan)."""
from __future__ import annotations

import torch

from ostinato.config import ConfigError
from ostinato.engine.placement import PlacementSettings
from ostinato.engine.runner import RunnerSettings
from ostinato.load import load_engine
from ostinato.planner.capacity import Capacity


def verify_capacity(model: str, residency_path: str, cap: Capacity, cpu_threads: int | None = None,
                    device: str | None = None, dtype: str | None = None, experts: str = "native") -> dict:
    """Run the largest pass of the longest request (the last full chunk, attending to all
    kv_tokens) and one decode step in the engine under the cap; report the peak allocation.

    Earlier chunks of the request attend to fewer tokens and need less, so the synthetic
    pass (random token ids, KV cache of zeros) bounds the request's peak.
    """
    settings = RunnerSettings(device=device, dtype=dtype, max_context=cap.kv_tokens, prefill_chunk=cap.pass_tokens,
                              cpu_threads=cpu_threads)
    if settings.torch_device().type != "cuda":
        return {"skipped": "no CUDA device here (or the plan is for the CPU): the plan was not run under the cap"}
    try:
        loaded = load_engine(model, settings,
                             PlacementSettings(residency=residency_path, gpu_memory=cap.budget, experts=experts))
    except (torch.OutOfMemoryError, ConfigError) as e:
        return {"ok": False, "tokens": cap.kv_tokens, "error": f"failed to load: {str(e).splitlines()[0]}",
                "peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved()}
    runner = loaded.runner
    n = cap.kv_tokens
    T = min(cap.pass_tokens, max(n - 2, 0))  # start >= 1: a masked pass, as a later turn's prefill
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, runner.config.vocab_size, (n,), generator=g).tolist()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    result = {"device": torch.cuda.get_device_name(), "tokens": n, "pass_tokens": T, "budget": cap.budget,
              "planned": cap.fixed - cap.margin + cap.pool_bytes}  # what the plan expects to allocate at most
    try:
        if T > 0:
            runner.forward(ids[n - 1 - T:n - 1], n - 1 - T)
        runner.forward(ids[n - 1:], n - 1)
        torch.cuda.synchronize()
        result["error"] = None
    except torch.OutOfMemoryError as e:
        result["error"] = f"out of memory: {str(e).splitlines()[0]}"
    result["peak_allocated"] = torch.cuda.max_memory_allocated()
    result["peak_reserved"] = torch.cuda.max_memory_reserved()
    result["ok"] = result["error"] is None and result["peak_allocated"] <= cap.budget
    return result
