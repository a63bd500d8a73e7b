"""One session slot: a KV cache kept across requests, so each turn prefills only new tokens.

An agent resends the whole conversation every turn. The slot remembers which tokens
its KV cache holds; a new request is compared token by token, the cache is cut at the
first difference, and only the rest is prefilled (in chunks, by the runner). Decoding
then appends to the same cache. A forced output (the recorded tokens of a replayed
turn) replaces sampling, so replays of different placements run identical tokens.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ostinato.engine.runner import ModelRunner
from ostinato.engine.sampling import Sampler, SamplingParams


class ContextLengthError(ValueError):
    """The prompt does not fit the context window."""


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused
    output_tokens: int = 0
    prefill_s: float = 0.0  # prefill of the new prompt tokens, to the first token
    decode_s: float = 0.0  # every later token
    finish_reason: str = "length"  # stop | length | cancelled
    token_times: list[float] = field(default_factory=list)  # perf_counter of each token

    @property
    def new_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def decode_ms_per_token(self) -> float:
        return 1000 * self.decode_s / max(1, self.output_tokens - 1)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Engine:
    """The single session slot over a model runner. Not thread-safe: one caller at a time."""

    def __init__(self, runner: ModelRunner, eos_ids: set[int]):
        self.runner = runner
        self.eos_ids = set(eos_ids)
        self.cached: list[int] = []  # tokens whose KV is in the cache, in order

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    def reset(self) -> None:
        self.cached = []

    def _prefill(self, prompt: list[int]) -> tuple[torch.Tensor, int]:
        reuse = min(common_prefix(self.cached, prompt), len(prompt) - 1)  # >= 1 token to run
        self.cached = self.cached[:reuse]
        logits = self.runner.forward(prompt[reuse:], reuse)
        self.cached = list(prompt)
        return logits, reuse

    def generate(self, prompt: list[int], params: SamplingParams, forced: list[int] | None = None,
                 cancel: threading.Event | None = None, stats: GenerationStats | None = None) -> Iterator[int]:
        """Yield output token ids one by one; `stats` (if given) is filled as they come."""
        stats = stats if stats is not None else GenerationStats()
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.max_context:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens; the context holds {self.max_context} (prompt + output)")
        limit = min(params.max_tokens, self.max_context - len(prompt))
        if forced is not None:
            limit = min(limit, len(forced))
        stats.prompt_tokens = len(prompt)
        sampler = Sampler(params, self.runner.device)
        t0 = time.perf_counter()
        logits, stats.cached_tokens = self._prefill(prompt)
        for i in range(limit):
            sampled = sampler(logits)  # the step's logits reach the host, as in any decode; a forced
            token = forced[i] if forced is not None else sampled  # replay that skipped it would time launches
            now = time.perf_counter()
            if i == 0:
                stats.prefill_s = now - t0
            stats.token_times.append(now)
            stats.output_tokens = i + 1
            yield token
            if forced is None and not params.ignore_eos and (token in self.eos_ids or token in params.stop_ids):
                stats.finish_reason = "stop"
                break
            if cancel is not None and cancel.is_set():
                stats.finish_reason = "cancelled"
                break
            if i + 1 < limit:
                logits = self.runner.forward([token], len(self.cached))
                self.cached.append(token)
        else:
            stats.finish_reason = "stop" if forced is not None else "length"
        if stats.token_times:
            stats.decode_s = stats.token_times[-1] - stats.token_times[0]
