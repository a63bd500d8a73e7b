"""Subcommands `replay`, `bench` and `demo`; each prints one JSON line last. Each handler imports
what it runs (jobs/plan.py says why)."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from ostinato.bench.report import source_state
from ostinato.config import ConfigError, parse_bytes
from ostinato.model_args import add_margin_args, add_model_args, margin_settings, placement_settings, runner_settings
from ostinato.policies.settings import OFFLOAD_THRESHOLDS, POLICIES, PolicySettings


def _policy_args(p) -> None:
    p.add_argument("--offload-threshold", type=int, default=32,
                   help="layers / caches: passes of at least this many tokens upload the host experts they use "
                        f"(llama.cpp's default 32; bench tunes it over {list(OFFLOAD_THRESHOLDS)})")
    p.add_argument("--cache-max-tokens", type=int, default=32, help="expert-cache: largest pass served by the cache")
    p.add_argument("--decay", type=float, default=0.95, help="decaying-cache: score multiplier per decode step")
    p.add_argument("--profile", help="development profile (`ostinato profile`): fixed-per-layer's ranking, "
                                     "decaying-cache's warm start")
    p.add_argument("--expert-budget", help="bytes for the expert pool of every policy, e.g. 20GiB (default: the "
                                           "pool of --residency: hot + zero + flex slots)")
    p.add_argument("--cpu-backend", default="auto", choices=["auto", "native", "torch"])


def _policy_settings(a) -> PolicySettings:
    return PolicySettings(
        budget_bytes=parse_bytes(a.expert_budget) if a.expert_budget else None,
        gpu_memory=parse_bytes(a.gpu_memory) if a.gpu_memory else None, offload_threshold=a.offload_threshold,
        cache_max_tokens=a.cache_max_tokens, decay=a.decay, profile=a.profile, residency=a.residency,
        upload_threshold=a.upload_threshold, cpu_backend=a.cpu_backend)


def _print_summary(summary: dict) -> None:
    t = summary["ttft_ms"]
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print(f"\n{summary['turns']} turns of {summary['sessions']} sessions ({summary['failed_turns']} failed)")
    print("TTFT ms      median: " + "  ".join(f"{k} {f(t['median'][k])}" for k in ("first", "tool", "user", "all"))
          + f"   p90: {f(t['p90']['all'])}")
    print(f"TPOT ms      median {f(summary['tpot_ms']['median'])}   p90 {f(summary['tpot_ms']['p90'])}")
    print(f"request s    total {summary['request_s']['total']:.3f}   median {summary['request_s']['median']}")
    print(f"engine ms    prefill median {f(summary['prefill_ms']['median'])}   decode step median "
          f"{f(summary['decode_step_ms']['median'])}")
    for phase, p in summary["placement"].items():
        print(f"placement {phase:7} cold routes/token/layer {p['cold_routes_per_token_layer']}  "
              f"CPU experts/token/layer {p['cpu_experts_per_token_layer']}  "
              f"uploaded {p['bytes_uploaded'] / 2**20:.1f} MiB  pool hit rate {p['pool_hit_rate']}")


def cmd_replay(a) -> int:
    from ostinato.bench.bench import select_sessions
    from ostinato.bench.metrics import summarize
    from ostinato.bench.replay import HttpTarget, format_turn, replay_sessions
    from ostinato.sessions.read import load_sessions

    if bool(a.endpoint) == bool(a.model):
        raise ConfigError("give either --endpoint URL (a running server) or --model M (in this process)")
    if a.split == "all":
        sessions = load_sessions(a.sessions)[:a.max_sessions]
    else:
        dev, held = select_sessions(a.sessions, a.max_sessions)
        sessions = held if a.split == "held-out" else dev
    tokenizer, layers, engine = None, None, "reference"
    if a.endpoint:
        if a.tokenizer:  # a model argument (a checkpoint, a GGUF file, synth:PRESET): its tokenizer
            from ostinato.sources import open_source
            from ostinato.loader.tokenizer import ChatTokenizer

            tokenizer = ChatTokenizer.from_dir(open_source(a.tokenizer).tokenizer_dir)
        target = HttpTarget(a.endpoint, kind=a.endpoint_kind, tokenizer=tokenizer, api_key=a.api_key,
                            model=a.served_model, first_token=a.first_token, api=a.api,
                            hold_outputs=not a.no_hold_outputs)
        engine = target.name
    else:
        target, layers, engine = _in_process(a)
        tokenizer = target.tokenizer
    cut: list = []
    results = replay_sessions(target, sessions, tokenizer=tokenizer, max_turns=a.max_turns, max_output=a.max_output,
                              on_turn=lambda r: print(format_turn(r), flush=True), cut=cut)
    summary = summarize(results, layers)
    if getattr(target, "held", None) is not None and not target.forced:
        summary["outputs_held"] = target.held  # HttpTarget.hold_output: the report says what it did
    _print_summary(summary)
    if cut:
        print(f"{len(cut)} sessions cut at a turn that does not fit the context")
    print(json.dumps({"kind": "ostinato.replay", "engine": engine, **source_state(),
                      "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "sessions": a.sessions,
                      "split": a.split, "cut_sessions": len(cut), "summary": summary}))
    return 0


def _in_process(a):
    from ostinato.bench.replay import InProcessTarget
    from ostinato.load import load_engine, warm_up
    from ostinato.policies.factory import policy_factory

    rs = runner_settings(a)
    name = a.policy
    if name is None:
        loaded = load_engine(a.model, rs, placement_settings(a))
        engine = "ostinato" if a.residency else "reference"
    else:
        settings = _policy_settings(a)
        loaded = load_engine(a.model, rs, placement_settings(a),  # its formats; the policy places the experts
                             experts_factory=policy_factory(name, settings))
        engine = name
    warm_up(loaded)
    return InProcessTarget(loaded), len(loaded.runner.config.moe_layers), engine


def _bench_settings(a):

    from ostinato.bench.bench import BenchSettings

    if a.residency:
        raise ConfigError("bench plans its own residency from the development sessions: drop --residency")
    unknown = [p for p in a.policies if p not in POLICIES]
    if unknown:
        raise ConfigError(f"unknown policies {unknown} (choose from {', '.join(POLICIES)})")
    return BenchSettings(
        model=a.model, runner=runner_settings(a), sessions=a.sessions, policies=tuple(a.policies),
        gpu_memory=parse_bytes(a.gpu_memory) if a.gpu_memory else None,
        expert_budget=parse_bytes(a.expert_budget) if a.expert_budget else None, hot_fraction=a.hot_fraction,
        attention_scores=a.attention_scores, margin=margin_settings(a),
        max_sessions=a.max_sessions, max_turns=a.max_turns, max_output=a.max_output,
        profiles=tuple(a.profiles) if a.profiles else None, tune=not a.no_tune, tune_sessions=a.tune_sessions,
        tune_max_turns=a.tune_max_turns,
        thresholds=tuple(a.thresholds), sweep_sizes=tuple(a.sweep_sizes), sweep_output=a.sweep_output,
        sweep_prefixes=a.sweep_prefixes, sweep_prefix_tokens=a.sweep_prefix_tokens,
        upload_threshold=a.upload_threshold, calibration_from=a.calibration,
        cpu_backend=a.cpu_backend, upper_bound=a.upper_bound, out=Path(a.out), merge=a.merge, rounds=a.rounds,
        progress=not a.no_progress, experts=a.experts)


def cmd_bench(a) -> int:
    from ostinato.bench.bench import run_bench
    from ostinato.bench.report import format_table

    result = run_bench(_bench_settings(a))
    print(format_table(result))
    print(f"report: {result['files']['report']}")
    print(json.dumps(result))
    return 0


def cmd_report(a) -> int:
    """The report and plots of a bench folder again, from its results.json (e.g. a run cut
    short by a time limit, which writes its plots only at the end)."""
    from ostinato.bench.report import add_external, finish_result, format_table, load_results

    if a.regimes:
        return _report_regimes(a)
    if not a.folder:
        raise ConfigError("give a bench folder (the --out of `ostinato bench`), or --regimes NAME=DIR ...")
    if a.out:
        raise ConfigError("--out is where --regimes writes; a bench folder's report is written into the folder")
    out = Path(a.folder)
    result, turns = load_results(out)
    for spec in a.engine or []:
        name, _, file = spec.partition("=")
        if not (name and file):
            raise ConfigError(f"--engine {spec!r}: give NAME=FILE")
        lines = [ln for ln in Path(file).read_text().splitlines() if ln.startswith("{")]
        if not lines:
            raise ConfigError(f"--engine {spec}: {file} holds no JSON line")
        add_external(result, turns, name, json.loads(lines[-1]), file)
    result = finish_result(result, turns, out, with_plots=True)
    print(format_table(result))
    print(f"report: {result['files']['report']}; plots: {len(result['files']['plots'])}")
    return 0


def _report_regimes(a) -> int:
    """`report --regimes`: one table and one figure over bench runs that differ only in the
    synthetic model's routing regime (bench/regimes.py)."""
    from ostinato.bench.regimes import format_verdicts, write_regimes_report

    if a.folder or a.engine:
        raise ConfigError("--regimes compares bench folders given as NAME=DIR: drop the folder and --engine")
    specs = []
    for spec in a.regimes:
        name, _, folder = spec.partition("=")
        if not (name and folder):
            raise ConfigError(f"--regimes {spec!r}: give NAME=DIR, e.g. layered=res/regimes/layered")
        specs.append((name, folder))
    doc = write_regimes_report(specs, a.out or "ostinato-regimes", tuple(a.same_code or ()))
    print(format_verdicts(doc))
    print(f"report: {doc['files']['report']}; figure: {doc['files']['figure'] or doc.get('figure_error')}")
    print(json.dumps(doc))
    return 0


def cmd_demo(a) -> int:
    from ostinato.bench.demo import demo_settings, run_demo

    bs = demo_settings(a.out, a.sessions, a.max_turns, a.device, quick=a.quick, progress=not a.no_progress,
                       cpu_backend=a.cpu_backend)
    result = run_demo(bs)
    print(json.dumps(result))
    return 0


def _max_output_arg(p) -> None:
    p.add_argument("--max-output", type=int, help="emit at most this many recorded tokens per turn (the next "
                   "prompt still holds the whole recorded message); default: all of them")


def add_bench_commands(sub) -> None:
    p = sub.add_parser("replay", help="replay sessions turn by turn against an endpoint or an in-process engine")
    add_model_args(p)
    for action in p._actions:  # --model or --endpoint
        if action.dest == "model":
            action.required = False
    p.add_argument("--endpoint", help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8080")
    p.add_argument("--endpoint-kind", default="auto", choices=["auto", "ostinato", "openai"],
                   help="ostinato: forced outputs; openai: max_tokens = recorded length and ignore_eos")
    p.add_argument("--api-key")
    p.add_argument("--api", default="openai", choices=["openai", "anthropic"],
                   help="the route an endpoint is replayed through: chat completions, or /v1/messages (our server; "
                        "needs --tokenizer)")
    p.add_argument("--served-model", help="model name to send (default: the server's first model)")
    p.add_argument("--tokenizer", help="the model whose tokenizer measures recorded lengths over HTTP (a checkpoint "
                   "directory, a GGUF file or synth:PRESET)")
    p.add_argument("--no-hold-outputs", action="store_true",
                   help="another engine (no forced outputs): leave its cache with its own answers between turns, so "
                   "that each turn prefills the recorded answer again (default: an untimed request makes it hold "
                   "the recorded answer, as Ostinato's cache does; needs --tokenizer)")
    p.add_argument("--first-token", default="chunk", choices=["chunk", "text"],
                   help="what marks the first token over HTTP (default: the first streamed chunk)")
    p.add_argument("--policy", choices=POLICIES,
                   help="placement policy (default: the residency's, or all on one device)")
    _policy_args(p)
    p.add_argument("--sessions", default="embedded", help="sessions (file, folder, or 'embedded[:N[:SEED]]')")
    p.add_argument("--max-sessions", type=int, help="at most this many sessions (per side for a split)")
    p.add_argument("--max-turns", type=int, help="at most this many turns per session")
    p.add_argument("--split", default="held-out", choices=["held-out", "dev", "all"])
    _max_output_arg(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("bench", help="profile, plan, calibrate and replay held-out sessions for Ostinato "
                                     "and every baseline; write the report")
    add_model_args(p)
    p.add_argument("--sessions", default="embedded")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), metavar="P")
    p.add_argument("--expert-budget", help="bytes for expert slots (default: sized from --gpu-memory)")
    p.add_argument("--hot-fraction", type=float, help="budget as a share of all experts")
    p.add_argument("--attention-scores", type=float, help="capacity test: share of a pass's attention scores "
                   "materialised at once (as `ostinato plan`; default: the model's)")
    add_margin_args(p)
    p.add_argument("--max-sessions", type=int, help="at most this many development and held-out sessions each")
    p.add_argument("--max-turns", type=int, help="at most this many turns per session")
    _max_output_arg(p)
    p.add_argument("--profiles", nargs=2, metavar=("DEV", "HELD_OUT"),
                   help="route counts saved for this model (`ostinato skew --save-profiles`): skip profiling")
    p.add_argument("--calibration", metavar="RESIDENCY", help="take the cost model's constants and Np from this "
                   "file (`ostinato calibrate` on this machine and model) instead of calibrating")
    p.add_argument("--no-tune", action="store_true", help="keep the offload threshold at 32")
    p.add_argument("--tune-sessions", type=int, default=3, help="development sessions to tune thresholds on")
    p.add_argument("--tune-max-turns", type=int, default=None,
                   help="turns per tuning session (default: --max-turns)")
    p.add_argument("--thresholds", type=int, nargs="+", default=list(OFFLOAD_THRESHOLDS))
    p.add_argument("--sweep-sizes", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    p.add_argument("--sweep-output", type=int, default=128)
    p.add_argument("--sweep-prefixes", type=int, default=8)
    p.add_argument("--sweep-prefix-tokens", type=int, default=1024)
    p.add_argument("--upper-bound", action="store_true", help="run `gpu` even over the budget (logical memory)")
    p.add_argument("--cpu-backend", default="auto", choices=["auto", "native", "torch"])
    p.add_argument("--out", default="ostinato-bench", help="folder for report.md, results.json and plots")
    p.add_argument("--merge", action="store_true", help="add these policies to the results.json in --out (a run "
                   "of the same model, budget, split, machine and thread layout, e.g. the other policies in another call)")
    p.add_argument("--rounds", type=int, default=1,
                   help="cut the held-out sessions into this many slices and replay every policy on each in turn, "
                        "the order reversed every other round, so that the machine's drift during the run falls on "
                        "every policy alike (each policy is built once a round; thresholds are tuned in the first)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("report", help="write a bench folder's report.md and plots again from its results.json; "
                                      "or compare bench folders of one model under several routing regimes")
    p.add_argument("folder", nargs="?", help="the --out folder of `ostinato bench`")
    p.add_argument("--engine", action="append", metavar="NAME=FILE",
                   help="add an engine replayed over HTTP on the same turns: FILE holds the output of `ostinato "
                        "replay --endpoint` (its last JSON line); NAME llama.cpp fills the llama.cpp target")
    p.add_argument("--regimes", nargs="+", metavar="NAME=DIR",
                   help="bench folders of one synthetic model under routing regimes (synth:P?regime=R), one run each, "
                        "measured alike otherwise: regimes.md, regimes.json and regimes.png into --out")
    p.add_argument("--out", help="folder for the --regimes report (default ./ostinato-regimes)")
    p.add_argument("--same-code", nargs="+", metavar="COMMIT",
                   help="with --regimes: commits that run the same code for these measurements (their diff touches "
                        "nothing the runs execute), so runs measured at them stand side by side; the report says so")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("demo", help="the benchmark on the embedded default (tiny model, generated sessions)")
    p.add_argument("--out", default="ostinato-demo", help="folder for the report (default ./ostinato-demo)")
    p.add_argument("--sessions", default="embedded:6")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--device", help="cuda or cpu (default: cuda if present)")
    p.add_argument("--quick", action="store_true", help="the CI size: one session per side, one turn each")
    p.add_argument("--cpu-backend", default="auto", choices=["auto", "native", "torch"])
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_demo)

