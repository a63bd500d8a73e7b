"""Statistics of the recorded workloads, the shape the synthetic sessions follow.

The recordings cannot ship inside the package, so `write_stats` (sessions/record_stats.py)
measures them once per source
family (tau2 and tau-bench customer service, SWE-agent coding): quantiles of the number of
turns, of the characters newly appended before each request (by turn kind) and of the output
length, and the shares of turn kinds and tool calls. They are written to
`ostinato/data/session_stats.json`, which ships with the package and is what
`ostinato.sessions.synthetic` samples from. Lengths are characters (about 4 per token).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterable, Sequence

from ostinato.sessions.turns import KINDS, Session
from ostinato.sessions.text import message_chars, messages_chars


FAMILIES = ("tau2", "tau-bench", "swe-agent")
QUANTILE_LEVELS = tuple(i / 20 for i in range(21))
STATS_PATH = Path(__file__).resolve().parents[1] / "data" / "session_stats.json"


def family_of(session: Session) -> str:
    """The source family: the first component of `source` ("tau2/airline" -> "tau2")."""
    return session.source.split("/", 1)[0]


def quantiles(values: Sequence[float]) -> list[float]:
    """Values at QUANTILE_LEVELS, linearly interpolated (empty input: empty list)."""
    xs = sorted(values)
    out = []
    for q in QUANTILE_LEVELS if xs else ():
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        out.append(round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 1))
    return out


def measure_stats(sessions: Iterable[Session]) -> dict[str, dict]:
    """Per family: quantiles of turns per session, of new characters per turn by kind and
    of output characters (tool-call and text outputs), shares of kinds and of tool calls."""
    groups: dict[str, list[Session]] = defaultdict(list)
    for s in sessions:
        groups[family_of(s)].append(s)
    return {family: _family_stats(group) for family, group in sorted(groups.items())}


def _family_stats(sessions: list[Session]) -> dict:
    new: dict[str, list[int]] = defaultdict(list)
    out: dict[str, list[int]] = defaultdict(list)
    kinds: Counter[str] = Counter()
    for s in sessions:
        for i, turn in enumerate(s.turns):
            kinds[turn.kind] += 1
            new[turn.kind].append(messages_chars(s.new_messages(i)))
            out["tool_call" if turn.output.get("tool_calls") else "text"].append(message_chars(turn.output))
    turns = sum(kinds.values())
    calling = [s for s in sessions if any(t.output.get("tool_calls") for t in s.turns)]
    return {
        "sessions": len(sessions),
        "turns": turns,
        "turns_per_session": quantiles([len(s.turns) for s in sessions]),
        "new_chars": {k: quantiles(v) for k, v in sorted(new.items())},
        "output_chars": {k: quantiles(v) for k, v in sorted(out.items())},
        "tool_call_share": round(len(out.get("tool_call", [])) / max(turns, 1), 4),
        "kind_share": {k: round(kinds[k] / max(turns, 1), 4) for k in KINDS},
        "tool_call_session_share": round(len(calling) / max(len(sessions), 1), 4),
        "tools_chars": quantiles([len(json.dumps(s.tools)) if s.tools else 0 for s in sessions]),
    }


@lru_cache(maxsize=1)
def load_stats() -> dict:
    """The statistics shipped with the package (`ostinato/data/session_stats.json`)."""
    return json.loads((resources.files("ostinato") / "data" / "session_stats.json").read_text("utf-8"))
