"""Agent sessions: the unit that replays, routing profiles and dev/held-out splits use.

An agent session is a chain of requests. After every tool output or user message the
agent sends the whole conversation again (OpenAI chat messages) and gets one assistant
message back; an engine that keeps the previous request's KV cache prefills only the
newly appended messages. The data (`Session`, `Turn`) is sessions/turns.py; this module finds
sessions (files, folders, the embedded generator) and splits them by task into development
and held-out sets.

Lengths in this package are measured in characters (about 4 characters per token for
English, JSON and code), so nothing here depends on a tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from ostinato.sessions.converters import convert
from ostinato.sessions.synthetic import generate_sessions
from ostinato.sessions.turns import Session, SessionFormatError, read_jsonl

SPEC_HELP = (
    "pass 'embedded' (or 'embedded:N' / 'embedded:N:SEED'), a sessions .jsonl, a tau2 "
    "results .json, a tau-bench trajectories .json, a SWE-agent .traj, or a folder of them"
)
EMBEDDED_SESSIONS = 30


def load_sessions(spec: str | Path) -> list[Session]:
    """Sessions from 'embedded[:N[:SEED]]', a file of any supported format, or a folder
    searched recursively (files of other formats in a folder are skipped)."""
    text = str(spec)
    if text == "embedded" or text.startswith("embedded:"):
        return _embedded(text)
    path = Path(text).expanduser()
    if path.is_dir():
        return _load_dir(path)
    if path.is_file():
        sessions = _load_file(path)
        if sessions is None:
            raise SessionFormatError(f"{path}: not a recognised session file; {SPEC_HELP}")
        return sessions
    raise SessionFormatError(f"no such file or directory: {text!r}; {SPEC_HELP}")


def _embedded(spec: str) -> list[Session]:
    parts = spec.split(":")[1:]
    try:
        n = int(parts[0]) if parts and parts[0] else EMBEDDED_SESSIONS
        seed = int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        raise SessionFormatError(f"bad embedded spec {spec!r}; {SPEC_HELP}") from None
    if len(parts) > 2 or n < 0:
        raise SessionFormatError(f"bad embedded spec {spec!r}; {SPEC_HELP}")
    return generate_sessions(n, seed)


def _load_dir(path: Path) -> list[Session]:
    sessions: list[Session] = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        if file.suffix in (".jsonl", ".json", ".traj"):
            sessions.extend(_load_file(file) or [])
    if not sessions:
        raise SessionFormatError(f"no session files found under {path}; {SPEC_HELP}")
    return sessions


def _load_file(path: Path) -> list[Session] | None:
    """Sessions of one file, or None when its content is not a known session format."""
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SessionFormatError(f"{path}: not valid JSON ({e}); {SPEC_HELP}") from e
    return convert(data, path.stem)


def split_sessions(sessions: Sequence[Session], held_out_fraction: float = 0.5,
                   seed: int = 0) -> tuple[list[Session], list[Session]]:
    """Split into (dev, held_out) by task, never by turn or trial.

    Within each source the tasks are ranked by SHA-256 of (seed, source, task) and the
    first round(fraction * tasks) go to held-out, so every source contributes to both
    sides where it has two or more tasks. The split is the same in every process; a
    task's side depends only on the seed and the set of tasks of its source.
    """
    if not 0.0 <= held_out_fraction <= 1.0:
        raise ValueError(f"held_out_fraction must be in [0, 1], got {held_out_fraction}")
    tasks_by_source: dict[str, set[str]] = defaultdict(set)
    for s in sessions:
        tasks_by_source[s.source].add(s.task)
    held: set[tuple[str, str]] = set()
    for source, tasks in tasks_by_source.items():
        ranked = sorted(tasks, key=lambda task: _task_hash(seed, source, task))
        held.update((source, t) for t in ranked[: int(held_out_fraction * len(ranked) + 0.5)])
    dev = [s for s in sessions if (s.source, s.task) not in held]
    held_out = [s for s in sessions if (s.source, s.task) in held]
    return dev, held_out


def _task_hash(seed: int, source: str, task: str) -> str:
    return hashlib.sha256(f"{seed}\x1f{source}\x1f{task}".encode()).hexdigest()


def spread(items: list, n: int) -> list:
    """n items evenly spaced over the list; items with a `source` (sessions of a mixed
    folder) are shared out between the sources in turn, so a small sample of a folder of
    100 tau2 and 14 swe-agent sessions still holds both."""
    if n >= len(items):
        return list(items)
    groups: dict = {}
    for it in items:
        groups.setdefault(getattr(it, "source", None), []).append(it)
    quota = dict.fromkeys(groups, 0)
    while sum(quota.values()) < n:
        for key, group in groups.items():
            if quota[key] < len(group) and sum(quota.values()) < n:
                quota[key] += 1
    return [g[i * len(g) // quota[k]] for k, g in groups.items() for i in range(quota[k])]
