"""What a server routes, kept beside its plan, so that the next plan learns from the user's own sessions.

The runner's `RouteTally` (engine/routes.py) counts every routed (layer, expert) of the passes the
engine runs, on the device, by phase, captured decode graphs included.

`ServedRoutes` keeps the tally in `<plan>.served.json` (a RouteCounts file, engine/routes.py) with
exponential decay by tokens: a route counted t tokens ago weighs 0.5 ** (t / half_life). The
development profile the plan was made from counts as routes served before the first one, so it
fades the same way (`learned_profile`): after a few half-lives of the user's traffic, the plan is
made from that traffic alone.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from ostinato.engine.routes import RouteCounts, RouteTally
from ostinato.planner.cost_model import prefill_passes

log = logging.getLogger("ostinato")

DEFAULT_HALF_LIFE = 1_000_000  # tokens: a few hundred agent sessions
FLUSH_SECONDS = 60.0  # the tally goes to the file at most this often (and when the server stops)


def served_path(residency: str | Path) -> Path:
    """Where the routes served with a plan are kept: beside it."""
    p = Path(residency)
    return p.with_name(p.stem + ".served.json")


def _decay(rc: RouteCounts, factor: float) -> RouteCounts:
    scale = lambda m: {l: torch.round(c.double() * factor).to(torch.int64) for l, c in m.items()}  # noqa: E731
    passes = {n: k * factor for n, k in rc.passes.items()} if rc.passes is not None else None
    return RouteCounts(scale(rc.prefill), scale(rc.decode), {k: round(v * factor) for k, v in rc.tokens.items()},
                       rc.sessions, rc.max_tokens, passes=passes)


def _plus(x: dict, y: dict) -> dict:
    return {k: x.get(k, 0) + y.get(k, 0) for k in sorted(set(x) | set(y))}


def _unknown_passes(rc: RouteCounts) -> bool:
    """Prefill tokens without their passes: a file from before passes were counted."""
    return rc.passes is None and rc.tokens.get("prefill", 0) > 0


def _add(a: RouteCounts, b: RouteCounts) -> RouteCounts:
    """a + b; their passes, unless one side has prefill tokens whose passes were not counted (then
    none: the sum would hold those tokens without their passes)."""
    unknown = _unknown_passes(a) or _unknown_passes(b)
    passes = None if unknown else _plus(a.passes or {}, b.passes or {})
    return RouteCounts(_plus(a.prefill, b.prefill), _plus(a.decode, b.decode), _plus(a.tokens, b.tokens),
                       a.sessions + b.sessions, max(a.max_tokens, b.max_tokens), passes=passes)


class ServedRoutes:
    """The decayed routes served with one plan, in `<plan>.served.json`; `served_tokens` is every
    token counted since the plan was made, undecayed (the development profile's age)."""

    def __init__(self, path: Path, half_life: int = DEFAULT_HALF_LIFE):
        self.path, self.half_life = Path(path), half_life
        self.counts: RouteCounts | None = None
        self.served_tokens = 0
        self._read()
        self._last_flush = time.monotonic()
        self._failed = False

    def _read(self) -> None:
        """The file as it is now (another server of the same plan may have added to it); one that
        cannot be read is said, and counting starts again from nothing."""
        if not self.path.is_file():
            return
        try:
            d = json.loads(self.path.read_text())
            self.counts, self.served_tokens = RouteCounts.from_json(d), int(d.get("served_tokens", 0))
            self.half_life = int(d.get("half_life", self.half_life))
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("%s cannot be read (%s): the served routes start again from none", self.path, e)
            self.counts, self.served_tokens = None, 0

    def add(self, new: RouteCounts) -> None:
        n = sum(new.tokens.values())
        if n == 0:
            return
        old = self.counts
        self.counts = new if old is None else _add(_decay(old, 0.5 ** (n / self.half_life)), new)
        self.served_tokens += n

    def save(self) -> None:
        d = self.counts.to_json() | {"served_tokens": self.served_tokens, "half_life": self.half_life}
        write_atomic(self.path, json.dumps(d) + "\n")

    def flush(self, tally: RouteTally, force: bool = False) -> None:
        """Move the tally into the file: when forced (the server stops) or FLUSH_SECONDS after the
        last time. The file is read again under a lock first, so that servers sharing a plan add
        their routes instead of overwriting each other's. A file that cannot be written is said
        once, and serving goes on."""
        if self._failed or not (force or time.monotonic() - self._last_flush >= FLUSH_SECONDS):
            return
        self._last_flush = time.monotonic()
        new = tally.take()
        try:
            with file_lock(self.path):
                self._read()
                self.add(new)
                if self.counts is not None:
                    self.save()
        except OSError as e:
            self._failed = True
            log.warning("cannot keep the served routes in %s (%s): the next plan will not learn from them",
                        self.path, e)

    def dev_weight(self) -> float:
        """What a development route weighs now: it was counted before every served token."""
        return 0.5 ** (self.served_tokens / self.half_life)


def learned_profile(dev: RouteCounts | None, served: ServedRoutes, chunk: int) -> RouteCounts:
    """The routes to plan from, by phase: the served ones, plus the development profile decayed by
    the tokens served since (float counts); its prefill passes likewise: the served tally's, as
    counted, plus the development prompts' (in chunks of `chunk`, the runner's largest pass)
    decayed alike. A served file from before passes were counted gets the development prompts'
    passes scaled to its prefill tokens; None where no part has passes or prompts (not weighed)."""
    parts = [(served.counts, 1.0)] if served.counts else []
    if dev is not None:
        parts.append((dev, served.dev_weight()))
    layers = sorted({l for rc, _ in parts for l in rc.prefill})
    phase = lambda name: {l: sum(w * getattr(rc, name)[l].double() for rc, w in parts  # noqa: E731
                                 if l in getattr(rc, name)) for l in layers}
    tokens = {p: round(sum(w * rc.tokens.get(p, 0) for rc, w in parts)) for p in ("prefill", "decode")}
    shapes = prefill_passes(dev.prompts, chunk) if dev is not None and dev.prompts else None
    passes: dict[int, float] | None = None
    for rc, w in parts:
        if rc.passes is not None:
            made = rc.passes
        elif rc.prompts is not None:
            made = prefill_passes(rc.prompts, chunk)
        elif shapes:  # counted without its passes: the development prompts' shapes, as many as its tokens make
            made = {n: k * rc.tokens.get("prefill", 0) / sum(dev.prompts) for n, k in shapes.items()}
        else:
            continue
        passes = _plus(passes or {}, {n: w * k for n, k in made.items()})
    return RouteCounts(phase("prefill"), phase("decode"), tokens, sum(rc.sessions for rc, _ in parts),
                       max((rc.max_tokens for rc, _ in parts), default=0), passes=passes)


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file of this process, then rename: a reader (another server)
    sees the old file or the new one, never half of one."""
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive advisory lock on `<path>.lock`, held while the block runs (servers and planners
    of one plan folder take turns)."""
    import fcntl

    with open(Path(path).with_name(Path(path).name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
