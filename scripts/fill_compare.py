"""Fills compared by the cost model, offline: the same number of resident experts chosen by route
counts (the first fill), by decode routes alone, by the time each expert saves (the calibrated plan's
fill, planner/cost_model.py expert_values) and per layer (per-layer frequency), each judged on the
development and the held-out profiles with one calibration.

  python scripts/fill_compare.py --profiles DEV.json HELD.json --calibration RES.json [--slots N] [--chunk 2048]

For each fill: the held-out decode routes that go to the CPU per token and MoE layer (the profile's
counts: exact), and the model's MoE ms per decode step, decode and prefill totals over each profile
(decode tokens x step; every prefill pass on the split path). Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json

from ostinato.engine.residency import Residency
from ostinato.engine.routes import RouteCounts
from ostinato.planner import cost_model as cm
from ostinato.planner.fill import fill
from ostinato.policies.static import per_layer_top


def judge(cal: dict, prof: RouteCounts, hot: dict[int, list[int]], top_k: int, chunk: int) -> dict:
    layers = sorted(prof.decode)
    step = cm.predict_decode_step(prof.decode, prof.tokens["decode"], hot, cm.layer_costs(cal, layers), top_k)
    prefill = cm.split_prefill_ms(cal, prof, cm.profile_passes(prof, chunk), hot, top_k)
    decode = prof.tokens["decode"] * step.total_ms
    return {"cold_routes_per_token_layer": round(step.cold_routes_per_layer, 4), "moe_ms": round(step.moe_ms, 3),
            "decode_s": round(decode / 1e3, 2), "prefill_s": round(prefill / 1e3, 2),
            "total_s": round((decode + prefill) / 1e3, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", nargs=2, required=True, metavar=("DEV", "HELD"))
    p.add_argument("--calibration", required=True, help="a calibrated residency file (its constants and hot count)")
    p.add_argument("--slots", type=int, default=None, help="resident experts (default: the file's plan by routes)")
    p.add_argument("--chunk", type=int, default=2048, help="the runner's largest prefill pass")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (default: from the profile)")
    a = p.parse_args(argv)
    dev, held = (RouteCounts.load(f) for f in a.profiles)
    res = Residency.load(a.calibration)
    cal = res.calibration
    k = a.top_k or round(sum(float(c.sum()) for c in dev.decode.values()) / max(1, dev.tokens["decode"])
                         / len(dev.decode))
    n = a.slots or res.frequency_plan().hot_count
    values = cm.expert_values(cal, dev, cm.profile_passes(dev, a.chunk), k)
    if values is None:
        raise SystemExit(f"{a.calibration}: the calibration cannot price the experts (no decode or prefill constants)")
    L = len(dev.decode)
    fills = {"routes": fill(dev.total("all"), n), "decode routes": fill(dev.decode, n), "time saved": fill(values, n),
             f"per layer ({n // L} each)": per_layer_top(dev.total("all"), sorted(dev.decode), n // L)}
    out = {name: {"hot": sum(map(len, hot.values())), "development": judge(cal, dev, hot, k, a.chunk),
                  "held-out": judge(cal, held, hot, k, a.chunk)} for name, hot in fills.items()}
    print(f"{n} resident experts of {L * dev.decode[next(iter(dev.decode))].numel()}, top-{k}; calibration "
          f"{a.calibration}")
    print(f"{'fill':<22} {'hot':>5}  {'held-out cold/tok-layer':>23}  {'MoE ms/step':>11}  "
          f"{'held-out decode s':>17}  {'prefill s':>9}  {'total s':>7}")
    for name, r in out.items():
        h = r["held-out"]
        print(f"{name:<22} {r['hot']:>5}  {h['cold_routes_per_token_layer']:>23.4f}  {h['moe_ms']:>11.3f}  "
              f"{h['decode_s']:>17.2f}  {h['prefill_s']:>9.2f}  {h['total_s']:>7.2f}")
    print(json.dumps({"kind": "ostinato.fill_compare", "slots": n, "top_k": k, "fills": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
