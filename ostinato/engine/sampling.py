"""Token selection: greedy, temperature and nucleus (top-p), seeded per request."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)  # end the turn (besides EOS)
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (got {self.max_tokens})")
        if self.temperature < 0:
            raise ValueError(f"temperature must be 0 (greedy) or more (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")


class Sampler:
    def __init__(self, params: SamplingParams, device):
        self.params = params
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] (fp32) -> a token id."""
        p = self.params
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p  # always keeps the first
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))
