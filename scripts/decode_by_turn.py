"""Decode time of one policy against another, turn by turn, from one bench's results.json: for every turn
both replayed with at least MIN output tokens, B's decode time less A's, in all and per decode step, beside
B's decode counters (borrowed memory's copies and hits, where B borrows). Session 45 found with it that
`ostinato-borrow` lost time with every rebalance (results/2026-12-06-h200-s45/).

    python scripts/decode_by_turn.py DIR [--a ostinato] [--b ostinato-borrow] [--min-tokens 8]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

COUNTERS = ("borrowed", "replaced", "borrowed_hits")


def rows(result: dict, a: str, b: str, min_tokens: int) -> list[dict]:
    """A row per turn both policies replayed with at least min_tokens output tokens."""
    ref = {(t["session"], t["turn"]): t for t in result["turns"][a]}
    out = []
    for t in result["turns"][b]:
        r = ref.get((t["session"], t["turn"]))
        if r is None or t["output_tokens"] < min_tokens or r["output_tokens"] != t["output_tokens"]:
            continue
        steps = max(t["output_tokens"] - 1, 1)  # the first token comes from the prefill
        extra = (t["decode_s"] - r["decode_s"]) * 1e3
        dec = t.get("placement", {}).get("decode", {})
        out.append({"session": t["session"], "turn": t["turn"], "tokens": t["output_tokens"],
                    "extra_ms": round(extra, 1), "extra_ms_per_step": round(extra / steps, 3),
                    **{k: dec.get(k, 0) for k in COUNTERS}})
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a bench folder holding results.json")
    p.add_argument("--a", default="ostinato")
    p.add_argument("--b", default="ostinato-borrow")
    p.add_argument("--min-tokens", type=int, default=8)
    args = p.parse_args(argv)
    result = json.loads((args.run / "results.json").read_text())
    missing = [n for n in (args.a, args.b) if n not in result.get("turns", {})]
    if missing:
        p.error(f"{args.run / 'results.json'} has no turns of {', '.join(missing)} (it has {', '.join(result.get('turns', {}))})")
    got = rows(result, args.a, args.b, args.min_tokens)
    print(f"| tokens | {args.b} - {args.a} ms | a step | " + " | ".join(COUNTERS) + " |")
    print("|---|---|---|" + "---|" * len(COUNTERS))
    for r in got:
        print(f"| {r['tokens']} | {r['extra_ms']} | {r['extra_ms_per_step']} | "
              + " | ".join(str(r[k]) for k in COUNTERS) + " |")
    if got:
        print(f"{len(got)} turns; the median turn's loss a step {statistics.median(r['extra_ms_per_step'] for r in got):.2f} ms")
    return got


if __name__ == "__main__":
    main()
