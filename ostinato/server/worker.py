"""The engine thread: it owns the model and the one session slot.

It loads the model first (in the background, so that /health can say "loading" while
the weights come in), then serves jobs from a FIFO queue, one at a time: two requests
never interleave in the KV cache, and each sees the cache the previous one left. A job
reports through its `emit` callback (the bridge makes that thread-safe); a client that
goes away sets the job's cancel event, which the engine checks after every token, and
a job cancelled while still queued is skipped. A job's steering (server/steering.py) sees
the text after every token and may write tokens in or end the output.

Errors stay inside the job: an engine exception fails that request only, and the slot's
cache stays consistent because the Engine records its tokens only after each forward. A
failed load is different: it goes to `on_failed`, which `ostinato serve` sets to stop the
server, so that a supervisor sees the process exit instead of a server answering 500.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ostinato.engine.sampling import SamplingParams
from ostinato.engine.session import GenerationStats
from ostinato.server.steering import Steering
from ostinato.server.textstream import TextStream

log = logging.getLogger("ostinato.server")


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    forced: list[int] | None = None
    stop: list[str] = field(default_factory=list)
    steering: Steering | None = None  # tokens the server writes into the output (not with a forced one)
    cancel: threading.Event = field(default_factory=threading.Event)
    emit: Callable[[object], None] = lambda event: None


@dataclass
class Token:
    id: int
    text: str  # may be empty: held back, or a silent end-of-turn token


@dataclass
class Finished:
    ids: list[int]
    text: str
    stats: GenerationStats
    finish_reason: str  # stop | length | cancelled
    tail: str = ""  # text held back until the end (a partial character or stop sequence)
    stop_sequence: str | None = None  # the stop sequence that ended it, if one did


@dataclass
class Failed:
    error: Exception


class EngineWorker:
    """`load(progress)` -> a `Loaded` (ostinato.load), called on the engine thread;
    progress(phase, done=None, of=None) says where the load is (/health shows it)."""

    def __init__(self, load: Callable[[Callable[[str], None]], object], warmup: bool = True):
        self._load = load
        self.on_finished: Callable[[GenerationStats], None] = lambda stats: None  # metrics hook
        self.on_ready: Callable[[object], None] = lambda loaded: None  # the loaded model, after warm-up
        self.on_failed: Callable[[Exception], None] = self._log_failure  # the load's exception
        # on the engine thread, which owns the runner: after every job, and once when the worker stops
        self.after_job: Callable[[], None] = lambda: None
        self.on_stop: Callable[[], None] = lambda: None
        self._current: Job | None = None  # the job the engine thread runs
        self._warmup = warmup
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ostinato-engine", daemon=True)
        self.loaded = None
        self.state = "loading"  # loading | ok | error
        self.phase = "starting"
        self.done: int | None = None  # units of the phase done, of `of` (sessions profiled, ...)
        self.of: int | None = None
        self.error: str | None = None
        self.exception: Exception | None = None  # what failed the load
        self.started_at = time.monotonic()
        self.started_at_wall = time.time()
        self.placement: dict[str, float] = {}  # last runner.placement_stats(), read by /metrics
        self.conversations = {"held": 0, "bytes": 0, "pool": 0}  # engine.conversations at load and after every job

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what runs and what waits, then let the engine thread finish (its on_stop included)."""
        with self._jobs.mutex:
            waiting = [j for j in self._jobs.queue if j is not None]
        for job in ([self._current] if self._current is not None else []) + waiting:
            job.cancel.set()
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def progress(self) -> dict:
        out = {"phase": self.phase}
        if self.of is not None:
            out |= {"done": self.done, "of": self.of}
        return out | {"elapsed_s": round(time.monotonic() - self.started_at, 1)}

    def _set_phase(self, phase: str, done: int | None = None, of: int | None = None) -> None:
        self.phase, self.done, self.of = phase, done, of

    def _run(self) -> None:
        try:
            loaded = self._load(self._set_phase)
            if self._warmup:
                self._set_phase("warming up")
                self._warm(loaded)
            self._record(loaded)
            self.on_ready(loaded)  # inside the try: a start-up that fails here fails the load
            self.loaded, self.state, self.phase = loaded, "ok", "ready"
        except Exception as e:  # shown by /health and every request until on_failed acts
            self.exception, self.error, self.state, self.phase = e, f"{type(e).__name__}: {e}", "error", "failed"
            self.on_failed(e)
        while (job := self._jobs.get()) is not None:
            self._current = job
            self._serve(job)
            self._current = None
            self._hook(self.after_job)
        self._hook(self.on_stop)

    @staticmethod
    def _hook(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            log.exception("an engine hook failed")

    @staticmethod
    def _log_failure(error: Exception) -> None:
        log.error("loading the model failed", exc_info=error)

    @staticmethod
    def _warm(loaded) -> None:
        """On CUDA, load.warm_up's passes: one of each prefill tile config, so that no request's
        TTFT pays for a kernel compile; elsewhere one short generation, so the first request's
        TTFT is not lazy initialisation."""
        if loaded.runner.device.type == "cuda":
            from ostinato.load import warm_up

            warm_up(loaded)
            return
        prompt = loaded.tokenizer.encode("Hello, world")
        for _ in loaded.engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0)):
            pass
        loaded.engine.reset()

    def _serve(self, job: Job) -> None:
        if job.cancel.is_set() or self.loaded is None:  # the client left while queued
            job.emit(Finished([], "", GenerationStats(finish_reason="cancelled"), "cancelled"))
            return
        tok = self.loaded.tokenizer
        text = TextStream(tok, [] if job.forced is not None else job.stop, tok.eos_ids)
        stats, ids, insert = GenerationStats(), [], deque()
        steering = job.steering if job.forced is None else None
        steered = False  # the steering ended the output
        try:
            if steering is not None:
                insert.extend(steering.after("", 0))
            for token in self.loaded.engine.generate(job.prompt, job.params, job.forced, job.cancel, stats, insert):
                ids.append(token)
                delta = text.feed(token)
                if text.stopped:
                    job.cancel.set()  # the engine stops before another forward
                elif steering is not None and not insert:  # what it wrote is all in the text
                    more = steering.after(text.text, len(ids))
                    if more is None:
                        steered = True
                        job.cancel.set()
                    else:
                        insert.extend(more)
                job.emit(Token(token, delta))
            tail = text.flush()
        except Exception as e:
            log.exception("generation failed")
            job.emit(Failed(e))
            return
        finally:
            self._after(stats)
        job.emit(Finished(ids, text.text, stats, self._reason(job, stats, text, steered), tail, text.matched))

    @staticmethod
    def _reason(job: Job, stats: GenerationStats, text: TextStream, steered: bool) -> str:
        if text.stopped or steered:
            return "stop"
        if job.forced is not None and stats.finish_reason == "stop" and stats.output_tokens < len(job.forced):
            return "length"  # the forced output was cut by max_tokens or the context
        return stats.finish_reason

    def _after(self, stats: GenerationStats) -> None:
        try:
            self._record(self.loaded)
            self.on_finished(stats)
        except Exception:
            log.exception("recording metrics failed")

    def _record(self, loaded) -> None:
        """What /metrics shows of the engine: its placement counters and its saved conversations
        (their pool is reserved at load)."""
        self.placement = loaded.runner.placement_stats()
        store = loaded.engine.conversations
        self.conversations = {"held": len(store.saved), "bytes": store.nbytes, "pool": store.pool_bytes}
