"""Replay metrics (BENCHMARK.md, "Metrics"): per turn at the client, then summaries.

Everything here is a pure function of recorded times and counters. A replay reads its
times from an injected clock (time.perf_counter by default), so tests run the same code
on a fake clock and get exact numbers.

Per turn, at the client: TTFT = first token - send; TPOT = (last token - first token) /
(output tokens - 1); request time = last token - send; session time = the sum of its
requests. From the engine when it reports them: prefill and decode time, new and cached
prompt tokens, and the placement counters of the turn (deltas of placement_stats, split
at the first token into the prefill and the decode phase in-process; one "all" phase over
HTTP).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field

KINDS = ("first", "tool", "user")
PHASES = ("prefill", "decode", "all")


@dataclass
class TurnResult:
    session: str
    turn: int
    kind: str  # first | tool | user (a session turn) or sweep (length sweep)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens whose KV was reused (None: not reported)
    ttft_s: float | None = None
    tpot_s: float | None = None
    request_s: float | None = None
    prefill_s: float | None = None  # engine: new prompt tokens to the first token
    decode_s: float | None = None  # engine: the tokens after the first
    placement: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> counter deltas
    error: str | None = None

    @property
    def new_tokens(self) -> int | None:
        return None if self.cached_tokens is None else self.prompt_tokens - self.cached_tokens

    @property
    def decode_step_s(self) -> float | None:
        if self.decode_s is None or self.output_tokens < 2:
            return None
        return self.decode_s / (self.output_tokens - 1)

    def to_json(self) -> dict:
        d = asdict(self)
        d["new_tokens"] = self.new_tokens
        return d


def client_timing(sent: float, first: float | None, last: float | None, tokens: int):
    """(TTFT, TPOT, request time) from the send time and the first and last token's arrival;
    TPOT is None for fewer than two tokens."""
    if first is None:
        return None, None, None
    last = first if last is None else last
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return first - sent, tpot, last - sent


def placement_delta(before: dict, after: dict) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100), linearly interpolated; None for no values."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values) -> float | None:
    return percentile(values, 50)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(1000 * v, 3)


def phase_tokens(r: TurnResult, phase: str) -> int:
    """Tokens the engine ran in a phase of a turn: the new prompt tokens, then every output
    token but the last (whose successor is never computed)."""
    prefill = r.new_tokens if r.new_tokens is not None else r.prompt_tokens
    decode = max(0, r.output_tokens - 1)
    return {"prefill": prefill, "decode": decode, "all": prefill + decode}[phase]


def placement_summary(results: list[TurnResult], moe_layers: int | None) -> dict[str, dict]:
    """Per phase: cold routes and CPU experts per token and layer, uploads, pool hit rate."""
    out = {}
    for phase in PHASES:
        tot: dict[str, float] = defaultdict(float)
        tokens = 0
        for r in results:
            parts = [r.placement.get(phase)] if phase != "all" or "all" in r.placement else \
                [r.placement.get("prefill"), r.placement.get("decode")]
            parts = [p for p in parts if p]
            if not parts:
                continue
            tokens += phase_tokens(r, phase)
            for p in parts:
                for k, v in p.items():
                    tot[k] += v
        if not tot:
            continue
        token_layers = tot.get("token_layers") or (tokens * moe_layers if moe_layers else 0)
        per = (lambda k: round(tot.get(k, 0) / token_layers, 4)) if token_layers else (lambda k: None)
        routes = tot.get("routes", 0)
        out[phase] = {
            "tokens": tokens,
            "cold_routes_per_token_layer": per("cold_routes"),
            "cpu_experts_per_token_layer": per("cpu_experts"),
            "uploaded_experts_per_token_layer": per("uploaded_experts"),
            "bytes_uploaded": int(tot.get("bytes_uploaded", 0)),
            "bytes_uploaded_per_token": round(tot.get("bytes_uploaded", 0) / tokens, 1) if tokens else None,
            "pool_hit_rate": round(1 - tot.get("cold_routes", 0) / routes, 4) if routes else None,
        }
        for k in ("triton_compiles", "triton_compile_s", "cuda_malloc_retries"):  # what slows a turn from outside
            if tot.get(k):
                out[phase][k] = round(tot[k], 3)
    return out


def session_totals(results: list[TurnResult]) -> dict[str, float]:
    """Session time: the sum of its request times (sessions with a failed turn are left out)."""
    totals: dict[str, float] = defaultdict(float)
    failed = {r.session for r in results if r.error or r.request_s is None}
    for r in results:
        if r.session not in failed:
            totals[r.session] += r.request_s
    return dict(totals)


def wins(ours: dict[str, float], theirs: dict[str, float]) -> tuple[int, int]:
    """(sessions ours finished sooner, sessions both finished)."""
    both = [s for s in ours if s in theirs]
    return sum(ours[s] < theirs[s] for s in both), len(both)


def summarize(results: list[TurnResult], moe_layers: int | None = None) -> dict:
    """Medians by turn kind first, then tails, totals and the placement figures."""
    ok = [r for r in results if not r.error and r.ttft_s is not None and r.kind in KINDS]
    by_kind = {k: [r for r in ok if r.kind == k] for k in KINDS}

    def stat(f, rs, q=50):
        return _ms(percentile([f(r) for r in rs], q))

    sessions = session_totals([r for r in results if r.kind in KINDS])
    return {
        "turns": len(ok),
        "failed_turns": sum(1 for r in results if r.error),
        "sessions": len(sessions),
        "ttft_ms": {"median": {"all": stat(lambda r: r.ttft_s, ok),
                               **{k: stat(lambda r: r.ttft_s, v) for k, v in by_kind.items()}},
                    "p90": {"all": stat(lambda r: r.ttft_s, ok, 90),
                            **{k: stat(lambda r: r.ttft_s, v, 90) for k, v in by_kind.items()}}},
        "tpot_ms": {"median": stat(lambda r: r.tpot_s, ok), "p90": stat(lambda r: r.tpot_s, ok, 90)},
        "request_s": {"total": round(sum(r.request_s for r in ok), 4), "median": _round(median(
            [r.request_s for r in ok]))},
        "prefill_ms": {"median": stat(lambda r: r.prefill_s, ok),
                       **{k: stat(lambda r: r.prefill_s, v) for k, v in by_kind.items()}},
        "decode_step_ms": {"median": stat(lambda r: r.decode_step_s, ok),
                           "p90": stat(lambda r: r.decode_step_s, ok, 90)},
        "new_tokens": {"median": median([r.new_tokens for r in ok]),
                       **{k: median([r.new_tokens for r in v]) for k, v in by_kind.items()}},
        "output_tokens": {"median": median([r.output_tokens for r in ok]), "total": sum(r.output_tokens for r in ok)},
        "session_s": {s: round(t, 4) for s, t in sessions.items()},
        "placement": placement_summary(ok, moe_layers),
    }


def paired_intervals(ours: list[dict], theirs: list[dict], rounds: int = 2000, level: float = 95.0,
                     seed: int = 0) -> dict | None:
    """Bootstrap intervals of two policies' ratios theirs / ours over the turns both replayed
    (raw turn records, as results.json keeps them): median TPOT and total request time, the
    statistics of `summarize`. Each draw resamples the shared turns with replacement and takes
    a drawn turn's record from both policies, so the interval holds the spread between turns
    within the runs; a drift between two runs (--merge) it cannot see. None with fewer than 8
    shared turns. -> {"turns": n, "tpot_speedup": [lo, hi], "request_time_speedup": [lo, hi]}"""
    import random

    def good(r):
        return not r.get("error") and r.get("ttft_s") is not None and r.get("kind") in KINDS

    mine = {(r["session"], r["turn"]): r for r in ours if good(r)}
    pairs = [(mine[k], r) for r in theirs if good(r) and (k := (r["session"], r["turn"])) in mine]
    if len(pairs) < 8:
        return None
    rng = random.Random(seed)
    tpot, total = [], []
    for _ in range(rounds):
        draw = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        a, b = median([o["tpot_s"] for o, _ in draw]), median([t["tpot_s"] for _, t in draw])
        if a and b is not None:
            tpot.append(b / a)
        mine_s = sum(o["request_s"] for o, _ in draw)
        if mine_s:
            total.append(sum(t["request_s"] for _, t in draw) / mine_s)
    tail = (100 - level) / 2

    def interval(xs):
        return [round(percentile(xs, tail), 3), round(percentile(xs, 100 - tail), 3)] if xs else None
    return {"turns": len(pairs), "tpot_speedup": interval(tpot), "request_time_speedup": interval(total)}


# new prompt tokens of a turn, in bands: where each engine's prefill paths change (decode kernels, the
# split path, the split with uploads, the upload path and the dequantized GPU kernels), session 28
SIZE_BANDS = (1, 64, 128, 256, 512, 1024)


def ttft_by_size(ours: list[dict], theirs: list[dict], kind: str | None = "tool",
                 bands: tuple[int, ...] = SIZE_BANDS) -> list[dict]:
    """Two replays' TTFT on the same turns of one kind (raw turn records, as results.json keeps them;
    a turn is (session, turn); kind None: every turn after a session's first), by our turn's new
    prompt tokens in `bands` (band i: bands[i] to bands[i + 1] - 1, the last open): per band with
    turns, the turns, their new tokens' range, our and their median and summed TTFT (ms), and the
    median, least and largest of ours / theirs turn by turn."""
    kinds = (kind,) if kind is not None else KINDS[1:]  # every kind but a session's first turn

    def good(r):
        return not r.get("error") and r.get("ttft_s") and r.get("kind") in kinds and r.get("new_tokens")

    mine = {(r["session"], r["turn"]): r for r in ours if good(r)}
    pairs = [(mine[k], r) for r in theirs if good(r) and (k := (r["session"], r["turn"])) in mine]
    rows = []
    for i, lo in enumerate(bands):
        hi = bands[i + 1] if i + 1 < len(bands) else None
        band = [(o, t) for o, t in pairs if o["new_tokens"] >= lo and (hi is None or o["new_tokens"] < hi)]
        if not band:
            continue
        ratio = [o["ttft_s"] / t["ttft_s"] for o, t in band]
        tokens = [o["new_tokens"] for o, _ in band]
        rows.append({"from": lo, "to": None if hi is None else hi - 1, "turns": len(band),
                     "new_tokens": [min(tokens), max(tokens)],
                     "ttft_ms": [_round(1e3 * median([o["ttft_s"] for o, _ in band]), 1),
                                 _round(1e3 * median([t["ttft_s"] for _, t in band]), 1)],
                     "ttft_sum_ms": [_round(1e3 * sum(o["ttft_s"] for o, _ in band), 1),
                                     _round(1e3 * sum(t["ttft_s"] for _, t in band), 1)],
                     "ratio": {"median": _round(median(ratio), 3), "min": _round(min(ratio), 3),
                               "max": _round(max(ratio), 3)}})
    return rows


def _round(v, n=4):
    return None if v is None else round(v, n)


def sweep_summary(points: list[TurnResult], below: int | None = None) -> dict:
    """Median TTFT (and prefill, decode step) per requested size, and the TTFT slope in ms per
    new token: a least-squares line over all points and over those below `below` (Np)."""
    ok = [p for p in points if not p.error and p.ttft_s is not None]
    sizes: dict[int, list[TurnResult]] = defaultdict(list)
    for p in ok:
        sizes[p.turn].append(p)  # a sweep point's `turn` is its requested number of new tokens
    rows = [{"size": n, "new_tokens": median([p.new_tokens for p in ps]),
             "ttft_ms": _ms(median([p.ttft_s for p in ps])), "prefill_ms": _ms(median([p.prefill_s for p in ps])),
             "tpot_ms": _ms(median([p.tpot_s for p in ps]))} for n, ps in sorted(sizes.items())]
    pts = [(p.new_tokens if p.new_tokens is not None else p.turn, p.ttft_s) for p in ok]
    return {"points": rows, "slope_ms_per_token": _round(slope(pts), 5),
            "slope_below_np_ms_per_token": _round(slope([q for q in pts if below is None or q[0] < below]), 5),
            "np": below}


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of seconds against tokens, in ms per token."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / sxx
