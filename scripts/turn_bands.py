"""TTFT by new tokens of a turn, for bench results of the same turns side by side (an A/B/A's
replays): every turn after a session's first, grouped by the tokens it prefilled
(metrics.ttft_by_size over the bands of SIZE_BANDS), each run's median and sum, and each later
run's TTFT over the first's turn by turn (the median).

    python scripts/turn_bands.py DIR_A1 DIR_B DIR_A2 [--policy ostinato]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ostinato.bench.metrics import ttft_by_size  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="folders holding a bench's results.json")
    p.add_argument("--policy", default="ostinato")
    a = p.parse_args()
    first, *later = [json.loads((d / "results.json").read_text())["turns"][a.policy] for d in a.runs]
    # each later run against the first on the turns both replayed; the first run's cells from the first pairing
    tables = [{r["from"]: r for r in ttft_by_size(run, first, kind=None)} for run in later or [first]]
    names = [d.name for d in a.runs]
    print("| new tokens | turns | " + " | ".join(f"{n} median / sum ms" for n in names)
          + "".join(f" | {n} / {names[0]}" for n in names[1:]) + " |")
    print("|---|---|" + "---|" * (len(names) + len(later)))
    for lo in sorted(tables[0]):
        rows = [t.get(lo) for t in tables]
        r0 = rows[0]
        cells = [f"{r0['ttft_ms'][1]:.1f} / {r0['ttft_sum_ms'][1]:.0f}"]
        cells += [f"{r['ttft_ms'][0]:.1f} / {r['ttft_sum_ms'][0]:.0f}" if r else "-" for r in rows[:len(later)]]
        ratios = [f"{r['ratio']['median']:.2f}" if r else "-" for r in rows[:len(later)]]
        hi = r0["to"] if r0["to"] is not None else ""
        print(f"| {lo}-{hi} | {r0['turns']} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main()
