"""`ostinato report --regimes`: Ostinato, per-layer frequency (`fixed-per-layer`) and the two
caches under several routing regimes of one synthetic model, one bench run per regime
(BENCHMARK.md: a conclusion that depends on the routing regime is shown under several).

Timings compare only inside one run, so each regime's claim is a ratio measured within its run
(fixed-per-layer / Ostinato, for median TPOT and for total request time), and the report puts
those ratios side by side. It refuses runs that differ in anything but the regime: the code (the
commit of every policy, --merge included), the machine and thread layout, dtype, context, cap
and budget, the sessions and turns replayed, the policies, the model apart from its regime.

The target (issue [J]): where the layers route unlike each other (a depth profile other than
flat's), Ostinato's cross-layer fill decodes at least 1.1x faster than per-layer frequency at the
same budget and finishes the sessions sooner (total request time); where they route alike,
never slower (1.0x). Each regime gets a plain verdict either way.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ostinato.bench.plots import _plt, _save
from ostinato.bench.report import _f, comparisons, load_results, provenance
from ostinato.config import ConfigError
from ostinato.synth.source import parse_synth
from ostinato.policies.settings import TUNED
from ostinato.synth.presets import Regime, regime

OURS, PER_LAYER = "ostinato", "fixed-per-layer"
COMPARED = (OURS, PER_LAYER, "expert-cache", "decaying-cache")
CACHES = ("expert-cache", "decaying-cache")
HETEROGENEOUS_TPOT = 1.1  # fixed-per-layer / Ostinato TPOT where the layers route unlike each other
ALIKE_TPOT = 1.0  # elsewhere: never slower
COMMITTED_SAMPLE = {"held_out": 8, "max_turns": 12, "max_output": 64}  # BENCHMARK.md, "Workloads"
BUDGET_KEYS = ("bytes", "pool_slots", "expert_bytes", "total_experts", "sized_by", "cap", "experts")


@dataclass
class RegimeRun:
    """One bench folder: its results.json (without raw turns) and the regime its model routes in."""

    name: str
    folder: Path
    result: dict
    regime: Regime
    model: tuple[str, dict]  # (preset, synth options other than the regime's)


def heterogeneous_layers(r: Regime) -> bool:
    """Whether the layers' skew follows a profile other than flat's per-layer draw."""
    flat = Regime()
    return (r.depth, r.low, r.high) != (flat.depth, flat.low, flat.high)


def load_run(name: str, folder: str | Path) -> RegimeRun:
    result, _ = load_results(folder)
    if result.get("kind") != "ostinato.bench":
        raise ConfigError(f"{name}: {folder}/results.json is not the result of `ostinato bench`")
    model = str(result.get("model", ""))
    if not model.startswith("synth:"):
        raise ConfigError(f"{name}: {folder} measured {model!r}, not a synthetic model: routing regimes are "
                          "set as synth:PRESET?regime=NAME")
    preset, opts = parse_synth(model)
    knobs = {k: opts.pop(k, None) for k in ("persistence", "content")}
    try:
        routing = regime(opts.pop("regime", "flat"), preset, **knobs)
    except ValueError as e:
        raise ConfigError(f"{name}: {model}: {e}") from None
    return RegimeRun(name, Path(folder), result, routing, (preset, opts))


def measured(result: dict) -> dict:
    """The policies of a run that replayed (not skipped)."""
    return {n: e for n, e in result["policies"].items() if "summary" in e}


def signature(run: RegimeRun, same_code: tuple[str, ...] = ()) -> dict:
    """What must be equal across the runs of one regime comparison, by what a reader is told differs.
    Commits in same_code (declared by the caller to run the same code) count as one."""
    r, b = run.result, run.result.get("budget") or {}
    pol = measured(r)
    return {
        "model apart from the regime": [run.model[0], sorted(run.model[1].items())],
        "commit": sorted({_as_same(c or "?", same_code) for c, _ in provenance(r).values()}),
        "machine": {**(r.get("hardware") or {}), "device": r.get("device"), "threads": r.get("threads")},
        "dtype, context and cap": {"dtype": r.get("dtype"), "max_context": r.get("max_context"), "cap": r.get("cap")},
        "budget": {k: b.get(k) for k in BUDGET_KEYS},
        # the sessions, not what they routed to: each regime routes them its own way
        "sessions": {k: v for k, v in (r.get("split") or {}).items() if k not in ("profiles", "route_counts")},
        "policies": sorted(pol),
        "held-out turns": {n: {"turns": e["summary"]["turns"], "sessions": sorted(e["summary"]["session_s"]),
                               "output_tokens": e["summary"]["output_tokens"]["total"]} for n, e in pol.items()},
    }


def _as_same(commit: str, same_code: tuple[str, ...]) -> str:
    """A commit named in same_code (by a prefix of either) stands for them all."""
    hit = any(commit.startswith(c) or c.startswith(commit) for c in same_code)
    return "=".join(same_code) if hit else commit


def _differing(values: list):
    """Only the parts that differ, for the message: a dict's differing keys, else the values."""
    if all(isinstance(v, dict) for v in values):
        keys = [k for k in set().union(*values) if len({json.dumps(v.get(k), sort_keys=True) for v in values}) > 1]
        return [{k: v.get(k) for k in sorted(keys)} for v in values]
    return values


def check_comparable(runs: list[RegimeRun], same_code: tuple[str, ...] = ()) -> None:
    """ConfigError naming everything that differs between the runs besides the regime (commits
    in same_code count as one)."""
    problems = []
    names = [r.name for r in runs]
    if len(set(names)) < len(names):
        problems.append(f"a name given twice ({', '.join(names)})")
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            if a.regime == b.regime:
                problems.append(f"{a.name} and {b.name} route in the same regime ({asdict(a.regime)})")
    for run in runs:
        missing = [n for n in (OURS, PER_LAYER) if n not in measured(run.result)]
        if missing:
            problems.append(f"{run.name} did not measure {', '.join(missing)}")
    sigs = [signature(r, same_code) for r in runs]
    for key in sigs[0]:
        values = [s[key] for s in sigs]
        if any(v != values[0] for v in values[1:]):
            shown = _differing(values)
            problems.append(f"{key} differs: " + "; ".join(
                f"{r.name} {_short(v)}" for r, v in zip(runs, shown)))
    if problems:
        raise ConfigError("these bench folders differ in more than the routing regime, so their ratios cannot "
                          "stand side by side: " + " | ".join(problems) + ". Measure every regime with the same "
                          "command and commit apart from ?regime= (scripts/device/run.sh, phase regimes)")


def _short(v, n: int = 160) -> str:
    text = json.dumps(v, sort_keys=True)
    return text if len(text) <= n else text[:n - 3] + "..."


def target(routing: Regime, comp: dict) -> dict:
    """The [J] target for one regime from Ostinato's comparison with fixed-per-layer."""
    need = HETEROGENEOUS_TPOT if heterogeneous_layers(routing) else ALIKE_TPOT
    tpot, total = comp.get("tpot_speedup"), comp.get("request_time_speedup")
    out = {"tpot_at_least": need, "tpot_ratio": tpot, "total_ratio": total, "sessions_sooner": comp.get("sessions_won"),
           "tpot_met": None if tpot is None else tpot >= need, "sooner_met": None if total is None else total > 1.0}
    out["met"] = None if None in (out["tpot_met"], out["sooner_met"]) else out["tpot_met"] and out["sooner_met"]
    return out


def run_entry(run: RegimeRun) -> dict:
    r = run.result
    pol = measured(r)
    comp = comparisons(pol, OURS, (r.get("np") or {}).get("value"))
    rows = {}
    for n in COMPARED:
        if n not in pol:
            continue
        e, s, c = pol[n], pol[n]["summary"], comp.get(n, {})
        decode = s["placement"].get("decode") or {}
        rows[n] = {"ttft_tool_ms": s["ttft_ms"]["median"]["tool"], "tpot_ms": s["tpot_ms"]["median"],
                   "total_s": s["request_s"]["total"],
                   "cold_routes_per_token_layer": decode.get("cold_routes_per_token_layer"),
                   "resident_experts": e.get("resident_experts"), "offload_threshold": e.get("offload_threshold"),
                   "tuned": "tuning" in e, "tpot_speedup": c.get("tpot_speedup"),
                   "request_time_speedup": c.get("request_time_speedup"), "sessions_won": c.get("sessions_won")}
    caches = [comp[n]["tpot_speedup"] for n in CACHES if (comp.get(n) or {}).get("tpot_speedup") is not None]
    return {
        "name": run.name, "folder": str(run.folder), "model": r["model"], "regime": asdict(run.regime),
        "heterogeneous_layers": heterogeneous_layers(run.regime), "persistent": run.regime.persistence > 0,
        "commit": r.get("commit"), "dirty": r.get("dirty"), "date": r.get("date"),
        "np": (r.get("np") or {}).get("value"), "routing": r.get("skew") or {}, "policies": rows,
        "target": target(run.regime, comp.get(PER_LAYER, {})),
        "faster_cache_tpot_speedup": min(caches) if caches else None,
        "untuned": [n for n in rows if n in TUNED and not rows[n]["tuned"]],
    }


def regimes_doc(runs: list[RegimeRun], same_code: tuple[str, ...] = ()) -> dict:
    """The comparison of comparable runs (check_comparable first)."""
    first = runs[0].result
    hw = first.get("hardware") or {}
    commits = sorted({c or "?" for r in runs for c, _ in provenance(r.result).values()})
    return {"kind": "ostinato.regimes", "preset": runs[0].model[0], "commit": commits,
            "same_code": list(same_code),
            "machine": {"gpu": hw.get("gpu"), "cpu": hw.get("cpu"), "physical_cores": hw.get("physical_cores"),
                        "device": first.get("device")},
            "dtype": first.get("dtype"), "cap": first.get("cap"), "budget": {k: (first.get("budget") or {}).get(k)
                                                                             for k in BUDGET_KEYS},
            "split": first.get("split"), "policies": [n for n in COMPARED if n in measured(first)],
            "runs": [run_entry(r) for r in runs]}


def _sample_note(split: dict) -> list[str]:
    short = [f"{k.replace('_', ' ')} {split.get(k)} (committed: >= {v})" for k, v in COMMITTED_SAMPLE.items()
             if split.get(k) is not None and split[k] < v]
    return [f"- the sample is smaller than a committed result's: {', '.join(short)}"] if short else []


def _untuned_note(doc: dict) -> list[str]:
    """Policies with an offload threshold that kept the default (no development session fitted the
    context, or --no-tune): BENCHMARK.md wants every threshold tuned."""
    return [f"- {e['name']}: {', '.join(e['untuned'])} not tuned (offload threshold "
            + ", ".join(str(e["policies"][n]["offload_threshold"]) for n in e["untuned"]) + ")"
            for e in doc["runs"] if e["untuned"]]


def _same_code_note(doc: dict) -> list[str]:
    if not doc.get("same_code"):
        return []
    return [f"- commits {', '.join(f'`{c}`' for c in doc['same_code'])} were declared to run the same code for these "
            "measurements (`report --same-code`): their runs stand side by side although the commits differ"]


def _size(v) -> str:
    if v is None:
        return "-"
    return f"{v / 2**30:.2f} GiB" if v >= 2**30 else f"{v / 2**20:.1f} MiB"


def _x(v) -> str:
    return _f(v, "{:.2f}x")


def _met(v) -> str:
    return {True: "yes", False: "**no**", None: "not measured"}[v]


def _layers(e: dict) -> str:
    return ("heterogeneous" if e["heterogeneous_layers"] else "alike") + (", persistent" if e["persistent"] else "")


def verdict(e: dict) -> str:
    """One plain sentence per regime: both ratios, the sessions, and whether the target is met."""
    t, p = e["target"], e["policies"]
    if t["met"] is None:
        return f"{e['name']}: the target is not measured (no TPOT or total time for both policies)"
    ours, theirs = p[OURS], p[PER_LAYER]
    won, both = t["sessions_sooner"]
    return (f"{e['name']} (layers {_layers(e)}): fixed-per-layer / Ostinato is {t['tpot_ratio']:.3f}x for TPOT "
            f"({theirs['tpot_ms']:.2f} against {ours['tpot_ms']:.2f} ms) and {t['total_ratio']:.3f}x for total "
            f"request time ({theirs['total_s']:.2f} against {ours['total_s']:.2f} s; Ostinato finished {won} of "
            f"{both} sessions sooner): the target (TPOT ratio >= {t['tpot_at_least']:.1f}x and total ratio > 1) is "
            + ("met" if t["met"] else "NOT met"))


def format_verdicts(doc: dict) -> str:
    return "\n".join(verdict(e) for e in doc["runs"])


def markdown(doc: dict, figure: str | None) -> str:
    b, hw, s = doc["budget"], doc["machine"], doc["split"]
    dates = sorted(e["date"] for e in doc["runs"] if e["date"])
    dirty = [e["name"] for e in doc["runs"] if e["dirty"]]
    cap = "none (logical budget)" if doc["cap"] is None else f"{doc['cap'] / 2**30:.1f} GiB"
    span = " to ".join(sorted({dates[0], dates[-1]})) if dates else "?"
    lines = [f"# Routing regimes: Ostinato against per-layer frequency and the caches ({span})", "",
             f"- model `synth:{doc['preset']}` under {len(doc['runs'])} routing regimes, one `ostinato bench` run "
             f"each; commit `{', '.join(doc['commit'])}`" + (f" (uncommitted changes in {', '.join(dirty)})"
                                                             if dirty else ""),
             f"- {hw['device']} ({doc['dtype']}); GPU {hw['gpu'] or 'none'}; CPU {hw['cpu']} ({hw['physical_cores']} "
             f"cores); cap {cap}",
             f"- budget: {b['pool_slots']} expert-sized pool slots ({_size(b['bytes'])}, sized by {b['sized_by']}) for "
             "every policy in every regime",
             f"- sessions: {s['development']} development, {s['held_out']} held-out (`{s['sessions']}`, at most "
             f"{s.get('max_turns') or 'all'} turns each" + (f", at most {s['max_output']} recorded output tokens a turn"
                                                             if s.get("max_output") else "") + ")",
             *_sample_note(s), *_untuned_note(doc), *_same_code_note(doc),
             "- timings compare only inside one run: across regimes, compare the ratios", "",
             "## Target: Ostinato against per-layer frequency at the same budget", "",
             f"Ratios fixed-per-layer / Ostinato of median TPOT and of total request time (above 1: Ostinato "
             f"faster). Target: TPOT ratio at least {HETEROGENEOUS_TPOT}x where the layers route unlike each other, "
             f"at least {ALIKE_TPOT}x (never slower) where they route alike, and a total ratio above 1.", "",
             "| regime | layers | TPOT ratio | total time ratio | sessions Ostinato finished sooner | target | met |",
             "|---|---|---|---|---|---|---|"]
    for e in doc["runs"]:
        t = e["target"]
        won = "-" if t["sessions_sooner"] is None else f"{t['sessions_sooner'][0]}/{t['sessions_sooner'][1]}"
        lines.append(f"| {e['name']} | {_layers(e)} | {_x(t['tpot_ratio'])} | {_x(t['total_ratio'])} | {won} | "
                     f"TPOT >= {t['tpot_at_least']:.1f}x, total > 1x | {_met(t['met'])} |")
    lines += [""] + [f"- {verdict(e)}." for e in doc["runs"]]
    lines += ["", "## Every policy under every regime", "",
              "Medians per turn (TTFT after tool outputs, TPOT), total request time of all held-out turns, cold routes "
              "per decoded token and MoE layer, experts resident or cached; the policy's time over Ostinato's.", "",
              "| regime | policy | TTFT after tool ms | TPOT ms | total s | cold/tok | resident | TPOT / Ostinato's | "
              "total / Ostinato's | sessions Ostinato sooner |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in doc["runs"]:
        for n, p in e["policies"].items():
            won = "" if p["sessions_won"] is None else f"{p['sessions_won'][0]}/{p['sessions_won'][1]}"
            lines.append(f"| {e['name']} | {n} | {_f(p['ttft_tool_ms'])} | {_f(p['tpot_ms'], '{:.2f}')} | "
                         f"{_f(p['total_s'], '{:.2f}')} | {_f(p['cold_routes_per_token_layer'], '{:.2f}')} | "
                         f"{'' if p['resident_experts'] is None else p['resident_experts']} | "
                         f"{'' if n == OURS else _x(p['tpot_speedup'])} | "
                         f"{'' if n == OURS else _x(p['request_time_speedup'])} | {won} |")
    lines += ["", "## Routing of each regime", "",
              "The regime's knobs (synth/presets.py); the share of held-out routes on the top experts by development "
              "routes (the budget's share of all experts), all and decode; its spread over the MoE layers; the share "
              "of top-k experts consecutive held-out tokens keep, against independent draws with the same "
              "marginals; Ostinato's Np.", "",
              "| regime | knobs | top experts | held-out share (decode) | per layer min / median / max | "
              "consecutive tokens (independent) | Np |", "|---|---|---|---|---|---|---|"]
    for e in doc["runs"]:
        k, sk = e["regime"], e["routing"]
        knobs = (f"{k['depth']} {k['low']}..{k['high']}, persistence {k['persistence']}, content {k['content']}, "
                 f"skew x{k['skew_factor']}")
        pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        lay, per = sk.get("layers"), sk.get("persistence")
        spread = "-" if not lay else f"{pct(lay['min_layer'])} / {pct(lay['median_layer'])} / {pct(lay['max_layer'])}"
        pers = "-" if not per else f"{pct(per['overlap'])} ({pct(per['independent'])})"
        lines.append(f"| {e['name']} | {knobs} | {pct(sk.get('top_fraction'))} | {pct(sk.get('held_out_all_share'))} "
                     f"({pct(sk.get('held_out_decode_share'))}) | {spread} | {pers} | {_f(e['np'], '{}')} |")
    if figure:
        lines += ["", "## Figure", "", f"![{figure}]({figure})"]
    return "\n".join(lines) + "\n"


def write_figure(doc: dict, out: Path) -> str:
    """Grouped bars per regime, one per policy: median TPOT and total request time, the
    fixed-per-layer bar labelled with its ratio to Ostinato."""
    plt = _plt()
    runs = doc["runs"]
    names = [n for n in COMPARED if any(n in e["policies"] for e in runs)]
    width = 0.8 / len(names)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = ((axes[0], "tpot_ms", "tpot_ratio", "median TPOT (ms)"),
              (axes[1], "total_s", "total_ratio", "total request time (s)"))
    for ax, key, ratio, title in panels:
        for i, n in enumerate(names):
            xs = [j - 0.4 + (i + 0.5) * width for j in range(len(runs))]
            vals = [(e["policies"].get(n) or {}).get(key) for e in runs]
            bars = ax.bar(xs, [v or 0 for v in vals], width, label=n)
            if n == PER_LAYER:
                for bar, e in zip(bars, runs):
                    if e["target"][ratio] is not None:
                        ax.annotate(f"{e['target'][ratio]:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                    ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(runs)), [e["name"] for e in runs])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("One run per regime; labels: fixed-per-layer / Ostinato", fontsize=9)
    return _save(fig, out, "regimes.png")


def write_regimes_report(specs: list[tuple[str, str | Path]], out: str | Path,
                         same_code: tuple[str, ...] = ()) -> dict:
    """Reads each (name, bench folder), refuses incomparable runs, writes regimes.json,
    regimes.md and regimes.png into out; returns the document. same_code: commits the caller
    declares to run the same code here (say why where the report is kept)."""
    if not specs:
        raise ConfigError("--regimes: give at least one NAME=DIR")
    if len(same_code) == 1:
        raise ConfigError("--same-code: name at least two commits that run the same code")
    runs = [load_run(name, folder) for name, folder in specs]
    check_comparable(runs, tuple(same_code))
    doc = regimes_doc(runs, tuple(same_code))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figure = None
    try:
        figure = write_figure(doc, out)
    except Exception as e:  # noqa: BLE001 - a figure must never cost the table
        doc["figure_error"] = f"{type(e).__name__}: {e}"
    doc["files"] = {"report": str(out / "regimes.md"), "results": str(out / "regimes.json"),
                    "figure": str(out / figure) if figure else None}
    (out / "regimes.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "regimes.md").write_text(markdown(doc, figure))
    return doc
