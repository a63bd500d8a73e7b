"""The model and placement flags every engine-loading subcommand shares, and the settings they
make: one place for the flags, so the subcommands' CLIs need not import the top-level one."""
from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory, a .gguf file (or a folder holding one) or "
                   "synth:PRESET[?seed=S&layers=N]")
    p.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda if present)")
    p.add_argument("--devices", help="cuda:0,cuda:1,...: MoE layers split across these devices, in order "
                   "(a residency planned for several devices sets this itself)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="compute dtype (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--max-context", type=int, help="KV cache size in tokens")
    p.add_argument("--residency", help="residency file from `ostinato plan`: hybrid CPU-GPU experts")
    p.add_argument("--gpu-memory", help="GPU memory cap, e.g. 32GiB (the engine never allocates past it)")
    p.add_argument("--cpu-threads", type=int, help="CPU expert workers (default: every physical core left "
                   "after the host thread and one graph poller per GPU; a count that does not fit is run with a "
                   "note, workers sharing cores)")
    p.add_argument("--upload-threshold", type=int, help="Np: passes of at least this many tokens upload "
                   "cold experts (default: the calibrated value in the residency file)")
    p.add_argument("--no-mixed", action="store_true", help="split passes send nothing over PCIe (DESIGN.md's "
                   "split path); by default they upload their most-routed cold experts when the residency "
                   "holds a calibration")
    p.add_argument("--borrow", action="store_true", help="decode lends the flex slots to the cold experts it "
                   "keeps computing on the CPU (DESIGN.md's borrowed memory); off by default: measured slower "
                   "on the held-out sessions")
    p.add_argument("--experts", choices=["native", "bf16"], default="native", help="native: a GGUF file's routed "
                   "experts stay in its block formats (Q4_K, Q6_K, ...) on the GPU and in host memory, and so do its "
                   "attention projections and head on the GPU; bf16: everything dequantized at load")


def add_margin_args(p: argparse.ArgumentParser) -> None:
    """The capacity test's margin (planner/capacity.py CapacitySettings), for the subcommands that size a pool
    under --gpu-memory by it: plan and bench."""
    p.add_argument("--margin", help="fixed part of the capacity test's memory margin: the CUDA context and what "
                   "else the process holds outside torch's allocator (default 1GiB)")
    p.add_argument("--margin-fraction", type=float, help="plus this share of the budget (default 0)")


def margin_settings(a) -> dict:
    """CapacitySettings' margin fields from add_margin_args' flags: only those given (the rest keep its defaults),
    checked as CapacitySettings checks them, so a bad value is refused before any model loads."""
    from ostinato.config import parse_bytes
    from ostinato.planner.capacity import CapacitySettings

    out = {"margin_bytes": parse_bytes(a.margin)} if a.margin else {}
    if a.margin_fraction is not None:
        out["margin_fraction"] = a.margin_fraction
    CapacitySettings(**out)
    return out


def runner_settings(a):
    from ostinato.engine.runner import RunnerSettings

    return RunnerSettings(device=a.device, dtype=a.dtype, max_context=a.max_context,
                          devices=getattr(a, "devices", None), cpu_threads=getattr(a, "cpu_threads", None))


def placement_settings(a):
    from ostinato.config import parse_bytes
    from ostinato.engine.placement import PlacementSettings

    cap = parse_bytes(a.gpu_memory) if getattr(a, "gpu_memory", None) else None
    return PlacementSettings(residency=a.residency, gpu_memory=cap, upload_threshold=a.upload_threshold,
                             mixed=not getattr(a, "no_mixed", False), borrow=getattr(a, "borrow", False),
                             experts=getattr(a, "experts", None) or "native")
