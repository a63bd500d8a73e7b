"""The entry point: one session per index, cycling through the families of
`session_stats.FAMILIES` and handing each to its family's builder."""

from __future__ import annotations

import random

from ostinato.sessions.stats import FAMILIES, load_stats
from ostinato.sessions.turns import Session, Turn
from ostinato.sessions.synthetic.common import _Lengths
from ostinato.sessions.synthetic.service import _service_session
from ostinato.sessions.synthetic.swe import _swe_session


def generate_sessions(n: int, seed: int = 0) -> list[Session]:
    """n sessions cycling through FAMILIES; session i depends only on (seed, i), so a
    longer list extends a shorter one."""
    families = load_stats()["families"]
    sessions = []
    for i in range(n):
        family = FAMILIES[i % len(FAMILIES)]
        rng = random.Random(f"ostinato-synthetic/{seed}/{i}")
        # spread evenly over the family's sessions, for shares that hold in small samples
        spread = (i // len(FAMILIES) * 0.6180339887 + random.Random(seed).random()) % 1.0
        build = _swe_session if family == "swe-agent" else _service_session
        conversation, requests, kinds, tools = build(rng, _Lengths(rng, families[family]), family, spread)
        # request r sends conversation[:r] and is answered by conversation[r]
        turns = [Turn(conversation, conversation[r], k, sent=r) for r, k in zip(requests, kinds)]
        sessions.append(Session(f"synthetic/{seed}/{i:04d}", f"synth-{seed}-{i}",
                                f"{family}/synthetic", tools, turns))
    return sessions
