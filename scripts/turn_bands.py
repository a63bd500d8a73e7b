"""TTFT by new tokens of a turn, for bench results of the same turns side by side (an A/B/A's
replays): turns after the first, grouped by the tokens each prefilled, the median and sum per run.

    python scripts/turn_bands.py DIR_A1 DIR_B DIR_A2 [--edges 64 128 256 512 1024]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="folders holding a bench's results.json")
    p.add_argument("--edges", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--policy", default="ostinato")
    a = p.parse_args()
    turns = [json.loads((d / "results.json").read_text())["turns"][a.policy] for d in a.runs]
    edges = [1, *a.edges, None]
    print("| new tokens | turns | " + " | ".join(f"{d.name} median / sum ms" for d in a.runs) + " |")
    print("|---|---|" + "---|" * len(a.runs))
    for lo, hi in zip(edges, edges[1:]):
        cells, n = [], 0
        for run in turns:
            ms = [t["ttft_s"] * 1e3 for t in run if t["kind"] != "first"
                  and lo <= t["prompt_tokens"] - t["cached_tokens"] and (hi is None or t["prompt_tokens"] - t["cached_tokens"] < hi)]
            n = len(ms)
            cells.append(f"{statistics.median(ms):.1f} / {sum(ms):.0f}" if ms else "-")
        print(f"| {lo}-{hi - 1 if hi else ''} | {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
