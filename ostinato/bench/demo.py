"""`ostinato demo`: the main job on the embedded default, in a few minutes on a laptop.

The tiny synthetic Qwen3-MoE (`synth:tiny`), a handful of generated agent sessions
(`embedded:N`), every policy under one budget (40% of the experts), on the GPU when there
is one and on the CPU otherwise, where the "GPU" side runs on the CPU device through the
same code, so the budget is logical and the timings show the mechanics, not the hardware.
Sized down from `ostinato bench`: a few turns per session, a short context, a short
length sweep, tuning on one development session. `gpu` runs over the budget as the
upper bound, and is marked so. Without a GPU the two branches share the machine, so the
"GPU" side gets one torch thread and the CPU experts the other cores (two thread pools
spinning on the same cores make every step wait on the scheduler). Ends with the
comparison table and the report folder.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from ostinato.bench.bench import BenchSettings, run_bench
from ostinato.engine.runner import RunnerSettings

DEMO_MODEL = "synth:tiny"


def demo_settings(out: str | Path = "ostinato-demo", sessions: str = "embedded:6", max_turns: int = 3,
                  device: str | None = None, quick: bool = False, **kw) -> BenchSettings:
    """The demo's size; `quick` is the CI size (one session per side, one turn, two sweep
    points, two thresholds, a quarter of the host-read probe's buffer): every step and every
    policy still runs."""
    from ostinato.planner.calibrate import CalibrateSettings

    calibration = CalibrateSettings(reps=5, gpu_reps=5, step_reps=4, sizes=(32, 128, 512), pass_layers=2,
                                    pass_reps=1, sessions="embedded:2")
    bs = BenchSettings(
        model=DEMO_MODEL, runner=RunnerSettings(device=device, max_context=4096, prefill_chunk=1024),
        sessions=sessions, hot_fraction=0.4, max_turns=max_turns, tune_sessions=1, tune_max_turns=2,
        sweep_sizes=(32, 64, 128, 256, 512), sweep_output=16, sweep_prefixes=2, sweep_prefix_tokens=256,
        upper_bound=True, calibration=calibration, out=Path(out))
    if quick:
        bs = replace(bs, max_sessions=1, max_turns=1, tune_max_turns=1, thresholds=(32, 512), sweep_sizes=(32, 64),
                     sweep_output=4, sweep_prefixes=1, sweep_prefix_tokens=128, host_read_gib=0.25,
                     calibration=replace(calibration, reps=2, gpu_reps=2, step_reps=2, sizes=(32,), pass_layers=1))
    return replace(bs, **kw)


def run_demo(bs: BenchSettings, stdout=None) -> dict:
    """stdout: where the table goes (default: sys.stdout as it is at the call)."""
    from ostinato.bench.report import format_table

    import torch

    stdout = stdout or sys.stdout

    threads = torch.get_num_threads()
    if bs.runner.torch_device().type == "cpu":
        torch.set_num_threads(1)
    try:
        result = run_bench(bs)
    finally:
        torch.set_num_threads(threads)
    print(file=stdout)
    print(f"Ostinato demo: {result['model']} on {result['device']}, {result['split']['held_out']} held-out "
          f"sessions, budget {result['budget']['pool_slots']} expert slots ({result['budget']['hot']} of "
          f"{result['budget']['total_experts']} experts resident for Ostinato); "
          f"skew: top {100 * result['skew']['top_fraction']:.0f}% of experts -> "
          f"{100 * result['skew']['held_out_all_share']:.1f}% of held-out routes", file=stdout)
    print(format_table(result), file=stdout)
    print(f"report: {result['files']['report']} (results.json and plots beside it)", file=stdout)
    return result
