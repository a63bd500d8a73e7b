"""Issue [H]: the decode step and the replayed TPOT under several thread layouts, in one process.

The engine loads once (model, pool, page-locked host experts); for each layout only the CPU side
is rebuilt: a new CpuExperts pool on the layout's workers, a new graph poller on its core, the
host thread pinned to its CPUs, the decode graphs captured again. Per layout it measures

- decode steps forced to r = 0, 1, 2 cold routes per layer, replayed as graphs (planner/measure's
  measure_steps), and the graph alpha / beta fitted to them with the residency's G per layer;
- nonvoluntary context switches of the host thread, the poller and the workers over those steps
  (a thread that shares its core with a busy one is switched out by the scheduler: the cause);
- a replay of held-out sessions (TTFT, TPOT, total request time) through the engine.

Layouts: `default` (no --cpu-threads), a worker count N (`--cpu-threads N`), and `old15`, the
layout of commit 5a8b237 on a 16-core machine: 15 workers on cores 1-15, the poller on core 0,
the host thread unpinned (every allowed CPU).

    python scripts/thread_sweep.py --model synth:qwen3-30b-a3b --residency res-cap.json \
        --gpu-memory 32GiB --sessions .carry/agent --layouts old15 default 10 12 13 14 --json-out sweep.json

The last line printed is one JSON document (also written to --json-out).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ostinato.bench.bench import select_sessions  # noqa: E402
from ostinato.bench.metrics import summarize  # noqa: E402
from ostinato.bench.replay import InProcessTarget, replay_sessions  # noqa: E402
from ostinato.bench.report import hardware, source_state  # noqa: E402
from ostinato.config import parse_bytes  # noqa: E402
from ostinato.engine.placement import PlacementSettings  # noqa: E402
from ostinato.engine.residency import Residency  # noqa: E402
from ostinato.engine.runner import RunnerSettings  # noqa: E402
from ostinato.threads import ThreadLayout, Topology, WorkerGroup, claim_host_thread  # noqa: E402
from ostinato.layers.moe.cpu_experts import CpuExperts  # noqa: E402
from ostinato.load import load_engine  # noqa: E402
from ostinato.planner import cost_model as cm  # noqa: E402
from ostinato.planner.measure.decode import measure_steps  # noqa: E402
from ostinato.planner.measure.timing import Clock  # noqa: E402


def old_layout(settings: RunnerSettings, workers: int) -> ThreadLayout:
    """5a8b237's choice: workers on the physical cores after the first, the poller on the first,
    the host thread wherever the scheduler puts it."""
    cores = [c[0].id for c in Topology.read().cores()]
    new = settings.thread_layout()
    return ThreadLayout(tuple(c.id for c in Topology.read().cpus), (cores[0],),
                        (WorkerGroup(tuple(cores[1:1 + workers]), (0,)),), False, ("the layout of 5a8b237",),
                        new.allowed, new.physical, workers, True)


def use_layout(loaded, layout: ThreadLayout) -> None:
    """Rebuild the CPU side of the loaded hybrid engine on `layout`; capture its graphs again."""
    runner = loaded.runner
    old = runner.experts
    h = old.unwrapped
    runner.set_experts(None)
    if old is not h:
        old.stop()  # stops the poller; the hybrid stays as it is
    h.cpu.close()
    h.cpu = CpuExperts(h.host.layers, backend="native", cpus=layout.workers)
    runner.threads = layout
    claim_host_thread(layout)
    runner.set_experts(h)  # the graph backend takes the layout's poller core
    loaded.engine.reset()


def switches() -> dict[int, tuple[int, set[int]]]:
    """tid -> (nonvoluntary context switches, allowed CPUs) of every thread of this process."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        allowed = set()
        for part in fields.get("Cpus_allowed_list", "").strip().split(","):
            if part:
                lo, _, hi = part.partition("-")
                allowed |= set(range(int(lo), int(hi or lo) + 1))
        out[int(task.name)] = (int(fields.get("nonvoluntary_ctxt_switches", "0")), allowed)
    return out


def role_switches(before, after, layout: ThreadLayout) -> dict[str, int]:
    """Nonvoluntary switches per role over an interval: host (this thread), poller, workers."""
    me = threading.get_native_id()
    roles = {"host": 0, "poller": 0, "workers": 0, "other": 0}
    for tid, (n, cpus) in after.items():
        d = n - before.get(tid, (0, cpus))[0]
        if tid == me:
            roles["host"] += d
        elif layout.pollers and cpus == {layout.pollers[0]}:
            roles["poller"] += d
        elif len(cpus) == 1 and next(iter(cpus)) in layout.workers:
            roles["workers"] += d
        else:
            roles["other"] += d
    return roles


def forced_steps(loaded, cal: dict, reps: int) -> dict:
    runner = loaded.runner
    h = runner.experts.unwrapped
    costs = cm.layer_costs(cal, runner.config.moe_layers)
    clock = Clock(h.device)
    gen = torch.Generator().manual_seed(0)
    graph = runner.experts if runner.graphs is not None else None  # host-driven where no graph runs (a CPU)
    with torch.inference_mode():
        step = measure_steps(runner, h, costs, clock, reps, gen, (0, 1, 2), graph=graph)
    fs = step["forced_steps"]
    fit = step.get("graph_fit") or {}
    return {"measured_ms": dict(zip(fs["r"], fs["measured_ms"])), "graph_alpha_ms": fit.get("alpha_ms"),
            "graph_beta_ms": fit.get("beta_ms"), "dense_step_ms": step["dense_step_ms"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--residency", required=True, help="a calibrated plan (ostinato plan + calibrate)")
    ap.add_argument("--gpu-memory")
    ap.add_argument("--sessions", required=True)
    ap.add_argument("--layouts", nargs="+", default=["default", "10", "12", "13", "14"])
    ap.add_argument("--max-sessions", type=int, default=4)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--step-reps", type=int, default=16)
    ap.add_argument("--old-turns", type=int, default=1, help="turns per session replayed under an old layout "
                    "(it decodes ~9x slower)")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    res = Residency.load(a.residency)
    cal = res.calibration
    if not cal.get("layers"):
        raise SystemExit(f"{a.residency} has no calibration: run `ostinato calibrate` first")
    cap = parse_bytes(a.gpu_memory) if a.gpu_memory else res.gpu_memory
    kv = res.capacity.get("kv_tokens")
    settings = RunnerSettings(max_context=kv)
    t0 = time.perf_counter()
    loaded = load_engine(a.model, settings, PlacementSettings(residency=a.residency, gpu_memory=cap))
    print(f"loaded in {time.perf_counter() - t0:.0f} s; {loaded.runner.threads.describe()}", flush=True)
    _, held = select_sessions(a.sessions, a.max_sessions)
    rows, sample = [], {}
    for name in a.layouts:
        if name == "default":
            layout = settings.thread_layout()
        elif name.startswith("old"):
            layout = old_layout(settings, int(name[3:]))
        else:
            layout = RunnerSettings(max_context=kv, cpu_threads=int(name)).thread_layout()
        use_layout(loaded, layout)
        before = switches()
        steps = forced_steps(loaded, cal, a.step_reps)
        ctx = role_switches(before, switches(), layout)
        t1 = time.perf_counter()
        turns = a.old_turns if name.startswith("old") else a.max_turns
        results = replay_sessions(InProcessTarget(loaded), held, tokenizer=loaded.tokenizer, max_turns=turns,
                                  max_output=a.max_output)
        s = summarize(results, len(loaded.runner.config.moe_layers))
        row = {"layout": name, "threads": layout.as_dict(), "forced": steps, "nonvoluntary_switches": ctx,
               "tpot_ms": s["tpot_ms"], "ttft_ms_median": s["ttft_ms"]["median"], "request_s": s["request_s"],
               "turns": s["turns"], "output_tokens": s["output_tokens"]["total"],
               "replay_s": round(time.perf_counter() - t1, 1)}
        rows.append(row)
        if not name.startswith("old"):
            sample = {"sessions": len({r.session for r in results}), "turns": s["turns"]}
        m = steps["measured_ms"]
        print(f"{name:>8}: {len(layout.workers):2d} workers, poller {layout.pollers}, host {_short(layout.host)} | "
              f"forced r=0/1/2 {m[0]:.2f}/{m[1]:.2f}/{m[2]:.2f} ms, graph alpha {_ms(steps['graph_alpha_ms'])} ms | "
              f"switches host {ctx['host']} poller {ctx['poller']} workers {ctx['workers']} | TPOT median "
              f"{s['tpot_ms']['median']:.2f} ms, TTFT tool {s['ttft_ms']['median'].get('tool')}, total "
              f"{s['request_s']['total']:.2f} s ({s['turns']} turns)", flush=True)
    tpots = {r["layout"]: r["tpot_ms"]["median"] for r in rows}
    numbered = {k: v for k, v in tpots.items() if k.isdigit()}
    doc = {"kind": "ostinato.thread_sweep", **source_state(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "hardware": hardware(), "model": a.model, "cap": cap, "residency": a.residency,
           "sample": {**sample, "max_turns": a.max_turns, "max_output": a.max_output, "split": "held-out"},
           "rows": rows}
    if "default" in tpots and numbered:
        best = min(numbered, key=numbered.get)
        doc["default_vs_best"] = {"best": best, "ratio": round(tpots["default"] / numbered[best], 4)}
        print(f"default TPOT {tpots['default']:.2f} ms against the best explicit ({best}) {numbered[best]:.2f} ms: "
              f"{doc['default_vs_best']['ratio']:.3f}x")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))
    return 0


def _ms(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _short(cpus) -> str:
    cpus = sorted(cpus)
    return str(cpus[0]) if len(cpus) == 1 else f"{cpus[0]}-{cpus[-1]} ({len(cpus)} CPUs)"


if __name__ == "__main__":
    sys.exit(main())
