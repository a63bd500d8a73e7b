"""Planner subcommands: profile (count routes), skew (the hot-share figure)."""
from __future__ import annotations

import json

import torch


def _sessions(spec: str | None, limit: int | None):
    from ostinato.bench.sessions import load_sessions

    sessions = load_sessions(spec or "embedded")
    return sessions[:limit] if limit else sessions


def spread(items: list, n: int) -> list:
    """n items evenly spaced over the list (every source of a mixed folder gets its share)."""
    if n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def cmd_profile(a) -> int:
    from ostinato.cli import _placement, _runner_settings
    from ostinato.engine.factory import load_engine
    from ostinato.planner.run_profile import profile_sessions

    loaded = load_engine(a.model, _runner_settings(a), _placement(a))
    counts = profile_sessions(loaded, _sessions(a.sessions, a.max_sessions))
    counts.save(a.output)
    print(f"profiled {counts.sessions} sessions: {counts.tokens['prefill']} prompt and "
          f"{counts.tokens['decode']} output tokens -> {a.output}")
    return 0


def cmd_skew(a) -> int:
    from ostinato.bench.sessions import split_sessions
    from ostinato.cli import _placement, _runner_settings
    from ostinato.engine.factory import load_engine
    from ostinato.planner.run_profile import profile_sessions
    from ostinato.planner.skew import hot_share, layer_ranges

    loaded = load_engine(a.model, _runner_settings(a), _placement(a))
    dev, held = split_sessions(_sessions(a.sessions, None))
    if a.max_sessions:
        dev, held = spread(dev, a.max_sessions), spread(held, a.max_sessions)
    cd = profile_sessions(loaded, dev, desc="dev")
    ch = profile_sessions(loaded, held, desc="held-out")
    if a.save_profiles:
        cd.save(f"{a.save_profiles}-dev.json")
        ch.save(f"{a.save_profiles}-held-out.json")
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


def cmd_plan(a) -> int:
    from ostinato.loader.source import open_source
    from ostinato.planner.fill import cold_routes, fill
    from ostinato.planner.profile import RouteCounts
    from ostinato.planner.residency import Residency, model_fingerprint

    source = open_source(a.model)
    cfg = source.config
    if a.profile:
        prof = RouteCounts.load(a.profile)
        counts = prof.total("all")
    elif a.hot_fraction in (0.0, 1.0):
        prof, counts = None, {l: torch.zeros(cfg.num_experts) for l in cfg.moe_layers}
    else:
        raise ValueError("--profile is needed unless --hot-fraction is 0 or 1")
    if a.hot_fraction is None:
        raise ValueError("give --hot-fraction (sizing by --gpu-memory comes with the capacity test)")
    slots = round(a.hot_fraction * len(cfg.moe_layers) * cfg.num_experts)
    hot = fill(counts, slots)
    res = Residency(model_fingerprint(source), cfg.num_experts, hot,
                    profile={"path": a.profile, "sessions": prof.sessions if prof else 0},
                    notes={"hot_fraction": a.hot_fraction})
    res.save(a.output)
    print(f"{res.hot_count} hot experts of {len(cfg.moe_layers) * cfg.num_experts} "
          f"({100 * res.hot_count / (len(cfg.moe_layers) * cfg.num_experts):.1f}%) -> {a.output}")
    if prof is not None:
        cold, total = cold_routes(counts, hot)
        print(f"development routes on the GPU: {100 * (1 - cold / max(total, 1)):.1f}%; cold routes per token "
              f"and layer: {cold / max(1, sum(prof.tokens.values())) / len(cfg.moe_layers):.2f}")
    if a.held_out:
        held = RouteCounts.load(a.held_out)
        cold, total = cold_routes(held.total("all"), hot)
        print(f"held-out routes on the GPU: {100 * (1 - cold / max(total, 1)):.1f}%")
    return 0


def add_planner_commands(sub, add_model_args) -> None:
    p = sub.add_parser("plan", help="choose the resident experts from a routing profile")
    p.add_argument("--model", required=True)
    p.add_argument("--profile", help="development profile from `ostinato profile`")
    p.add_argument("--held-out", help="held-out profile, to report the hot share it gets")
    p.add_argument("--hot-fraction", type=float, help="pool size as a share of all experts")
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_plan)

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
    p.add_argument("--save-profiles", metavar="PREFIX", help="also write PREFIX-dev.json and PREFIX-held-out.json")
    p.set_defaults(func=cmd_skew)
