"""One session slot: a KV cache kept across requests, so each turn prefills only new tokens.

An agent resends the whole conversation every turn. The slot remembers which tokens
its KV cache holds; a new request is compared token by token, the cache is cut at the
first difference, and only the rest is prefilled (in chunks, by the runner). Decoding
then appends to the same cache. A forced output (the recorded tokens of a replayed
turn) replaces sampling, so replays of different placements run identical tokens.

An agent also sends side requests (a title, a summary, a sub-agent) between the turns of
its session. Before a request overwrites much of the slot (more than an eighth of it; a
turn that only re-renders its last answer differently is not worth the copy) the slot's
conversation is copied out to host memory (conversations.py), and a request that extends a
saved conversation further than the slot does has that prefix copied back, which costs a
copy over PCIe instead of a prefill.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ostinato.engine.conversations import Conversations, common_prefix
from ostinato.engine.runner import ModelRunner
from ostinato.engine.sampling import Sampler, SamplingParams


class ContextLengthError(ValueError):
    """The prompt does not fit the context window."""


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused (kept in the slot, or restored)
    restored_tokens: int = 0  # of those, the ones copied back from a saved conversation
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


class Engine:
    """The single session slot over a model runner. Not thread-safe: one caller at a time.
    `conversations`: how many other conversations' KV to keep in host memory (0: none)."""

    def __init__(self, runner: ModelRunner, eos_ids: set[int], conversations: int = 0,
                 conversation_bytes: int | None = None):
        self.runner = runner
        self.eos_ids = set(eos_ids)
        self.cached: list[int] = []  # tokens whose KV is in the cache, in order
        self.conversations = Conversations(conversations, conversation_bytes)

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    def reset(self) -> None:
        self.cached = []
        self.conversations.clear()

    def keep_conversations(self, count: int, max_bytes: int | None = None) -> None:
        """Keep the KV of up to `count` other conversations in host memory (0: none), together
        at most `max_bytes` (None: no cap but the count). The slot's worth of that memory is
        taken now (conversations.py: the request that switches first does not pay for it)."""
        self.conversations = Conversations(count, max_bytes)
        self.conversations.reserve(self.runner.kv.layers)

    def _switch(self, prompt: list[int], stats: GenerationStats) -> int:
        """Save the slot's conversation if this prompt would overwrite much of it; restore a
        saved one that this prompt extends further. -> the prefix now in the slot."""
        reuse = common_prefix(self.cached, prompt)
        n = self.conversations.take(prompt, beyond=reuse)
        layers = self.runner.kv.layers
        if len(self.cached) - reuse > len(self.cached) // 8:
            self.conversations.save(self.cached, layers)
        if n:
            self.cached = self.cached[:reuse]  # what the slot holds even if a copy fails half-way
            self.conversations.restore(reuse, n, layers)
            stats.restored_tokens = min(n, len(prompt) - 1) - reuse  # the last prompt token runs anyway
            self.cached, reuse = prompt[:n], n
        return reuse

    def _prefill(self, prompt: list[int], stats: GenerationStats) -> tuple[torch.Tensor, int]:
        reuse = min(self._switch(prompt, stats), len(prompt) - 1)  # >= 1 token to run
        self.cached = self.cached[:reuse]
        logits = self.runner.forward(prompt[reuse:], reuse)
        self.cached = list(prompt)
        return logits, reuse

    def generate(self, prompt: list[int], params: SamplingParams, forced: list[int] | None = None,
                 cancel: threading.Event | None = None, stats: GenerationStats | None = None,
                 insert: deque[int] | None = None) -> Iterator[int]:
        """Yield output token ids one by one; `stats` (if given) is filled as they come.
        `insert`: ids to emit next in place of sampled ones, which the caller may add to between
        tokens (a server writing a tool call's opening; a forced output takes precedence)."""
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
        sampler = Sampler(params, self.runner.device, self.runner.config.vocab_size, prompt)
        t0 = time.perf_counter()
        logits, stats.cached_tokens = self._prefill(prompt, stats)
        for i in range(limit):
            if insert and forced is None:
                token = insert.popleft()  # this step's logits go unread; the penalties still count it
                sampler.observe(token)
            else:
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
