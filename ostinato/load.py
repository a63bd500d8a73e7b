"""Model argument + settings -> a ready engine and its tokenizer: the one place that wires
source, runner, placement and session slot together (generate, serve, replay, bench), and
the start-up summary of what it built (`startup_summary`), so every command states the
same facts: what was loaded, where the experts live, and the memory and threads it uses.

It sits above the engine and the planner: a load without a residency asks the planner for
the plan of every expert resident (`all_resident`) or whether one fits (`all_resident_fit`);
the engine itself imports nothing of the planner."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch

from ostinato.config import ConfigError
from ostinato.engine.gpu_memory import allocator_account, apply_memory_cap
from ostinato.engine.placement import PlacementSettings, hybrid_factory, placed_residency, resolve_np
from ostinato.engine.residency import Residency, model_fingerprint
from ostinato.engine.runner import ModelRunner, RunnerSettings
from ostinato.engine.session import Engine
from ostinato.threads import claim_host_thread
from ostinato.layers.moe.reference import ReferenceExperts
from ostinato.layers.quant_linear import QuantLinear
from ostinato.loader.build import dense_formats, expert_formats, weight_formats
from ostinato.loader.gguf import GGUFSource
from ostinato.sources import open_source
from ostinato.loader.tokenizer import ChatTokenizer
from ostinato.planner.capacity import CapacityError, CapacitySettings, plan_capacity
from ostinato.planner.pipeline import plan_residency, size_pool

log = logging.getLogger("ostinato")


@dataclass
class Loaded:
    engine: Engine
    tokenizer: ChatTokenizer
    source: object
    model_name: str
    placement: PlacementSettings | None = None
    residency: Residency | None = None  # the hybrid placement's plan, if one was given

    @property
    def runner(self) -> ModelRunner:
        return self.engine.runner


def load_engine(model: str, settings: RunnerSettings = RunnerSettings(), placement: PlacementSettings | None = None,
                experts_factory=None, announce: bool = True, residency: Residency | None = None) -> Loaded:
    """The placement comes from `placement` (a residency: hybrid CPU-GPU) or an explicit
    experts_factory(source, runner_settings); with neither, every expert resident: on one GPU in
    its pool (the executor of every plan), else on each device by the plain-PyTorch oracle.
    `announce`: log the start-up summary here (serve and generate log their own, later).
    `residency`: the plan to run in place of the file placement.residency names (a plan made or
    changed in memory: `ostinato calibrate` runs a plan's upload plan)."""
    if experts_factory is None and placement is not None and (residency is not None or placement.residency):
        residency = residency or Residency.load(placement.residency)  # read once, here
        if placement.gpu_memory is None and residency.gpu_memory:  # the cap it was planned for
            placement = dataclasses.replace(placement, gpu_memory=int(residency.gpu_memory))
        experts_factory = hybrid_factory(placement, residency)
        kv_tokens = residency.capacity.get("kv_tokens")
        if kv_tokens and settings.max_context is None:
            # the plan sized the pool next to a KV cache of this many tokens: a larger cache
            # could push the engine past the memory cap
            settings = dataclasses.replace(settings, max_context=int(kv_tokens))
    source = open_source(model)
    on_gpu = settings.torch_device().type == "cuda"
    if residency is not None:
        check_shapes(residency, source)
    elif experts_factory is None and placement is not None and placement.gpu_memory:
        if on_gpu:
            check_all_resident_fit(source, settings, placement.gpu_memory, str(model), placement.experts)
            apply_memory_cap(settings.torch_device(), placement.gpu_memory)
        else:
            log.info("--gpu-memory: no GPU here, the cap does not apply")
    if experts_factory is None and residency is None and on_gpu and len(settings.device_names()) == 1:
        # every expert on the GPU: the pool, its kernels and the decode graph of any plan, with the
        # experts in their file's formats (the plain-PyTorch oracle would dequantize a GGUF's)
        placement = placement or PlacementSettings()
        residency = all_resident(source, settings, placement.experts)
        experts_factory = hybrid_factory(placement, residency)
    tok = ChatTokenizer.from_dir(source.tokenizer_dir)
    if settings.torch_device().type == "cuda":  # the host thread on its core before the experts load
        claim_host_thread(settings.thread_layout())  # (its page-locked copies land on that core's node)
    t0 = time.perf_counter()
    step = "its experts"
    try:
        experts = experts_factory(source, settings) if experts_factory else None
        t_experts = time.perf_counter()
        step = "its dense weights, KV cache and graphs"
        # a GPU keeps the dense linear weights in their blocks too; a CPU computes with them dequantized once
        quantized = dense_formats(source, placement.experts if placement else "native") if on_gpu else None
        runner = ModelRunner(source, settings, experts=experts, quantized=quantized)
    except torch.OutOfMemoryError as e:
        raise ConfigError(f"{model}: out of GPU memory while loading {step} ({allocator_account(e)}); plan a "
                          "residency that fits "
                          "(`ostinato plan --gpu-memory ...`, then --residency) or give a smaller "
                          "--max-context") from None
    loaded = Loaded(Engine(runner, set(tok.eos_ids)), tok, source, str(model), placement, residency)
    if announce:
        log.info(summary_text(startup_summary(loaded)))
        t_end = time.perf_counter()  # where a load's time goes (session 18: 166 s for a 46 GB GGUF file)
        log.info(f"  load: {t_end - t0:.1f} s (experts {t_experts - t0:.1f} s, "
                 f"dense weights and graphs {t_end - t_experts:.1f} s)")
    return loaded


def all_resident(source, settings: RunnerSettings, experts: str = "native") -> Residency:
    """The plan of every expert resident (each layer's pool holds all its experts, in the formats
    `experts` keeps), held in memory: what the engine runs when no residency is given."""
    cfg = source.config
    ones = {l: torch.ones(cfg.num_experts) for l in cfg.moe_layers}
    size = size_pool(cfg, ones, settings.torch_dtype(cfg.torch_dtype), hot_fraction=1.0,
                     kv_tokens=settings.context(cfg), formats=weight_formats(source, experts))
    return plan_residency(source, ones, size, notes={"planned_by": "every expert resident (no residency given)"})


def capacity_under(source, settings: RunnerSettings, cap: int, experts: str = "native"):
    """The capacity test of this model under `cap` as the runner's settings would load it (its KV cache,
    prefill chunk and captured passes; the experts' bytes in the formats `experts` keeps); CapacityError
    where the dense weights, KV cache, activations and margin alone do not fit."""
    cfg = source.config
    return plan_capacity(cfg, {l: torch.ones(cfg.num_experts) for l in cfg.moe_layers}, cap, settings.context(cfg),
                         settings.torch_dtype(cfg.torch_dtype),
                         CapacitySettings(prefill_chunk=settings.prefill_chunk, pass_graph_rows=settings.pass_graphs),
                         formats=weight_formats(source, experts))


def all_resident_fit(source, settings: RunnerSettings, cap: int, experts: str = "native") -> bool:
    """Whether every expert (its bytes in the formats `experts` keeps) fits on the GPU under `cap`
    beside the dense weights, the KV cache, the activations and the margin (the capacity test)."""
    cfg = source.config
    try:
        return capacity_under(source, settings, cap, experts).max_hot_slots >= len(cfg.moe_layers) * cfg.num_experts
    except CapacityError:
        return False


def check_all_resident_fit(source, settings: RunnerSettings, cap: int, model: str, experts: str = "native") -> None:
    """Without a residency every expert goes onto the GPU: under a cap that cannot hold them, say
    what to do instead of running out of memory half way through the load."""
    cfg = source.config
    kv, total = settings.context(cfg), len(cfg.moe_layers) * cfg.num_experts
    if not all_resident_fit(source, settings, cap, experts):
        raise ConfigError(f"{model}: its {total} experts do not all fit under --gpu-memory {cap / 2**30:.1f} GiB "
                          f"with a {kv}-token KV cache; plan a residency for the cap first (`ostinato plan "
                          f"--model {model} --profile P --gpu-memory ... -o R`), then give --residency R")


def check_shapes(residency: Residency, source) -> None:
    """A plan made for other shapes fails naming both. The file records its experts per layer
    and its layers (those `devices` and `hot` list); the fingerprint decides, so a hand-edited
    file that lists fewer layers of the right model still loads."""
    cfg = source.config
    listed = sorted({l for v in residency.devices.values() for l in v} | set(residency.hot))
    layers = listed[-1] + 1 if listed else 0
    differ = residency.num_experts != cfg.num_experts or layers != cfg.num_hidden_layers
    if differ and model_fingerprint(source) != residency.fingerprint:
        exact = "" if listed == list(range(layers)) else "at least "
        raise ConfigError(f"the residency file was planned for another shape ({exact}{layers} layers of "
                          f"{residency.num_experts} experts; this model: {cfg.num_hidden_layers} layers of "
                          f"{cfg.num_experts} experts): run `ostinato plan` for this model")


def _expert_formats(loaded: Loaded) -> str:
    """"GGUF Q4_K/Q4_K x24 layers, Q4_K/Q6_K x24" or "checkpoint, bf16 experts"."""
    mode = loaded.placement.experts if loaded.placement else "native"
    counts = Counter("/".join(f) if f else None for f in expert_formats(loaded.source, mode).values())
    float_name = f"{str(loaded.runner.dtype).removeprefix('torch.')} experts"
    parts = [f"{name or float_name} x{n}" for name, n in counts.items()]
    parts[0] += " layers"
    kind = "GGUF" if isinstance(loaded.source, GGUFSource) else "checkpoint"
    return f"{kind} {', '.join(parts)}"


def _dense_weights(runner: ModelRunner) -> dict:
    """The dense weights on the runner's GPUs in bytes, and how many linear weights stay in which GGUF
    block format there (layers/quant_linear.py)."""
    kept = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    nbytes = sum(p.numel() * p.element_size() for p in runner.model.parameters() if p.is_cuda)
    nbytes += sum(m.qweight.numel() for m in kept if m.qweight.is_cuda)
    return {"bytes": nbytes, "blocks": dict(Counter(m.qtype for m in kept))}


def _gpu_share(residency: Residency) -> float | None:
    """The share of routes on the GPU the plan reported (held-out profile, else development)."""
    report = residency.notes.get("report") or {}
    for name in ("held-out", "development"):
        if "hot_share" in (report.get(name) or {}):
            return float(report[name]["hot_share"])
    return None


def startup_summary(loaded: Loaded, url: str | None = None) -> dict:
    """What was loaded and how it is placed, as a dict (generate --json prints it)."""
    runner, cfg, res = loaded.runner, loaded.source.config, loaded.residency
    devices = list(dict.fromkeys(runner.layer_devices or [str(runner.device)]))
    total = len(cfg.moe_layers) * cfg.num_experts
    on_gpu = runner.device.type == "cuda"
    if res is not None:
        res = placed_residency(loaded.placement, res)  # what the engine built from it (--borrow: its upload plan)
        resident, share = res.hot_count, (1.0 if res.hot_count == total else _gpu_share(res))
    elif isinstance(runner.experts, ReferenceExperts):  # every expert on the one device
        resident, share = (total, 1.0) if on_gpu else (0, 0.0)
    else:  # a baseline policy's placement: its own count says (bench reports it)
        resident, share = runner.experts.resident_experts(), None
    place = loaded.placement
    return {
        "model": loaded.model_name, "format": _expert_formats(loaded), "devices": devices,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "gpu_memory": place.gpu_memory if place else None,
        "residency": place.residency if place else None,
        "resident_experts": resident, "experts": total, "gpu_route_share": share,
        "dense_weights": _dense_weights(runner) if on_gpu else None,
        "kv_tokens": runner.max_context, "threads": runner.threads.describe(),
        "upload_threshold": resolve_np(place, res) if res is not None and res.hot_count < total else None,
        "url": url,
    }


def _dense_text(d: dict) -> str:
    """"  dense weights: 1.84 GB on the GPU, 129 linear weights in their blocks (Q4_K x112, Q6_K x17)"."""
    kept = sum(d["blocks"].values())
    blocks = ", ".join(f"{q} x{n}" for q, n in sorted(d["blocks"].items()))
    return f"  dense weights: {d['bytes'] / 1e9:.2f} GB on the GPU" + \
        (f", {kept} linear weights in their blocks ({blocks})" if kept else "")


def summary_text(s: dict) -> str:
    """The summary as the lines a person reads at start-up."""
    cap = f"{s['gpu_memory'] / 2**30:.1f} GiB" if s["gpu_memory"] else "none"
    share = f", {100 * s['gpu_route_share']:.1f}% of routes expected on the GPU" \
        if s["gpu_route_share"] is not None else ""
    lines = [f"ready: {s['model']} ({s['format']}, {s['dtype']}) on {', '.join(s['devices'])}, GPU memory cap {cap}",
             (f"  experts: {s['resident_experts']} of {s['experts']} resident on the GPU{share}"
              if s["resident_experts"] is not None else f"  experts: {s['experts']}, placed by the policy")
             + (f" (residency {s['residency']})" if s["residency"] else ""),
             *([_dense_text(s["dense_weights"])] if s.get("dense_weights") else []),
             f"  context: {s['kv_tokens']} KV tokens"
             + (f"; Np (upload threshold): {s['upload_threshold']} tokens" if s["upload_threshold"] else ""),
             "  " + s["threads"].replace("\n", "\n  ")]
    if s["url"]:
        lines.append(f"  serving on {s['url']}")
    return "\n".join(lines)


def warm_up(loaded, sizes: tuple[int, ...] = (64, 512)) -> None:
    """Passes of these sizes, of one size in each bucket of the device's prefill tile configs (bf16
    and quantized experts: gpu_experts.bucket_sizes) and of the runner's largest chunk, each with
    two decode steps, so that lazy initialisation and kernel compilation (per shape bucket and
    path) are not in a measured turn: a short warm-up left them to the first policy's first long
    turn (results/2026-12-01-h200-s5/README.md, "Static baselines as graphs")."""
    from ostinato.engine.sampling import SamplingParams
    from ostinato.planner.measure.prefill import prompt_ids

    runner = loaded.runner
    largest = min(runner.settings.prefill_chunk, runner.max_context - 4)
    if runner.device.type == "cuda":
        from ostinato.layers.moe.gpu_experts import bucket_sizes, device_tag, load_tuning
        from ostinato.layers.moe.gpu_quant import load_quant_tuning

        tag = device_tag(runner.device)
        sizes = (*sizes, *bucket_sizes(load_tuning(tag)), *bucket_sizes(load_quant_tuning(tag)))
    for n in sorted({min(s, largest) for s in sizes} | {largest}):
        prompt = prompt_ids(loaded.tokenizer, "embedded:2", n)
        for _ in loaded.engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0)):
            pass
        loaded.engine.reset()
