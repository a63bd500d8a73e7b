"""Where a decode step's GPU time goes ([Q]): one graph-replayed step, kernel by kernel.

Loads the model (every expert resident by default; `--residency` and `--gpu-memory` for a hybrid
plan), prefills `--context` tokens of the embedded sessions, then:

1. times `--steps` decode steps as the engine runs them (CUDA graph replays where it captured
   them), with CUDA events around each;
2. profiles `--profile-steps` of them with torch.profiler (CUPTI traces the kernels inside graph
   replays too) and, for the names, the same steps run eagerly (`decode_windowed`: the same
   kernels without the graph);
3. writes per kernel: launches per step, GPU time per step (us), and a class (gemm, attention,
   experts, norm, rope, router, handshake, copy, elementwise, other); per step: the sum of kernel
   time against the step's wall time (the difference is idle GPU: gaps, host waits);
4. sets that against the HBM bound: the bytes a step must read (dense and attention weights,
   lm_head, the KV cache to the context, the routed resident experts) over the measured
   device copy bandwidth.

    python scripts/profile_decode.py --model synth:qwen3-30b-a3b --out /tmp/res/q_profile

With `--prefill N...`, prefill passes instead ([K][Q]: where a tool turn's TTFT goes): the N tokens
that follow the context in the same sessions, run at the context's end as the engine runs them
(the placement's split, upload and mixed paths by the pass's size), timed `--steps` times by the
host's clock around the synchronized pass, and profiled `--profile-steps` times. Uploads are the
class `upload` (host-to-device copies), apart from the other copies; the kernels of every stream
are summed, so with uploads beside compute the kernel time can exceed the pass's wall time. The
profiled passes also say where their wall time went (`timeline`, pass_timeline): the host's time
inside the MoE backend (waiting for the CPU branch, synchronising for the routing) and outside it,
its launches, its outermost torch ops by name and the Python time between them, and each stream's busy
time; a pass whose host is busy while the GPU idles is bound by its launches and its Python, which graphs
would remove ([Q]). A last set of passes runs under cProfile (`python`): the host's Python by
function, own time first, which names the Python the timeline only counts. Each size writes
OUT/prefill_N.json and OUT/prefill_N.md.

Writes OUT/profile.json and OUT/profile.md; one JSON summary line on stdout. On a machine
without CUDA it runs on the CPU (the kernels are then aten ops; a smoke run, not a figure).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ostinato.bench.report import source_state  # noqa: E402
from ostinato.config import parse_bytes  # noqa: E402
from ostinato.engine.graph import env_pass_rows, pass_sizes  # noqa: E402
from ostinato.engine.kv_cache import KVCache  # noqa: E402
from ostinato.engine.placement import PlacementSettings  # noqa: E402
from ostinato.engine.runner import RunnerSettings  # noqa: E402
from ostinato.kernels.triton import fused_dense  # noqa: E402
from ostinato.layers.moe.backend import MoEBackend  # noqa: E402
from ostinato.load import load_engine  # noqa: E402
from ostinato.loader.build import expert_formats  # noqa: E402

# first match wins; names of our Triton kernels, cuBLAS/CUTLASS GEMMs and torch's own kernels
CLASSES = (
    ("handshake", r"_post|_wait|_add_rows|_bump"),
    ("staging", r"_stage_kernel"),  # a captured pass's copies of its staged experts (on the copy stream)
    ("upload", r"memcpy htod"),
    ("experts", r"_w13_kernel|_w2_kernel|_align_|_combine_kernel|_dequant_kernel"),
    ("attention", r"_split_kernel|_reduce_kernel|flash|attention|sdpa|fmha"),
    ("gemm", r"gemm|gemv|cutlass|xmma|nvjet|cublas|matmul|\bmm\b|addmm|linear"),
    ("norm", r"rms|norm"),
    ("rope", r"rope|rotary|cos|sin"),
    ("router", r"topk|sort|softmax|gather|index|scatter|argmax"),
    ("copy", r"memcpy|memset|copy|fill"),
    ("elementwise", r"elementwise|vectorized|reduce|unrolled|silu|mul|add|cat|where"),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for c, pat in CLASSES if re.search(pat, low)), "other")


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def prompt_ids(tok, n: int) -> list[int]:
    from ostinato.sessions.read import load_sessions
    from ostinato.planner.profile import session_stream

    ids: list[int] = []
    for s in load_sessions("embedded:8"):
        ids += session_stream(s, tok).ids
        if len(ids) >= n:
            break
    if len(ids) < n:
        raise SystemExit(f"the embedded sessions give {len(ids)} tokens, fewer than --context {n}")
    return ids[:n]


def step_times_ms(runner, token: int, pos: int, steps: int) -> list[float]:
    dev = runner.device
    times = []
    for i in range(steps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            runner.forward([token], pos + i)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            runner.forward([token], pos + i)
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def pass_times_ms(runner, tokens: list[int], start: int, reps: int) -> list[float]:
    """Wall time of a prefill pass at `start`, `reps` times (each pass writes the same KV rows)."""
    times = []
    for _ in range(reps):
        sync(runner.device)
        t0 = time.perf_counter()
        runner.forward(tokens, start)
        sync(runner.device)
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def pass_memory(loaded, tokens: list[int], start: int) -> dict | None:
    """What one prefill pass allocates beyond what was allocated before it (its peak, CUDA only),
    beside the capacity test's bound on it (planner/capacity.py pass_bound, by part): how loose the
    bound is, and which part is."""
    from ostinato.loader.build import weight_formats
    from ostinato.planner.capacity import pass_bound

    runner, dev = loaded.runner, loaded.runner.device
    if dev.type != "cuda":
        return None
    sync(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    runner.forward(tokens, start)
    sync(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    bound = pass_bound(runner.config, len(tokens), start + len(tokens), runner.dtype,
                       weight_formats(loaded.source, "native"))
    return {"peak_bytes": peak, "bound_bytes": bound["total"], "bound_parts": bound}


def device_time_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
        v = getattr(evt, attr, None)
        if v:
            return float(v)
    return 0.0


def profiled(fn, steps: int, on_cuda: bool):
    """torch.profiler over `steps` calls of fn (the kernels too on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        if on_cuda:
            torch.cuda.synchronize()
    return prof


def kernel_table(fn, steps: int, on_cuda: bool) -> list[dict]:
    """Profile `steps` calls of fn -> one row per kernel (launches and us per step, class)."""
    return kernel_rows(profiled(fn, steps, on_cuda), steps, on_cuda)


def kernel_rows(prof, steps: int, on_cuda: bool) -> list[dict]:
    rows = defaultdict(lambda: {"launches": 0, "us": 0.0})
    for e in prof.key_averages():
        if on_cuda:
            if "CUDA" not in str(getattr(e, "device_type", "")):  # the kernels, not the ops launching them
                continue
        elif not e.key.startswith("aten::") or e.key in ("aten::empty", "aten::view", "aten::as_strided"):
            continue
        us = device_time_us(e)
        if us <= 0:
            continue
        r = rows[e.key]
        r["launches"] += e.count
        r["us"] += us
    out = [{"kernel": k, "class": kernel_class(k), "launches_per_step": v["launches"] / steps,
            "us_per_step": v["us"] / steps} for k, v in rows.items()]
    return sorted(out, key=lambda r: -r["us_per_step"])


# host ranges the prefill profile marks (record_function): a pass with its closing sync, each MoE
# layer's call into the experts backend, and the backend's wait for its CPU branch
PASS, MOE, CPU_WAIT = "ostinato.pass", "ostinato.moe", "ostinato.cpu_wait"
SYNCS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def union_ms(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """The length (ms) of the union of spans (us), clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted(spans):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total / 1e3


def pass_timeline(events: list[dict]) -> dict:
    """Where each marked pass's wall time went, from a chrome trace's complete events (ph "X"):
    the host's time inside the MoE backend (of it: waiting for the CPU branch, and synchronising
    with the GPU) and outside it (attention, the dense layers, the routing: launches and Python),
    the host's launches and copies issued, its outermost torch ops (host_ops, on the pass's thread) and the
    Python left beside them (host_python_ms), and each stream's busy time. Means over the passes;
    `per_moe_layer` divides them by the MoE calls of a pass. A host that is neither waiting nor
    kept by the GPU while the GPU idles is the pass's bottleneck."""
    ev = [e for e in events if e.get("ph") == "X" and "dur" in e]

    def span(e):
        return float(e["ts"]), float(e["ts"]) + float(e["dur"])

    def annotated(name, inside):
        return [e for e in inside if e.get("cat") == "user_annotation" and e.get("name") == name]

    def marked(name, inside):
        return [span(e) for e in annotated(name, inside)]

    rows, ops = [], []
    for p in annotated(PASS, ev):
        lo, hi = span(p)
        inside = [e for e in ev if lo <= float(e["ts"]) < hi]
        moe = marked(MOE, inside)
        runtime = [e for e in inside if e.get("cat") in ("cuda_runtime", "cuda_driver")]
        syncs = [e for e in runtime if e.get("name") in SYNCS]
        launches = [e for e in runtime if "LaunchKernel" in e.get("name", "")]
        copies = [e for e in runtime if e.get("name", "").startswith(("cudaMemcpy", "cuMemcpy"))]
        streams = defaultdict(list)
        for e in inside:
            if e.get("cat") in DEVICE_CATS:
                streams[str(e.get("args", {}).get("stream", "?"))].append(span(e))
        ms = lambda es: sum(float(e["dur"]) for e in es) / 1e3  # noqa: E731
        in_moe = lambda e: any(a <= float(e["ts"]) < b for a, b in moe)  # noqa: E731
        wall, host_moe = (hi - lo) / 1e3, sum(b - a for a, b in moe) / 1e3
        rows.append({
            "wall_ms": wall, "moe_calls": len(moe), "host_in_moe_ms": host_moe,
            "host_outside_moe_ms": wall - host_moe,
            "cpu_wait_ms": sum(b - a for a, b in marked(CPU_WAIT, inside)) / 1e3,
            "sync_in_moe_ms": ms([e for e in syncs if in_moe(e)]),
            "sync_outside_moe_ms": ms([e for e in syncs if not in_moe(e)]),
            "launches": len(launches), "launch_host_ms": ms(launches),
            "copies_issued": len(copies), "copy_host_ms": ms(copies),
            "gpu_busy_ms": {s: union_ms(v, lo, hi) for s, v in sorted(streams.items())},
            "gpu_busy_any_ms": union_ms([x for v in streams.values() for x in v], lo, hi)})
        host = host_ops([e for e in inside if (e.get("pid"), e.get("tid")) == (p.get("pid"), p.get("tid"))], in_moe)
        rows[-1] |= {"host_ops_ms": sum(ms for side in ("in_moe", "outside_moe") for ms, _ in host[side].values()),
                     "host_runtime_alone_ms": host.pop("host_runtime_alone_ms")}
        ops.append(host)
    if not rows:
        return {}
    out = {k: statistics.fmean(r[k] for r in rows) for k in rows[0] if k != "gpu_busy_ms"}
    out["gpu_busy_ms"] = {s: statistics.fmean(r["gpu_busy_ms"].get(s, 0.0) for r in rows)
                          for s in sorted({s for r in rows for s in r["gpu_busy_ms"]})}
    out["gpu_idle_ms"] = out["wall_ms"] - out["gpu_busy_any_ms"]
    out["host_active_ms"] = out["wall_ms"] - out["cpu_wait_ms"] - out["sync_in_moe_ms"] - out["sync_outside_moe_ms"]
    # what is left of the host's time once its torch ops, its runtime calls outside them and its waits for the
    # CPU branch are taken out: the interpreter, in our code and in Triton's launch path (bounded by launches)
    out["host_python_ms"] = out["wall_ms"] - out["cpu_wait_ms"] - out["host_ops_ms"] - out["host_runtime_alone_ms"]
    out["host_ops"] = {side: top_ops([o[side] for o in ops], len(rows)) for side in ("in_moe", "outside_moe")}
    out["passes"] = len(rows)
    n = out["moe_calls"]
    out["per_moe_layer"] = {k: v / n for k, v in out.items() if k.endswith("_ms") and isinstance(v, float)} if n else {}
    return out


def host_ops(events: list[dict], in_moe) -> dict:
    """The host thread's torch ops in one pass (events: that thread's, in the pass): the outermost
    ops only (an op's nested ops and runtime calls are part of it), by name and side of the MoE
    backend's edge (in_moe(event)) -> {"in_moe" and "outside_moe": {name: [ms, calls]},
    "host_runtime_alone_ms": the runtime and driver calls outside any op (Triton's launches, event
    records and syncs)}."""
    out = {"host_runtime_alone_ms": 0.0, "in_moe": defaultdict(lambda: [0.0, 0]),
           "outside_moe": defaultdict(lambda: [0.0, 0])}
    end = float("-inf")  # where the outermost op open now ends
    for e in sorted((e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")),
                    key=lambda e: (float(e["ts"]), -float(e["dur"]))):
        a, d = float(e["ts"]), float(e["dur"])
        if a < end:
            continue  # inside an outer op
        if e["cat"] != "cpu_op":
            out["host_runtime_alone_ms"] += d / 1e3
            continue
        end = a + d
        row = out["in_moe" if in_moe(e) else "outside_moe"][e.get("name", "?")]
        row[0] += d / 1e3
        row[1] += 1
    return out


def top_ops(per_pass: list[dict], passes: int, n: int = 12) -> list[dict]:
    """The n ops of most host time, means a pass over the passes' {name: [ms, calls]}."""
    acc = defaultdict(lambda: [0.0, 0])
    for ops in per_pass:
        for name, (ms, calls) in ops.items():
            acc[name][0] += ms
            acc[name][1] += calls
    rows = [{"op": k, "ms": v[0] / passes, "calls": v[1] / passes} for k, v in acc.items()]
    return sorted(rows, key=lambda r: -r["ms"])[:n]


def marked_backend(runner):
    """A backend that marks each MoE call (MOE) and the CPU branch's wait inside it (CPU_WAIT) for
    the profiler, around the runner's own -> (backend, undo)."""
    from torch.profiler import record_function

    inner = runner.experts
    hybrid = getattr(inner, "unwrapped", inner)
    cpu = getattr(hybrid, "cpu", None)
    if cpu is not None and hasattr(cpu, "wait"):
        wait = cpu.wait

        def marked_wait(*args, **kw):
            with record_function(CPU_WAIT):
                return wait(*args, **kw)

        cpu.wait = marked_wait

    def undo():
        if cpu is not None and "wait" in vars(cpu):
            del cpu.wait

    return MarkedExperts(inner), undo


class MarkedExperts(MoEBackend):
    """The runner's backend with each MoE call marked (MOE) for the profiler: one chunk's, or every
    chunk's of a layer at once (MoEBackend.many), as the runner makes them."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, layer, x, topk):
        with torch.profiler.record_function(MOE):
            return self.inner(layer, x, topk)

    def many(self, layer, xs, topks):
        with torch.profiler.record_function(MOE):
            return self.inner.many(layer, xs, topks)


def python_profile(fn, passes: int, n: int = 30) -> dict:
    """The host's Python by function over `passes` calls of fn (cProfile, which costs each Python call
    about a microsecond more, so it ranks the functions rather than timing them): the pass's wall time
    under it, and the `n` functions of most own time (tottime: outside the functions they call; a C
    function such as a torch op is its own row, but under Python 3.12 a pybind11 method, such as the
    native CPU experts' submit, is not: its time is its caller's own) with their total time (cumtime),
    in ms a pass."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(passes):
        fn()
    prof.disable()
    wall = (time.perf_counter() - t0) / passes * 1e3
    rows = []
    for (file, line, name), (_, calls, tt, ct, _) in pstats.Stats(prof).stats.items():
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
        rows.append({"function": f"{name} ({where})", "calls": calls / passes, "own_ms": tt / passes * 1e3,
                     "total_ms": ct / passes * 1e3})
    rows.sort(key=lambda r: -r["own_ms"])
    return {"passes": passes, "wall_ms": wall, "own_ms": sum(r["own_ms"] for r in rows), "functions": rows[:n]}


def by_class(rows: list[dict]) -> dict[str, dict]:
    acc = defaultdict(lambda: {"launches_per_step": 0.0, "us_per_step": 0.0})
    for r in rows:
        a = acc[r["class"]]
        a["launches_per_step"] += r["launches_per_step"]
        a["us_per_step"] += r["us_per_step"]
    return dict(sorted(acc.items(), key=lambda kv: -kv[1]["us_per_step"]))


def bytes_per_step(runner, context: int, formats: dict | None = None) -> dict[str, int]:
    """What a decode step must read from GPU memory, by part; the routed experts in their block
    formats (formats[layer] = (qt13, qt2), loader.build.expert_formats) or the compute dtype."""
    from ostinato.engine.sizes import expert_sizes
    from ostinato.layers.quant_linear import quantized_bytes

    cfg, model = runner.config, runner.model
    emb = model.model.embed_tokens.weight
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if p.device.type == runner.device.type and p is not emb and ".experts." not in n)
    dense += quantized_bytes(model)  # the linear weights kept in their GGUF blocks (layers/quant_linear.py)
    tied = cfg.tie_word_embeddings
    kv = KVCache.bytes_needed(cfg, context, runner.dtype)  # the model's own cache layout (per-head K/V, MLA latent)
    sizes = expert_sizes(cfg, runner.dtype, formats)  # one expert's bytes per layer (w13 and w2)
    experts = cfg.num_experts_per_tok * sum(nbytes for _, nbytes in sizes.values())
    return {"dense_weights": int(dense + (emb.numel() * emb.element_size() if tied else 0)),
            "embedding_row": int(cfg.hidden_size * emb.element_size()),
            "kv_cache": int(kv), "routed_experts_if_resident": int(experts)}


def copy_gbps(dev) -> float | None:
    if dev.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(dev)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        dst.copy_(src)
    b.record()
    b.synchronize()
    return 2 * 10 * src.numel() / (a.elapsed_time(b) * 1e6)  # read + write, GB/s


def write_md(path: Path, out: dict) -> None:
    s, n = out["step"], out.get("prefill_tokens")
    what = f"Prefill pass of {n} tokens" if n else "Decode step"
    lines = [f"# {what} profile: {out['model']}", "",
             f"- commit `{out['commit']}`; {out['device']}; context {out['context']}; "
             f"placement: {out['placement']}; decode as graph: {out['graph']}; "
             f"dense part's fused kernels: {out.get('fused_dense')}"]
    if n:
        graph = out.get("pass_graph")
        how = f"replayed as a captured graph of {graph} rows" if graph else "host-driven"
        lines.append(f"- pass: median {s['median_ms']:.1f} ms (p90 {s['p90_ms']:.1f}) over {s['steps']} passes, "
                     f"{how}, host clock; the profile below is of the host-driven pass: kernels of every stream "
                     f"{s['kernel_ms']:.1f} ms, of which uploads {s['upload_ms']:.1f} ms")
        rp = out.get("replay")
        if rp:
            wait = rp["classes"].get("handshake", {}).get("us_per_step", 0.0) / 1e3
            lines.append(f"- the captured pass's replay: kernels {rp['kernel_ms']:.1f} ms a pass, of which the "
                         f"handshake's {wait:.1f} ms (its wait kernel spins while the CPU worker serves a layer; "
                         "the copy and the add join the worker's partial: the kernel table splits them)")
            w = rp.get("worker")
            if w:
                lines.append(f"- the CPU worker a replayed pass: {w['compute_ms']:.1f} ms computing over "
                             f"{w['layers_served']:.0f} layers ({w['cold_routes']:.0f} cold routes, "
                             f"{w['cold_experts']:.0f} experts), {w['wait_ms']:.1f} ms waiting for the GPU")
    else:
        lines.append(f"- step: median {s['median_ms']:.3f} ms (p90 {s['p90_ms']:.3f}) over {s['steps']} steps; "
                     f"kernels (graph replays) {s['kernel_ms_graph']:.3f} ms, idle GPU {s['idle_ms_graph']:.3f} ms")
    mem = out.get("memory")
    if mem:
        parts = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in mem["bound_parts"].items() if k != "total" and v)
        lines.append(f"- memory: the pass allocated at most {mem['peak_bytes'] / 2**20:.0f} MiB beyond what it found; "
                     f"the capacity test's bound for it is {mem['bound_bytes'] / 2**20:.0f} MiB ({parts})")
    tl = out.get("timeline")
    if tl:
        lines += timeline_md(tl)
    py = out.get("python")
    if py:
        lines += ["", f"## The host's Python by function (cProfile, {py['passes']} passes: {py['wall_ms']:.1f} ms a pass "
                      "under it; ranks, does not time)", "", "| function | calls a pass | own ms a pass | total ms a pass |",
                  "|---|---|---|---|"]
        lines += [f"| `{r['function'][:100]}` | {r['calls']:.0f} | {r['own_ms']:.2f} | {r['total_ms']:.2f} |"
                  for r in py["functions"]]
    hb = out.get("hbm")
    if hb:
        lines.append(f"- HBM: copy bandwidth {hb['copy_gbps']:.0f} GB/s; the dense part must read "
                     f"{hb['dense_bytes'] / 1e9:.2f} GB ({hb['dense_bound_ms']:.3f} ms), with the routed "
                     f"experts {hb['all_bytes'] / 1e9:.2f} GB ({hb['all_bound_ms']:.3f} ms)")
    unit = "pass" if n else "step"
    tables = [(title, out[key]) for title, key in (("By class, graph replays", "classes_graph"),
                                                   ("By class, eager", "classes_eager"), ("By class", "classes"))
              if key in out]
    if out.get("replay"):
        tables.append(("By class, the captured pass's replays", out["replay"]["classes"]))
    for title, classes in tables:
        lines += ["", f"## {title}", "", f"| class | launches / {unit} | us / {unit} |", "|---|---|---|"]
        lines += [f"| {c} | {v['launches_per_step']:.1f} | {v['us_per_step']:.1f} |" for c, v in classes.items()]
    lines += ["", f"## Kernels{'' if n else ', graph replays'} (top 40)", "",
              f"| kernel | class | launches / {unit} | us / {unit} |", "|---|---|---|---|"]
    lines += [f"| `{r['kernel'][:90]}` | {r['class']} | {r['launches_per_step']:.1f} | {r['us_per_step']:.1f} |"
              for r in out["kernels_graph"][:40]]
    path.write_text("\n".join(lines) + "\n")


TIMELINE_ROWS = (("wall_ms", "wall (profiled)"), ("host_in_moe_ms", "host inside the MoE backend"),
                 ("cpu_wait_ms", "- waiting for the CPU branch"), ("sync_in_moe_ms", "- synchronising with the GPU"),
                 ("host_outside_moe_ms", "host outside it (attention, dense layers, routing)"),
                 ("sync_outside_moe_ms", "- synchronising with the GPU"),
                 ("host_active_ms", "host neither waiting nor synchronising"),
                 ("host_ops_ms", "host inside torch ops (outermost)"),
                 ("host_runtime_alone_ms", "host in runtime calls outside them (Triton's launches, events)"),
                 ("host_python_ms", "host in Python alone (no op, no runtime call, no wait)"),
                 ("launch_host_ms", "host inside kernel launches"), ("copy_host_ms", "host inside copy calls"),
                 ("gpu_busy_any_ms", "GPU busy, any stream"), ("gpu_idle_ms", "GPU idle"))


def timeline_md(tl: dict) -> list[str]:
    per = tl.get("per_moe_layer", {})
    lines = ["", f"## Where the wall time went ({tl['passes']} profiled passes, {tl['moe_calls']:.0f} MoE calls each)",
             "", "| | ms a pass | ms a MoE layer |", "|---|---|---|"]
    for key, label in TIMELINE_ROWS:
        lines.append(f"| {label} | {tl[key]:.2f} | {per.get(key, float('nan')):.3f} |")
    lines.append(f"| kernel launches, copy calls issued | {tl['launches']:.0f}, {tl['copies_issued']:.0f} | |")
    lines += [f"| GPU stream {s} busy | {v:.2f} | |" for s, v in tl["gpu_busy_ms"].items()]
    for side, title in (("outside_moe", "outside the MoE backend"), ("in_moe", "inside the MoE backend")):
        rows = tl.get("host_ops", {}).get(side)
        if rows:
            lines += ["", f"### The host's torch ops {title} (outermost, most time first)", "",
                      "| op | ms a pass | calls a pass |", "|---|---|---|"]
            lines += [f"| `{r['op'][:80]}` | {r['ms']:.2f} | {r['calls']:.0f} |" for r in rows]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synth:qwen3-30b-a3b")
    ap.add_argument("--residency", help="a hybrid plan (default: every expert resident, on one device)")
    ap.add_argument("--gpu-memory", type=parse_bytes)
    ap.add_argument("--context", type=int, default=2048, help="tokens prefilled before the timed steps")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--prefill", type=int, nargs="+", default=[0], metavar="N",
                    help="profile prefill passes of N new tokens at the context's end instead of decode steps "
                         "(several sizes: OUT/prefill_N.json and .md each)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)

    place = PlacementSettings(residency=a.residency, gpu_memory=a.gpu_memory) if a.residency else None
    longest = max(a.prefill)
    # room for the captured pass a prefill of `longest` tokens pads to, as the bench's context gives it
    # (a context of just `longest` more ran a 384-token pass host-driven, where the bench replays it at 511)
    room = next((B for B in pass_sizes(env_pass_rows()) if B >= longest), longest)
    loaded = load_engine(a.model, RunnerSettings(max_context=a.context + max(room, a.steps + 4 * a.profile_steps) + 8),
                         place)
    runner, dev = loaded.runner, loaded.runner.device
    on_cuda = dev.type == "cuda"
    ids = prompt_ids(loaded.tokenizer, a.context + longest)
    runner.forward(ids[:a.context], 0)
    if longest:
        for n in sorted(set(a.prefill) - {0}):
            profile_prefill(a, loaded, ids[a.context:a.context + n])
        return 0
    tok, pos = ids[-1], a.context
    step_times_ms(runner, tok, pos, 4)  # warm
    pos += 4
    times = step_times_ms(runner, tok, pos, a.steps)
    pos += a.steps
    med = statistics.median(times)

    def graph_step():
        nonlocal pos
        runner.forward([tok], pos)
        pos += 1

    def eager_step():
        nonlocal pos
        runner.decode_windowed(tok, pos)
        pos += 1

    kg = kernel_table(graph_step, a.profile_steps, on_cuda)
    ke = kernel_table(eager_step, a.profile_steps, on_cuda)
    kernel_ms = sum(r["us_per_step"] for r in kg) / 1e3
    out = {"kind": "ostinato.profile_decode", **source_state(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "model": a.model, "device": torch.cuda.get_device_name(dev) if on_cuda else "cpu",
           "torch": torch.__version__, "threads": runner.threads.describe(), "context": a.context,
           "placement": a.residency or "every expert resident", "graph": runner.graphs is not None,
           "fused_dense": on_cuda and fused_dense(),  # the kernels are CUDA-only
           "step": {"steps": a.steps, "median_ms": med, "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))],
                    "kernel_ms_graph": kernel_ms, "idle_ms_graph": med - kernel_ms},
           "classes_graph": by_class(kg), "classes_eager": by_class(ke), "kernels_graph": kg, "kernels_eager": ke}
    gbps = copy_gbps(dev)
    if gbps:
        b = bytes_per_step(runner, a.context, expert_formats(loaded.source, "native"))
        dense = b["dense_weights"] + b["embedding_row"] + b["kv_cache"]
        every = dense + b["routed_experts_if_resident"]
        out["hbm"] = {"copy_gbps": gbps, "bytes": b, "dense_bytes": dense, "all_bytes": every,
                      "dense_bound_ms": dense / (gbps * 1e6), "all_bound_ms": every / (gbps * 1e6)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "profile.json").write_text(json.dumps(out, indent=1) + "\n")
    write_md(a.out / "profile.md", out)
    print(json.dumps({k: out[k] for k in ("commit", "device", "graph", "fused_dense", "step")} | {"hbm": out.get("hbm")}))
    return 0


def replay_profile(runner, tokens: list[int], start: int, passes: int) -> dict:
    """The captured pass's replays kernel by kernel (CUPTI traces the kernels inside graph replays), with
    the CPU worker's own clock: the handshake's wait kernel spins until the worker has served the
    layer, so its time is the GPU's wait for the CPU branch, and the worker's compute time says
    whether the CPU branch itself or the hand-over is slow."""
    worker = getattr(runner.experts, "worker", None)
    before = worker.stats() if worker is not None else None

    def one_pass():
        runner.forward(tokens, start)
        sync(runner.device)

    rows = kernel_table(one_pass, passes, True)
    for r in rows:  # a captured pass uploads nothing (GraphHybridExperts.captures_pass): its host-to-device
        if r["class"] == "upload":  # copies are the join's, the worker's partial into device rows
            r["class"] = "handshake"
    out = {"kernel_ms": sum(r["us_per_step"] for r in rows) / 1e3, "classes": by_class(rows), "kernels": rows}
    if before is not None:
        after = worker.stats()
        out["worker"] = {k: (after[k] - before[k]) / passes for k in ("layers_served", "cold_routes", "cold_experts")}
        out["worker"] |= {k.replace("_ns", "_ms"): (after[k] - before[k]) / passes / 1e6
                          for k in ("compute_ns", "wait_ns")}
    return out


def profile_prefill(a, loaded, tokens: list[int]) -> None:
    runner, dev = loaded.runner, loaded.runner.device
    on_cuda = dev.type == "cuda"
    pass_times_ms(runner, tokens, a.context, 2)  # warm: compiled kernels, the allocator's blocks
    times = pass_times_ms(runner, tokens, a.context, a.steps)
    from torch.profiler import record_function

    def marked_pass():
        with record_function(PASS):
            runner.forward(tokens, a.context)
            sync(dev)

    backend, undo = marked_backend(runner)
    try:
        with runner.experts_swapped(backend):
            prof = profiled(marked_pass, a.profile_steps, on_cuda)
    finally:
        undo()
    rows = kernel_rows(prof, a.profile_steps, on_cuda)
    classes = by_class(rows)
    graph = runner.passes.size_for(len(tokens), a.context) if runner.passes is not None else None
    replay = replay_profile(runner, tokens, a.context, a.profile_steps) if graph and on_cuda else None
    with runner.experts_swapped(runner.experts):  # host-driven, as the profile above (no captured pass)
        python = python_profile(lambda: pass_times_ms(runner, tokens, a.context, 1), a.profile_steps)
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        timeline = pass_timeline(json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"])
    out = {"kind": "ostinato.profile_prefill", **source_state(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": a.model,
           "device": torch.cuda.get_device_name(dev) if on_cuda else "cpu", "torch": torch.__version__,
           "threads": runner.threads.describe(), "context": a.context, "prefill_tokens": len(tokens),
           "placement": a.residency or "every expert resident", "graph": runner.graphs is not None,
           "pass_graph": graph, "replay": replay, "fused_dense": on_cuda and fused_dense(),
           "step": {"steps": a.steps, "median_ms": statistics.median(times),
                    "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))],
                    "kernel_ms": sum(r["us_per_step"] for r in rows) / 1e3,
                    "upload_ms": classes.get("upload", {}).get("us_per_step", 0.0) / 1e3},
           "timeline": timeline, "python": python, "memory": pass_memory(loaded, tokens, a.context), "classes": classes, "kernels": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"prefill_{len(tokens)}.json").write_text(json.dumps(out, indent=1) + "\n")
    write_md(a.out / f"prefill_{len(tokens)}.md", out | {"kernels_graph": rows})
    print(json.dumps({k: out[k] for k in ("commit", "device", "context", "prefill_tokens", "step")}))


if __name__ == "__main__":
    sys.exit(main())
