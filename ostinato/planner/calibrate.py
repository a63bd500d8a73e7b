"""`ostinato calibrate`: the cost model's constants, measured inside the running engine.

The engine is loaded with the residency (pool, index tables, zero and flex slots, the
page-locked cold experts, the CPU thread pool, under the memory cap), and every timing
goes through its own objects, so the numbers include what serving pays. planner/measure/
holds the measurements, by what they measure:

  decode.py     G_l and C_l(r) (one token's GPU branch, and the host's time in the split path
                with r cold routes) per layer; dense, and decode steps forced to r cold routes
                (replayed as CUDA graphs when the engine decodes so);
  transfers.py  upload GB/s and expert bytes; host-memory read GB/s;
  prefill.py    n-token passes of a few layers (split, upload, their halves, split with
                uploads), the CPU pass fit and Np (the one-switch rule on the measured curves).

This module runs them in order, refuses a starved graph poller, and puts everything in
residency.calibration as data, with the device, date and versions; model_checks sets the
model's predictions for a residency and profile beside it.

Legend: K top-k, D hidden.
"""
from __future__ import annotations

import datetime
import platform
import time
from dataclasses import dataclass

import torch

from ostinato.config import ConfigError
from ostinato.threads import claim_host_thread
from ostinato.layers.moe.hybrid import HybridExperts, MixedPass
from ostinato.planner import cost_model as cm
from ostinato.planner.measure.timing import Clock
from ostinato.planner.measure.transfers import host_read_gbps, measure_upload

# the crossing on the H200 lay between 256 and 512; 192: the 30B Q4_K_M file's split with uploads tied at 128
# and won at 256, so its passes of 129-255 tokens (a quarter of session 28's tool turns) took the split path
DEFAULT_SIZES = (64, 128, 192, 256, 384, 512, 768, 1024, 2048)
# A graph step's CPU branch costs alpha per layer with a cold route beyond its routes' work: the
# handshake, a few microseconds when the poller has its core (0.02 ms on the H200 machine). A
# poller that shares its core waits for the scheduler instead (3.5 ms there: issue [H]). Both are
# judged against the host-driven alpha of the same layers, which holds the CPU branch's own fixed cost
# per layer: with experts of 88 MB (DeepSeek-V3-shaped on the H100 machine, session 50) that was 0.43 ms
# host-driven and 0.32 ms in the graph, a good layout. Beyond it by either limit the layout is wrong, and
# a plan on these constants would be too.
STARVED_ALPHA_MS = 0.2  # beyond the host-driven alpha
STARVED_ALPHA_RATIO = 10.0  # against the host-driven alpha of the same layers


@dataclass(frozen=True)
class CalibrateSettings:
    reps: int = 15  # one-token CPU-branch measurements per (layer, r)
    gpu_reps: int = 30  # one-token GPU-branch measurements per layer
    step_reps: int = 24  # forced-hot decode steps
    sizes: tuple[int, ...] = DEFAULT_SIZES
    pass_layers: int = 4  # layers whose n-token passes are timed
    pass_reps: int = 3
    mixed_reps: int = 7  # split passes with and without uploads, timed in pairs (measure_mixed)
    sessions: str = "embedded:4"  # prompts whose routing the passes use
    seed: int = 0


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({cpu_model()})"


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate(loaded, s: CalibrateSettings = CalibrateSettings(), progress: bool = True) -> dict:
    """Measure every constant of the cost model in this engine; -> the calibration dict."""
    runner = loaded.runner
    h = runner.experts.unwrapped if runner.experts is not None else None  # the branches are timed on the hybrid
    if not isinstance(h, HybridExperts):
        raise ValueError("calibrate needs the hybrid engine: load it with a residency")
    if h.cpu is None:
        raise ConfigError("calibrate measures the CPU branch and the uploads of cold experts, and this plan keeps "
                          "every expert resident: there is nothing to calibrate")
    graph = runner.experts if runner.experts is not h and runner.graphs is not None else None  # its decode graphs
    if h.on_cuda:
        claim_host_thread(runner.threads)  # as the runner serves: the host thread on its own core
    clock = Clock(h.device)
    gen = torch.Generator().manual_seed(s.seed)
    t0 = time.perf_counter()
    mixed_before, h.mixed = h.mixed, None  # the plain paths are measured, then the split with uploads
    try:
        return _calibrate(loaded, s, progress, runner, graph, h, clock, gen, t0)
    finally:
        h.mixed = mixed_before


def _calibrate(loaded, s, progress, runner, graph, h, clock, gen, t0) -> dict:
    from tqdm import tqdm

    # these two import the decode graphs and the session readers: loaded to calibrate, not with
    # this module (jobs/serve_plan.py imports it at the command line's start)
    from ostinato.planner.measure.decode import fit_decode, measure_layer, measure_steps
    from ostinato.planner.measure.prefill import fit_cpu_pass, measure_mixed, measure_passes

    cfg = runner.config
    K, D = cfg.num_experts_per_tok, cfg.hidden_size
    with torch.inference_mode():
        layers = {l: measure_layer(h, l, K, D, runner.dtype, clock, gen, s.reps, s.gpu_reps)
                  for l in tqdm(cfg.moe_layers, desc="calibrate layers", disable=not progress)}
        glob = fit_decode(layers)
        g_key = "G_graph_ms" if graph is not None else "G_ms"  # the GPU branch as decode pays it
        costs = {l: cm.LayerCost(d[g_key], d["gamma0_ms"], d["alpha_ms"], d["beta_ms"], h.on_cuda)
                 for l, d in layers.items()}
        with_cold = [l for l in cfg.moe_layers if layers[l]["cold"] > 0]
        gbps, eb = measure_upload(h, with_cold[:: max(1, len(with_cold) // 4)][:4], clock)
        read = host_read_gbps(h.cpu, set(h.cpu.cpus) | set(runner.threads.host), gib=2.0)  # the workers and the caller
        rs = tuple(sorted({0, 1, 2, K // 2, K}))
        step = measure_steps(runner, h, costs, clock, s.step_reps, gen, rs, graph=graph)
        if not handshake_ok(step, glob):  # measured once more before refusing: a transient, or a misconfiguration
            again = measure_steps(runner, h, costs, clock, s.step_reps, gen, rs, graph=graph)
            step = {**again, "first_forced_steps": step["forced_steps"]}
        check_handshake(step, glob, runner.threads)
        limit = min(runner.settings.prefill_chunk, h.max_tokens, runner.max_context - 1)
        sizes = sorted({n for n in s.sizes if n <= limit})
        pick = [with_cold[round(i * (len(with_cold) - 1) / max(1, s.pass_layers - 1))]
                for i in range(min(s.pass_layers, len(with_cold)))]
        pick = sorted(set(pick))
        passes = (measure_passes(runner, h, loaded.tokenizer, pick, clock, sizes, s.sessions, s.pass_reps)
                  if sizes and pick else {})
    cpu_pass = fit_cpu_pass(passes.pop("cpu_points", []), layers)
    routing = passes.pop("routing", None)
    mixed = MixedPass.from_calibration({"cpu_pass": cpu_pass, "upload_gbps": gbps, "expert_bytes": eb},
                                       measured=False)
    if passes and h.on_cuda and mixed is not None:  # with a PCIe link beside the CPU: split with uploads
        with torch.inference_mode():
            passes.update(measure_mixed(h, routing, passes, mixed, clock, s.mixed_reps))
    np_ = passes.get("upload_threshold")
    if passes and np_ is None:
        np_ = max(sizes) + 1  # upload never cheaper up to the largest pass the runner makes
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {
        "version": 1, "device": device_name(h.device), "cpu": cpu_model(), "date": now, "torch": torch.__version__,
        "dtype": str(runner.dtype).removeprefix("torch."), "cpu_threads": h.cpu.num_threads,
        "threads": {**runner.threads.as_dict(), "cpu_workers": list(h.cpu.cpus)},
        "cpu_backend": h.cpu.backend, "hot_experts": h.pools.num_hot, "units": "ms, GB/s, bytes",
        "overlapped": h.on_cuda,
        "global": glob,
        "layers": {str(l): d for l, d in layers.items()},
        "upload_gbps": gbps, "expert_bytes": eb, "host_read_gbps": read["gbps"],
        "host_read_probe": read["probe"],
        **step,
        "cpu_pass": cpu_pass,
        "passes": passes,
        "upload_threshold": np_,
        "upload_threshold_crossings": passes.get("crossings", 0),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def handshake_ok(step: dict, glob: dict) -> bool:
    """False when a graph calibration's CPU branch costs far more per layer than the host-driven
    branch plus a handshake (a starved poller); True off the graph path."""
    fit = step.get("graph_fit")
    if not fit:
        return True
    alpha, host = fit["alpha_ms"], glob["alpha_ms"]
    return not (alpha > host + STARVED_ALPHA_MS or (host > 0 and alpha > STARVED_ALPHA_RATIO * host))


def check_handshake(step: dict, glob: dict, threads) -> None:
    """A graph calibration that fails handshake_ok (measured twice) is a misconfiguration, not a
    constant to plan on: refuse it, saying why."""
    if not handshake_ok(step, glob):
        alpha, host = step["graph_fit"]["alpha_ms"], glob["alpha_ms"]
        fmt = lambda fs: ", ".join(f"r={r}: {m:.2f} ms" for r, m in zip(fs["r"], fs["measured_ms"]))  # noqa: E731
        steps = fmt(step["forced_steps"])
        if "first_forced_steps" in step:
            steps += f"; measured before: {fmt(step['first_forced_steps'])}"
        raise ConfigError(
            f"the CPU branch inside the decode graph costs alpha {alpha:.3f} ms per layer (host-driven "
            f"{host:.3f} ms; forced steps {steps}): the graph poller is starved of its core, so this "
            f"calibration is not saved. The layout was:\n{threads.describe()}\nLeave --cpu-threads out (the "
            "default gives the poller and the host thread cores of their own), or lower it, and check that "
            "nothing else runs busy threads on these CPUs")


def model_checks(cal: dict, counts, hot: dict[int, list[int]], cfg) -> dict:
    """What the calibrated model predicts for this residency and profile: the decode step
    (at a context of half the longest request), cold routes per token and layer, and Np (on
    all layers, and on the measured layers and sizes, to set beside the measured Np)."""
    K = cfg.num_experts_per_tok
    costs = cm.layer_costs(cal, cfg.moe_layers)
    context = counts.max_tokens / 2
    pred = cm.predict_decode_step(counts.decode, counts.tokens["decode"], hot, costs, K, cm.dense_ms(cal, context))
    out = {"decode_step_ms": pred.total_ms, "decode_moe_ms": pred.moe_ms, "context": context,
           "cold_routes_per_token_layer": pred.cold_routes_per_layer}
    if cm.read_gbps(cal) and cal.get("expert_bytes"):
        out["decode_bound_ms"] = cm.decode_bound(pred, costs, cal["expert_bytes"], cm.read_gbps(cal))
    passes = cal.get("passes") or {}
    if passes.get("sizes"):
        pc = cm.PassCosts.from_calibration(cal)
        probs = {l: cm.route_probs(counts.prefill[l], counts.tokens["prefill"], K) for l in cfg.moe_layers}
        sizes = passes["sizes"]
        grid = list(range(16, max(sizes) + 1, 16))
        out["upload_threshold"], out["upload_threshold_crossings"], _ = cm.model_threshold(probs, hot, pc, grid)
        sub = {l: probs[l] for l in passes["layers"]}
        np_s, _, curve = cm.model_threshold(sub, hot, pc, sizes)
        out["upload_threshold_on_sizes"] = np_s
        out["split_ms"] = [c[1] for c in curve]
        out["upload_ms"] = [c[2] for c in curve]
    return out
