"""Estimate the router skew that gives a target hot share, from one measured profile pair.

Each layer of a synthetic model has its own effective skew (preset skew x a per-layer factor
in [0.75, 1.25]), so one profiled run samples the share-vs-skew curve at as many points as
there are layers. Fit share = k * effective_skew + b per layer (top `fraction` of each layer's
experts by development routes -> share of its held-out routes), then predict the mean over
layers for candidate preset skews. An estimate to be confirmed with `ostinato skew`.

    python scripts/skew_fit.py results/2026-11-29-h200/profile-dev.json \
        results/2026-11-29-h200/profile-held-out.json --measured-skew 0.75
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from ostinato.engine.routes import RouteCounts
from ostinato.synth.weights import SynthSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dev")
    ap.add_argument("held_out")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--measured-skew", type=float, required=True, help="the preset skew the profiles ran with")
    ap.add_argument("--fraction", type=float, default=0.42)
    ap.add_argument("--candidates", type=float, nargs="+", default=[0.45, 0.5, 0.55, 0.6, 0.65, 0.75])
    a = ap.parse_args()
    dev, held = RouteCounts.load(a.dev).total("all"), RouteCounts.load(a.held_out).total("all")
    unit = SynthSpec(a.preset, skew=1.0)  # layer_skew(l) is then the per-layer factor
    factors = np.array([unit.layer_skew(l) for l in sorted(dev)])
    shares = []
    for l in sorted(dev):
        top = torch.argsort(-dev[l].double(), stable=True)[:round(a.fraction * dev[l].numel())]
        shares.append(float(held[l][top].sum() / held[l].sum()))
    eff = a.measured_skew * factors
    k, b = np.linalg.lstsq(np.vstack([eff, np.ones_like(eff)]).T, np.array(shares), rcond=None)[0]
    pred = {s: round(float(np.mean(k * s * factors + b)), 4) for s in a.candidates}
    for s, p in pred.items():
        print(f"preset skew {s:.2f}: predicted mean share of top {100 * a.fraction:.0f}% = {100 * p:.1f}%")
    print(json.dumps({"fit": {"k": round(float(k), 4), "b": round(float(b), 4),
                              "corr": round(float(np.corrcoef(eff, shares)[0, 1]), 3),
                              "effective_skew_range": [round(float(eff.min()), 3), round(float(eff.max()), 3)]},
                      "measured_mean_share": round(float(np.mean(shares)), 4), "predicted": pred}))


if __name__ == "__main__":
    main()
