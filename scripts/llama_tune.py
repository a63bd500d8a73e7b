"""Tune llama.cpp's server on development sessions under a GPU memory cap, then replay the
held-out sessions with the chosen settings ([L]; ostinato/bench/llamacpp.py has the knobs).

    python scripts/llama_tune.py --server /tmp/llama/kit/llama-server --model M.gguf \
        --cap 32GiB --sessions .carry/agent --out /tmp/res/llama

--model is the GGUF file llama.cpp serves; the replay renders each turn with the file's own
tokenizer and chat template (or --tokenizer DIR) and sends its ids, the tokens Ostinato prefills,
with the recorded answer held between turns (ostinato/bench/replay.py HttpTarget). The same sample flags as `ostinato bench`:
--max-sessions, --max-turns, --max-output for the held-out replay; --tune-sessions and
--tune-max-turns for the development turns each setting is timed on.

A setting fits the cap if the server is under it once ready and still under it after its development
turns (its GPU memory in tuning.json is the later figure). Writes OUT/tuning.json (every setting
measured, its GPU memory and total; the choice) and
OUT/replay.json (the held-out replay, the JSON line of `ostinato replay`, with the chosen
settings: `ostinato report BENCH --engine llama.cpp=OUT/replay.json` adds it as a row), and
each server's log under OUT/logs/. Needs a GPU and the llama.cpp kit (../shared/llama).

--settings TUNING.json replays the held-out sessions with the settings an earlier run chose on the same
file recipe and cap (its `chosen_settings`), without tuning: llama.cpp measured on the same machine and
day as the Ostinato run it is compared with, where the tuning itself does not fit again.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ostinato.bench.bench import select_sessions  # noqa: E402
from ostinato.bench.llamacpp import (LOAD_MODES, LlamaServer, LlamaSettings, Measured, knob_values,  # noqa: E402
                                     smallest_fitting, tune)
from ostinato.bench.metrics import summarize  # noqa: E402
from ostinato.bench.replay import HttpTarget, replay_sessions  # noqa: E402
from ostinato.bench.report import source_state  # noqa: E402
from ostinato.config import parse_bytes  # noqa: E402
from ostinato.engine.gpu_memory import process_gpu_mib  # noqa: E402
from ostinato.sources import open_source  # noqa: E402
from ostinato.loader.tokenizer import ChatTokenizer  # noqa: E402


def replay(url: str, sessions, tok, max_turns, max_output, max_context) -> tuple[list, dict]:
    target = HttpTarget(url, kind="openai", tokenizer=tok, first_token="text")
    target.max_context = max_context  # a session stops before its first turn past it, as in Ostinato's bench
    try:
        results = replay_sessions(target, sessions, tokenizer=tok, max_turns=max_turns, max_output=max_output)
    finally:
        target.close()
    return results, {**summarize(results, None), "outputs_held": target.held}


def chosen(path: Path, cap_mib: int) -> LlamaSettings:
    """The settings an earlier tuning chose (its tuning.json), for a replay under the same cap."""
    try:
        t = json.loads(path.read_text())
        settings = LlamaSettings(**t["chosen_settings"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--settings {path}: not a tuning.json of scripts/llama_tune.py ({type(e).__name__}: {e})")
    if t.get("cap_mib") != cap_mib:
        raise SystemExit(f"--settings {path}: tuned under {t.get('cap_mib')} MiB, this replay's cap is {cap_mib} MiB")
    return settings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, help="llama-server")
    ap.add_argument("--model", required=True, help="the GGUF file")
    ap.add_argument("--tokenizer", help="a checkpoint directory (default: the GGUF file's own tokenizer)")
    ap.add_argument("--cap", type=parse_bytes, required=True, help="GPU memory cap, as --gpu-memory")
    ap.add_argument("--sessions", required=True)
    ap.add_argument("--max-sessions", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=12)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--tune-sessions", type=int, default=2)
    ap.add_argument("--tune-max-turns", type=int, default=4)
    ap.add_argument("--context", type=int, default=9216, help="llama-server's context (-c; at least --max-context)")
    ap.add_argument("--max-context", type=int,
                    help="replayed turns end before the first whose prompt and output pass this many tokens: "
                         "Ostinato's bench --max-context, so that both replay the same turns (default: --context)")
    ap.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 16],
                    help="CPU thread counts to try (default: every CPU; add our layout's worker count)")
    ap.add_argument("--gpu", default="0", help="CUDA_VISIBLE_DEVICES for the server (one GPU, as Ostinato)")
    ap.add_argument("--port", type=int, default=8090)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--flavor", choices=list(LOAD_MODES), default="llama.cpp",
                    help="the server's family: llama.cpp, or the ik_llama.cpp fork (its own flags: ostinato/bench/llamacpp.py)")
    ap.add_argument("--settings", type=Path,
                    help="tuning.json of an earlier run (same file recipe and cap): replay with its choice, no tuning")
    a = ap.parse_args(argv)
    # `timeout` ends a run cut by its call's deadline with SIGTERM: exit through the servers' `finally`, which
    # stops them, rather than leave one serving beside the next run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    a.max_context = a.max_context or a.context
    a.context = max(a.context, a.max_context)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "logs").mkdir(exist_ok=True)
    source = open_source(a.model)
    tok = ChatTokenizer.from_dir(a.tokenizer or source.tokenizer_dir)
    layers = source.config.num_hidden_layers
    dev, held = select_sessions(a.sessions, a.max_sessions)
    tune_set = dev[:a.tune_sessions]
    cap_mib = a.cap // 2**20
    # a run cut short by a call's deadline resumes from what it measured (the same server, file, cap and turns)
    st = Path(a.model).stat()
    done = Measured(a.out / "tuning-progress.json",
                    {"server": str(Path(a.server).resolve()), "model": a.model, "bytes": st.st_size,
                     "mtime_ns": st.st_mtime_ns, "cap_mib": cap_mib, "context": a.context,
                     "max_context": a.max_context, "fit_threads": a.threads[0],
                     "tune_sessions": [s.id for s in tune_set], "tune_max_turns": a.tune_max_turns,
                     "max_output": a.max_output})
    if done.resumed:
        print(f"resuming: {len(done.data['fits'])} fit tests and {len(done.data['totals'])} settings measured before "
              f"({done.path})", flush=True)
    memory: dict[str, int | None] = done.data["gpu_mib"]
    count = [len(list((a.out / "logs").glob("*.log")))]

    def start(s: LlamaSettings) -> LlamaServer:
        count[0] += 1
        log = a.out / "logs" / f"{count[0]:02d}.log"
        srv = LlamaServer(a.server, s, a.model, context=a.context, port=a.port, gpu=a.gpu, log=log,
                          start_timeout=a.start_timeout)
        refused = [line for line in log.read_text(errors="replace").splitlines()
                   if "invalid argument" in line or "unknown argument" in line]  # llama.cpp's words, ik's
        if refused:  # this build does not know a flag: a defect of the tuner, not a slow setting
            raise SystemExit(f"llama-server refused {s.label()}: {refused[0]} ({log})")
        memory[s.label()] = srv.mib
        print(f"[{count[0]}] {s.label()}: {'ready' if srv.ready else 'failed'} in {srv.load_s:.1f} s, "
              f"{srv.mib} MiB", flush=True)
        return srv

    def fits_now(n: int) -> tuple[bool, bool]:  # (fits, definite: the server started)
        srv = start(LlamaSettings(n, threads=a.threads[0], flavor=a.flavor))
        try:
            return srv.ready and srv.mib is not None and srv.mib <= cap_mib, srv.ready
        finally:
            srv.close()

    def measure_now(s: LlamaSettings) -> tuple[float | None, bool]:  # (total, definite: the server started)
        srv = start(s)
        try:
            if not srv.ready or srv.mib is None or srv.mib > cap_mib:
                return None, srv.ready
            results, summary = replay(srv.url, tune_set, tok, a.tune_max_turns, a.max_output, a.max_context)
            if summary["failed_turns"]:
                return None, True
            # llama-server grows after ready (session 33: 12228 MiB at ready, 12352 after the held-out turns,
            # over a 12288 MiB cap): a setting counts as fitting only if it is still under the cap after its turns
            after = process_gpu_mib(srv.proc.pid)
            memory[s.label()] = after
            if after is None or after > cap_mib:
                seen = "not listed by nvidia-smi" if after is None else f"{after} MiB, over the cap of {cap_mib} MiB"
                print(f"    after its development turns: {seen}", flush=True)
                return None, True
            total = summary["request_s"]["total"]
            print(f"    total {total:.3f} s over {summary['turns']} development turns", flush=True)
            return total, True
        finally:
            srv.close()

    def fits(n: int) -> bool:
        return done.get("fits", str(n), lambda: fits_now(n))

    def measure(s: LlamaSettings) -> float | None:
        return done.get("totals", s.label(), lambda: measure_now(s))

    if a.settings is not None:
        best = chosen(a.settings, cap_mib)
        if best.flavor != a.flavor:
            raise SystemExit(f"--settings {a.settings}: settings of {best.flavor}, this run serves {a.flavor}")
        print(f"settings of {a.settings}: {best.label()} (not tuned here)", flush=True)
    else:
        t0 = time.perf_counter()
        n_fit = smallest_fitting(fits, layers)
        best, rows = tune(measure, LlamaSettings(n_fit, threads=a.threads[0], flavor=a.flavor),
                          knob_values(n_fit, layers, a.threads, a.flavor), layers)
        for r in rows:
            r["gpu_mib"] = memory.get(r["label"])
        tuning = {"kind": "llama.tune", **source_state(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "model": a.model, "cap_mib": cap_mib, "layers": layers, "smallest_fitting_n_cpu_moe": n_fit,
                  "tune_sessions": [s.id for s in tune_set],
                  "tune_max_turns": a.tune_max_turns, "rows": rows, "chosen": best.label(),
                  "chosen_settings": dataclasses.asdict(best), "seconds": round(time.perf_counter() - t0, 1),
                  "resumed": done.resumed}  # seconds: this run's alone where it resumed a cut one
        (a.out / "tuning.json").write_text(json.dumps(tuning, indent=1) + "\n")
        print(f"chosen: {best.label()}", flush=True)

    srv = start(best)
    try:
        if not srv.ready:
            raise SystemExit("llama-server did not start with the chosen settings")
        if a.settings is not None and (srv.mib is None or srv.mib > cap_mib):  # a tuned choice fit when measured
            raise SystemExit(f"llama-server holds {srv.mib} MiB with {best.label()}: not under the cap of {cap_mib} MiB")
        results, summary = replay(srv.url, held, tok, a.max_turns, a.max_output, a.max_context)
        mib = process_gpu_mib(srv.proc.pid)
    finally:
        srv.close()
    out = {"kind": "ostinato.replay", "engine": a.flavor, **source_state(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sessions": a.sessions, "split": "held-out",
           "settings": best.label(), "settings_from": str(a.settings) if a.settings else "tuned here",
           "context": a.context, "max_context": a.max_context,
           "gpu_mib_after_replay": mib, "cap_mib": cap_mib, "summary": summary,
           "turns": [r.to_json() for r in results]}
    (a.out / "replay.json").write_text(json.dumps(out) + "\n")
    print(json.dumps({"chosen": best.label(), "gpu_mib": mib, "ttft_tool_ms": summary["ttft_ms"]["median"]["tool"],
                      "tpot_ms": summary["tpot_ms"]["median"], "total_s": summary["request_s"]["total"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
