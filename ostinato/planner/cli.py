"""Planner subcommands: profile (count routes), skew (the hot-share figure)."""
from __future__ import annotations

import json
import sys


def _sessions(spec: str | None, limit: int | None):
    from ostinato.bench.sessions import load_sessions

    sessions = load_sessions(spec or "embedded")
    return sessions[:limit] if limit else sessions


def cmd_profile(a) -> int:
    from ostinato.cli import _runner_settings
    from ostinato.engine.factory import load_engine
    from ostinato.planner.run_profile import profile_sessions

    loaded = load_engine(a.model, _runner_settings(a))
    counts = profile_sessions(loaded, _sessions(a.sessions, a.max_sessions))
    counts.save(a.output)
    print(f"profiled {counts.sessions} sessions: {counts.tokens['prefill']} prompt and "
          f"{counts.tokens['decode']} output tokens -> {a.output}")
    return 0


def cmd_skew(a) -> int:
    from ostinato.bench.sessions import split_sessions
    from ostinato.cli import _runner_settings
    from ostinato.engine.factory import load_engine
    from ostinato.planner.run_profile import profile_sessions
    from ostinato.planner.skew import hot_share, layer_ranges

    loaded = load_engine(a.model, _runner_settings(a))
    dev, held = split_sessions(_sessions(a.sessions, None))
    if a.max_sessions:
        dev, held = dev[:a.max_sessions], held[:a.max_sessions]
    cd = profile_sessions(loaded, dev, desc="dev")
    ch = profile_sessions(loaded, held, desc="held-out")
    result = {"model": a.model, "dev_sessions": len(dev), "held_out_sessions": len(held), "figures": []}
    for frac in a.fraction:
        for phase in ("all", "decode", "prefill"):
            share, per_layer = hot_share(cd.total("all"), ch.total(phase), frac)
            ranges = layer_ranges(per_layer)
            result["figures"].append({"top_fraction": frac, "held_out_phase": phase, "share": round(share, 4),
                                      "layer_ranges": [[a_, b_, round(s, 4)] for a_, b_, s in ranges],
                                      "min_layer": round(min(per_layer.values()), 4),
                                      "max_layer": round(max(per_layer.values()), 4)})
            rng = ", ".join(f"layers {x}-{y}: {100 * s:.1f}%" for x, y, s in ranges)
            print(f"top {100 * frac:.0f}% of experts (by dev routes) -> {100 * share:.1f}% of held-out "
                  f"{phase} routes ({rng})")
    print(json.dumps(result))
    return 0


def add_planner_commands(sub, add_model_args) -> None:
    p = sub.add_parser("profile", help="count routes per (layer, expert) over development sessions")
    add_model_args(p)
    p.add_argument("--sessions", help="sessions (file, folder, or 'embedded'; default embedded)")
    p.add_argument("--max-sessions", type=int)
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("skew", help="measure: share of held-out routes on the top experts of dev sessions")
    add_model_args(p)
    p.add_argument("--sessions", help="sessions to split into dev / held-out (default embedded)")
    p.add_argument("--max-sessions", type=int, help="at most this many sessions per side")
    p.add_argument("--fraction", type=float, nargs="+", default=[0.40, 0.44])
    p.set_defaults(func=cmd_skew)
