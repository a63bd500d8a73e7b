"""`ostinato` command line: one subcommand per job, each a thin wrapper over the package."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from ostinato.config import ConfigError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory or synth:PRESET[?seed=S&layers=N]")
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


def _runner_settings(a):
    from ostinato.engine.runner import RunnerSettings

    return RunnerSettings(device=a.device, dtype=a.dtype, max_context=a.max_context,
                          devices=getattr(a, "devices", None), cpu_threads=getattr(a, "cpu_threads", None))


def _placement(a):
    from ostinato.config import parse_bytes
    from ostinato.engine.placement import PlacementSettings

    cap = parse_bytes(a.gpu_memory) if getattr(a, "gpu_memory", None) else None
    return PlacementSettings(residency=a.residency, gpu_memory=cap, upload_threshold=a.upload_threshold,
                             mixed=not getattr(a, "no_mixed", False))


def cmd_synth(a) -> int:
    from ostinato.synth.build import write_checkpoint

    t0 = time.perf_counter()
    out = write_checkpoint(a.preset, a.out, seed=a.seed, layers=a.layers, skew=a.skew,
                           progress=lambda i, n: print(f"  shard {i}/{n}", file=sys.stderr))
    print(f"wrote {a.preset} to {out} in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_generate(a) -> int:
    from ostinato.engine.factory import load_engine
    from ostinato.engine.sampling import SamplingParams
    from ostinato.engine.session import GenerationStats

    t0 = time.perf_counter()
    loaded = load_engine(a.model, _runner_settings(a), _placement(a))
    load_s = time.perf_counter() - t0
    tok = loaded.tokenizer
    prompt = tok.encode(a.prompt) if a.raw else tok.render_ids([{"role": "user", "content": a.prompt}])
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed)
    stats = GenerationStats()
    dec = tok.stream_decoder()
    ids = []
    for t in loaded.engine.generate(prompt, params, stats=stats):
        ids.append(t)
        if not a.json:
            print(dec.feed(t), end="", flush=True)
    if a.json:
        print(json.dumps({
            "model": a.model, "device": str(loaded.runner.device), "dtype": str(loaded.runner.dtype),
            "prompt_tokens": stats.prompt_tokens, "output_ids": ids, "text": tok.decode(ids),
            "finish_reason": stats.finish_reason, "load_s": round(load_s, 3),
            "prefill_ms": round(1000 * stats.prefill_s, 3), "tpot_ms": round(stats.decode_ms_per_token, 3),
        }))
    else:
        print(dec.flush())
        print(f"[{stats.prompt_tokens} prompt tokens, {stats.output_tokens} generated; prefill "
              f"{1000 * stats.prefill_s:.1f} ms, {stats.decode_ms_per_token:.2f} ms/token]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ostinato", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write a synthetic checkpoint in the Hugging Face format")
    p.add_argument("--preset", required=True, choices=["tiny", "qwen3-30b-a3b"])
    p.add_argument("--layers", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float, default=None, help="router bias scale (default: the calibrated one)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("generate", help="generate text from a prompt")
    _add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--json", action="store_true", help="print token ids and timings as JSON")
    p.set_defaults(func=cmd_generate)

    from ostinato.bench.cli import add_bench_commands
    from ostinato.planner.cli import add_planner_commands
    from ostinato.server.cli import add_server_commands

    add_planner_commands(sub, _add_model_args)
    add_server_commands(sub, _add_model_args)
    add_bench_commands(sub, _add_model_args)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = logging.getLogger("ostinato")  # start-up facts (the thread layout) on stderr
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("ostinato: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"ostinato: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
