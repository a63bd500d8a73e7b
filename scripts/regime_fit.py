"""Estimate a routing regime's skew factor for a preset from measured bench runs of that preset.

A synthetic model's layer l routes with an effective bias scale, SynthSpec.layer_skew(l): the
preset's skew x the regime's skew factor x its depth profile. A bench run of the preset (any
regime) therefore samples, in each of its layers, how a layer routes at that scale: its
development routes per expert (which the plan ranks) and its held-out routes (which the
plan must catch). Pooling the layers of several runs, a candidate factor is judged by
building its 48 (or L) layers from the measured layer nearest in scale, ranking every
(layer, expert) by development share as the cross-layer fill does, and taking the held-out
share of the top `fraction` (the bench's skew figure). The pool's scales bound what it can
say: a layer scaled below the smallest measured scale borrows the smallest one, which
overstates its skew. An estimate, to be confirmed by a bench run of the regime.

    python scripts/regime_fit.py results/2026-12-02-h200-s13/sweep \\
        results/2026-12-02-h200-s13/regimes/layered --ran-with layered=1.5 --regime layered --target 0.82
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ostinato.synth.source import parse_synth
from ostinato.engine.routes import RouteCounts
from ostinato.planner.skew import hot_share
from ostinato.synth.presets import Regime, regime
from ostinato.synth.weights import SynthSpec


def measured_layers(folder: Path, ran_with: dict[str, float]) -> tuple[str, list[tuple[float, torch.Tensor, torch.Tensor]],
                                                                     float]:
    """(preset, [(effective scale, development shares, held-out shares) per MoE layer], top fraction).
    The routing as the run had it: its results.json's `routing` (bench records it since session
    13), else the regime's knobs with the skew factor from `ran_with` (regime -> factor)."""
    result = json.loads((folder / "results.json").read_text())
    preset, opts = parse_synth(result["model"])
    name = opts.get("regime", "flat")
    if "routing" in result:
        knobs = dict(result["routing"])
        skew = knobs.pop("skew")
        routing = Regime(**knobs)
    elif name == "flat" or name in ran_with:
        skew = opts.get("skew")
        routing = regime(name, skew_factor=ran_with.get(name, 1.0),
                         **{k: opts.get(k) for k in ("persistence", "content")})
    else:
        raise SystemExit(f"{folder}: results.json does not record the skew factor of regime {name!r}: "
                         f"give --ran-with {name}=FACTOR")
    spec = SynthSpec(preset, seed=opts.get("seed", 0), skew=skew, regime=routing)
    dev = RouteCounts.load(folder / "profile-dev.json").total("all")
    held = RouteCounts.load(folder / "profile-held-out.json").total("all")
    rows = [(spec.layer_skew(l), dev[l].double() / dev[l].sum(), held[l].double() / held[l].sum()) for l in sorted(dev)]
    return preset, rows, float(result["skew"]["top_fraction"])


def global_share(layers: list[tuple[torch.Tensor, torch.Tensor]], fraction: float) -> float:
    """The bench's skew figure (planner/skew.py hot_share) over layers given as (development,
    held-out) shares: each layer's routes sum to one, so runs of different lengths pool."""
    return hot_share(dict(enumerate(d for d, _ in layers)), dict(enumerate(h for _, h in layers)), fraction)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="bench folders of one preset (results.json and its profiles)")
    ap.add_argument("--regime", required=True, help="the regime whose factor to estimate")
    ap.add_argument("--target", type=float, default=0.82, help="the held-out share wanted on the top fraction")
    ap.add_argument("--ran-with", nargs="*", default=[], metavar="REGIME=FACTOR",
                    help="the skew factor a run's regime had, for runs whose results.json does not record it")
    ap.add_argument("--factors", type=float, nargs="+", default=[0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5])
    a = ap.parse_args()
    ran_with = {k: float(v) for k, v in (x.split("=", 1) for x in a.ran_with)}
    pool, presets, fractions = [], set(), []
    for folder in a.runs:
        preset, rows, fraction = measured_layers(folder, ran_with)
        presets.add(preset)
        fractions.append(fraction)
        pool += rows
        print(f"{folder}: {len(rows)} layers, scales {min(r[0] for r in rows):.3f}-{max(r[0] for r in rows):.3f}, "
              f"measured share {global_share([(d, h) for _, d, h in rows], fraction):.4f} on the top {fraction:.4f}")
    if len(presets) != 1:
        raise SystemExit(f"the runs are of several presets ({', '.join(sorted(presets))}): give runs of one")
    preset, fraction = presets.pop(), sum(fractions) / len(fractions)
    lo = min(r[0] for r in pool)
    best = None
    for f in a.factors:
        spec = SynthSpec(preset, regime=regime(a.regime, skew_factor=f))
        scales = [spec.layer_skew(l) for l in spec.model_config.moe_layers]
        layers = [min(pool, key=lambda r: abs(r[0] - s))[1:] for s in scales]
        share = global_share(layers, fraction)
        below = sum(s < lo for s in scales)
        print(f"factor {f:.2f}: scales {min(scales):.3f}-{max(scales):.3f}, estimated share {share:.4f}"
              + (f" ({below} layers below the smallest measured scale: overstated)" if below else ""))
        if best is None or abs(share - a.target) < abs(best[1] - a.target):
            best = (f, share)
    print(f"closest to {a.target}: factor {best[0]} ({best[1]:.4f}) on the top {fraction:.4f}")


if __name__ == "__main__":
    main()
