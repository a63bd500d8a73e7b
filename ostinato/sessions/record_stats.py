"""Measure the recorded workloads once and write `ostinato/data/session_stats.json`, the
statistics the synthetic sessions follow (sessions/stats.py reads and applies them).
A maintenance tool: run it when ../shared/workloads changes.

    python -m ostinato.sessions.record_stats
"""
from __future__ import annotations

import hashlib
import json
from datetime import date
from pathlib import Path

from ostinato.sessions.stats import QUANTILE_LEVELS, STATS_PATH, measure_stats
from ostinato.sessions.read import load_sessions
from ostinato.sessions.turns import Session


def default_workloads_dir() -> Path:
    """`../shared/workloads` next to the repository that holds this package."""
    return Path(__file__).resolve().parents[3] / "shared" / "workloads"


def write_stats(path: str | Path = STATS_PATH, workloads: str | Path | None = None) -> dict:
    """Measure the recorded workloads and write the statistics the generator samples from."""
    root = Path(workloads) if workloads else default_workloads_dir()
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".json", ".traj", ".jsonl"))
    sessions: list[Session] = []
    sources = []
    for file in files:
        loaded = load_sessions(file)
        sessions += loaded
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        sources.append({"path": file.relative_to(root).as_posix(), "sha256": digest, "sessions": len(loaded)})
    stats = {
        "measured_on": date.today().isoformat(),
        "workloads": "../shared/workloads (see its README for origins and licenses)",
        "written_by": "ostinato.sessions.record_stats.write_stats",
        "units": "characters of message text (content, tool-call names and JSON arguments); about 4 per token",
        "quantile_levels": list(QUANTILE_LEVELS),
        "sources": sources,
        "families": measure_stats(sessions),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(stats, indent=1) + "\n", encoding="utf-8")
    return stats


if __name__ == "__main__":
    write_stats()
