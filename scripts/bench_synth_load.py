"""Where a synthetic gpt-oss-120b's load goes, one MoE layer at a time (session 46: 184-199 s a process, of
which 161-195 s for the experts; which step costs it was not timed).

The experts of `synth:gpt-oss-120b` are made on the GPU one at a time by the loader's reading of the
Hugging Face layout (synth/gpt_oss.py reader, loader/gpt_oss.py load_quantized_): each expert's bf16 weights
from the counter-based generator, quantized to MXFP4, repacked to Hugging Face's nibble order and back,
de-interleaved, and copied into the layer's host tensor. This times each of those steps alone (the device
synchronized around each, over --experts experts of layer 0) and then the loader's whole layer twice:
into pageable host memory (loader/build.py load_quantized_experts, as every policy's build read it before
session 47) and staged on the device the source generates on (loader/build.py load_layer_experts, as a
build reads it since), so that the step that costs the time is known before it is changed.

    python scripts/bench_synth_load.py [--preset gpt-oss-120b] [--experts 16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ostinato.loader import gpt_oss as layout  # noqa: E402
from ostinato.loader.build import load_layer_experts, load_quantized_experts  # noqa: E402
from ostinato.quant import formats  # noqa: E402
from ostinato.quant.mxfp4 import from_hf, to_hf  # noqa: E402
from ostinato.synth import gpt_oss as synth  # noqa: E402
from ostinato.synth.weights import SynthSpec  # noqa: E402


def timed(fn, device) -> tuple[object, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t


def spec_source(spec):
    from ostinato.synth.source import SynthSource

    return SynthSource(spec, None, spec.config)  # no tokenizer: the experts only


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt-oss-120b")
    ap.add_argument("--experts", type=int, default=16, help="experts of layer 0 timed step by step")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = SynthSpec(a.preset, layers=1)
    c = spec.config
    D, F = c["hidden_size"], c["intermediate_size"]
    host13 = torch.empty((a.experts, 2 * F, formats.row_bytes("MXFP4", D)), dtype=torch.uint8)
    pinned13 = torch.empty_like(host13, pin_memory=device.type == "cuda")
    steps: dict[str, float] = {}

    def add(name: str, seconds: float) -> None:
        steps[name] = steps.get(name, 0.0) + seconds

    base = layout.prefix(0) + "gate_up_proj"
    for e in range(-1, a.experts):  # e = -1: a warm-up, not counted
        k = max(e, 0)
        w, t_float = timed(lambda: synth.float_expert(spec, base, k, device), device)
        wt, t_t = timed(lambda: w.T.contiguous(), device)
        q, t_q = timed(lambda: formats.quantize(wt, "MXFP4"), device)
        hf, t_hf = timed(lambda: to_hf(q), device)
        rows, t_back = timed(lambda: layout.deinterleave(from_hf(*hf), 0), device)
        _, t_pageable = timed(lambda: host13[k].copy_(rows), device)
        _, t_pinned = timed(lambda: pinned13[k].copy_(rows), device)
        if e >= 0:
            for name, t in (("float (generator)", t_float), ("transpose", t_t), ("quantize MXFP4", t_q),
                            ("to Hugging Face order", t_hf), ("back, de-interleaved", t_back),
                            ("copy into pageable host", t_pageable), ("copy into page-locked host", t_pinned)):
                add(name, t)
    per_expert = {name: round(1e3 * t / a.experts, 3) for name, t in steps.items()}
    source = spec_source(spec)
    layer, t_layer = timed(lambda: load_quantized_experts(source, 0), device)
    staged, t_staged = timed(lambda: load_layer_experts(source, 0, source.expert_qtypes(0), device), device)
    E, layers = c["num_local_experts"], SynthSpec(a.preset).config["num_hidden_layers"]
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "preset": a.preset,
           "gate_up_ms_per_expert": per_expert, "gate_up_ms_per_expert_total": round(sum(per_expert.values()), 3),
           "layer_s": round(t_layer, 3), "experts_per_layer": E, "layers": layers,
           "all_layers_s_at_this_rate": round(t_layer * layers, 1),
           "staged_layer_s": round(t_staged, 3), "staged_on": staged.w13.device.type,
           "all_layers_staged_s_at_this_rate": round(t_staged * layers, 1),
           # the steps timed are the loader's: their rows equal its layer's
           "steps_equal_loader": torch.equal(layer.w13[:a.experts], host13),
           "staged_equal_loader": torch.equal(staged.w13.cpu(), layer.w13)}
    for name, ms in per_expert.items():
        print(f"{name:28s} {ms:9.3f} ms an expert's gate_up")
    print(f"one layer through the loader (load_quantized_experts, {E} experts): {t_layer:.2f} s; "
          f"{out['layers']} layers at this rate: {out['all_layers_s_at_this_rate']} s")
    print(f"one layer staged on {out['staged_on']} (load_layer_experts): {t_staged:.2f} s; "
          f"{out['layers']} layers at this rate: {out['all_layers_staged_s_at_this_rate']} s")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
