"""`ostinato` command line: one subcommand per job, each a thin wrapper over the package; each
handler imports what it runs (jobs/plan.py says why)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from ostinato.bench.cli import add_bench_commands
from ostinato.config import ConfigError
from ostinato.model_args import add_model_args, placement_settings, runner_settings
from ostinato.jobs.plan import add_planner_commands
from ostinato.server.cli import add_server_commands
from ostinato.synth.gguf_writer import RECIPES
from ostinato.synth.presets import DEPTH_PROFILES, PRESETS, REGIMES, regime


def cmd_synth(a) -> int:
    from ostinato.synth.build import write_checkpoint, write_gguf_file

    t0 = time.perf_counter()
    low, high = a.depth_range or (None, None)
    try:
        routing = regime(a.regime, a.preset, depth=a.depth, low=low, high=high, persistence=a.persistence, content=a.content)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if a.format == "gguf":
        out = write_gguf_file(a.preset, a.out, a.quant, seed=a.seed, layers=a.layers, skew=a.skew, regime=routing,
                              progress=lambda i, n: print(f"  tensor {i}/{n}", file=sys.stderr) if i % 50 == 0 or i == n else None)
    else:
        if a.quant != "BF16":
            raise ConfigError(f"--quant {a.quant} needs --format gguf (a Hugging Face checkpoint is written in bf16)")
        out = write_checkpoint(a.preset, a.out, seed=a.seed, layers=a.layers, skew=a.skew, regime=routing,
                               progress=lambda i, n: print(f"  shard {i}/{n}", file=sys.stderr))
    print(f"wrote {a.preset} to {out} in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_generate(a) -> int:
    from ostinato.engine.sampling import SamplingParams
    from ostinato.engine.session import GenerationStats
    from ostinato.load import load_engine, startup_summary, summary_text

    t0 = time.perf_counter()
    loaded = load_engine(a.model, runner_settings(a), placement_settings(a), announce=False)
    load_s = time.perf_counter() - t0
    summary = startup_summary(loaded)
    logging.getLogger("ostinato").info(summary_text(summary))
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
            "summary": summary,
        }))
    else:
        print(dec.flush())
        print(f"[{stats.prompt_tokens} prompt tokens, {stats.output_tokens} generated; prefill "
              f"{1000 * stats.prefill_s:.1f} ms, {stats.decode_ms_per_token:.2f} ms/token]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ostinato", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write a synthetic checkpoint (Hugging Face directory or GGUF file)")
    p.add_argument("--preset", required=True, choices=list(PRESETS))
    p.add_argument("--layers", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float, default=None, help="router bias scale (default: the calibrated one)")
    p.add_argument("--regime", choices=list(REGIMES), default="flat",
                   help="routing regime (synth/presets.py): flat, heterogeneous layers, persistent, by content")
    p.add_argument("--depth", choices=list(DEPTH_PROFILES), help="override: the per-layer skew profile")
    p.add_argument("--depth-range", type=float, nargs=2, metavar=("LOW", "HIGH"),
                   help="override: the profile's range, as multiples of the bias scale")
    p.add_argument("--persistence", type=float, help="override: scale of the routers' recent-token state")
    p.add_argument("--content", type=float, help="override: scale of the per-token-class expert bias")
    p.add_argument("--out", required=True, help="output directory (gguf: the file OUT/PRESET-QUANT.gguf)")
    p.add_argument("--format", choices=["hf", "gguf"], default="hf",
                   help="hf: config.json + safetensors; gguf: one llama.cpp qwen3moe file")
    p.add_argument("--quant", choices=list(RECIPES), default="BF16",
                   help="GGUF quantization recipe, as llama.cpp's file types of the same names")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("generate", help="generate text from a prompt")
    add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--json", action="store_true", help="print token ids and timings as JSON")
    p.set_defaults(func=cmd_generate)

    add_planner_commands(sub)
    add_server_commands(sub)
    add_bench_commands(sub)
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
