"""What a server routes, kept beside its plan, so that the next plan learns from the user's own sessions.

`RouteTally` counts every routed (layer, expert) of the passes the engine runs, on the device, by
phase (a one-token pass is decode). The runner puts it around the experts backend the model calls
(engine/runner.py), so captured decode graphs count too: one index_add of K ids per MoE layer and
step, no host sync.

`ServedRoutes` keeps the tally in `<plan>.served.json` (a RouteCounts file, planner/profile.py) with
exponential decay by tokens: a route counted t tokens ago weighs 0.5 ** (t / half_life). The
development profile the plan was made from counts as routes served before the first one, so it
fades the same way (`learned_counts`): after a few half-lives of the user's traffic, the plan is
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

from ostinato.layers.moe.types import TopKOutput
from ostinato.planner.profile import RouteCounts

log = logging.getLogger("ostinato")

DEFAULT_HALF_LIFE = 1_000_000  # tokens: a few hundred agent sessions
FLUSH_SECONDS = 60.0  # the tally goes to the file at most this often (and when the server stops)


def served_path(residency: str | Path) -> Path:
    """Where the routes served with a plan are kept: beside it."""
    p = Path(residency)
    return p.with_name(p.stem + ".served.json")


class RouteTally:
    """Routes per (phase, layer, expert) of the passes run, counted on each layer's device."""

    PHASES = ("prefill", "decode")

    def __init__(self, layers: list[int], num_experts: int, top_k: int):
        self.layers, self.num_experts, self.top_k = list(layers), num_experts, top_k
        self.counts: dict[int, torch.Tensor] = {}  # layer -> [2, E] int64, allocated at its first pass
        self._one: dict[torch.device, torch.Tensor] = {}  # a 1 per device, expanded to each pass's ids

    def wrap(self, backend):
        return _Counting(backend, self)

    def add(self, layer: int, topk: TopKOutput) -> None:
        c = self.counts.get(layer)
        if c is None:
            c = self.counts[layer] = torch.zeros(2, self.num_experts, dtype=torch.int64, device=topk.ids.device)
        ids = topk.ids.reshape(-1)
        one = self._one.get(ids.device)
        if one is None:
            one = self._one[ids.device] = torch.ones(1, dtype=torch.int64, device=ids.device)
        c[int(topk.ids.shape[0] == 1)].index_add_(0, ids, one.expand(ids.numel()))

    @torch.inference_mode()  # the counters were made inside the runner's passes
    def reset(self) -> None:
        """Zero in place (captured graphs keep adding into the same buffers)."""
        for c in self.counts.values():
            c.zero_()

    def take(self) -> RouteCounts:
        """The counts so far, on the host, and zero the tally."""
        rc = RouteCounts.zeros(self.layers, self.num_experts)
        for layer, c in self.counts.items():
            host = c.cpu()
            rc.prefill[layer], rc.decode[layer] = host[0].clone(), host[1].clone()
        self.reset()
        first = next(iter(rc.prefill), None)
        for phase in self.PHASES:  # every token routes K experts in every MoE layer
            rc.tokens[phase] = int(getattr(rc, phase)[first].sum()) // self.top_k if first is not None else 0
        return rc


class _Counting:
    """The backend the model calls: counts, then the backend that computes."""

    def __init__(self, inner, tally: RouteTally):
        self.inner, self.tally = inner, tally

    def __call__(self, layer: int, x: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        self.tally.add(layer, topk)
        return self.inner(layer, x, topk)


def _decay(rc: RouteCounts, factor: float) -> RouteCounts:
    scale = lambda m: {l: torch.round(c.double() * factor).to(torch.int64) for l, c in m.items()}  # noqa: E731
    return RouteCounts(scale(rc.prefill), scale(rc.decode), {k: round(v * factor) for k, v in rc.tokens.items()},
                       rc.sessions, rc.max_tokens)


def _add(a: RouteCounts, b: RouteCounts) -> RouteCounts:
    plus = lambda x, y: {l: x.get(l, 0) + y.get(l, 0) for l in sorted(set(x) | set(y))}  # noqa: E731
    return RouteCounts(plus(a.prefill, b.prefill), plus(a.decode, b.decode),
                       {k: a.tokens.get(k, 0) + b.tokens.get(k, 0) for k in set(a.tokens) | set(b.tokens)},
                       a.sessions + b.sessions, max(a.max_tokens, b.max_tokens))


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


def learned_counts(dev: RouteCounts | None, served: ServedRoutes) -> dict[int, torch.Tensor]:
    """Routes per layer to plan from: the served ones, plus the development profile decayed by
    the tokens served since (float counts)."""
    out = {l: c.double() for l, c in served.counts.total("all").items()} if served.counts else {}
    if dev is not None:
        w = served.dev_weight()
        for l, c in dev.total("all").items():
            out[l] = out.get(l, 0) + w * c.double()
    return out


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
