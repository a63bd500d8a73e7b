"""Token selection: greedy or seeded sampling, with the usual logit processors, sync-free.

Every step runs on the logits' device without reading anything back to the host but the
chosen token (which the engine reads anyway): top-k, top-p and min-p mask by comparison
and scatter (no boolean indexing, which would sync), the draw is the exponential trick
(argmax of p / Exp(1), a sample of p), and the penalties keep their state in per-request
tensors updated in place with index_add_ / index_fill_. Order, as in Hugging Face:

    logit_bias -> repetition_penalty -> presence / frequency -> greedy argmax, or
    / temperature -> top_k -> softmax -> top_p -> min_p -> draw

- logit_bias (OpenAI): added to the logits, token id -> [-100, 100];
- repetition_penalty (HF, vLLM): a token seen in the prompt or the output so far has its
  logit divided by r when positive, multiplied by r when negative;
- presence_penalty, frequency_penalty (OpenAI): logit -= presence * [count > 0] +
  frequency * count, over the output tokens so far;
- top_k keeps exactly k candidates (ties broken by topk's order), min_p drops tokens whose
  probability is below min_p times the largest one.

The penalty state counts what this sampler drew. Under a forced output the draws are
discarded (the engine emits the forced ids), and so is what they would have penalised.

Legend: V vocabulary.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is accepted
    seed: int | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)  # end the turn (besides EOS)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in self.logit_bias.items())))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (got {self.max_tokens})")
        if self.temperature < 0:
            raise ValueError(f"temperature must be 0 (greedy) or more (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a count of tokens (got {self.top_k})")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (got {self.min_p})")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, 1 is off (got {self.repetition_penalty})")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass(frozen=True)
class SamplingDefaults:
    """A model's own sampling defaults (generation_config.json, or a GGUF's general.sampling.*),
    used where a request leaves a field out; None: not given, the API's default holds."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def of(cls, source) -> "SamplingDefaults":
        metadata = getattr(source, "metadata", None)
        if isinstance(metadata, dict):  # GGUF
            keys = {"temperature": "temp", "repetition_penalty": "penalty_repeat"}
            return cls(**{f.name: metadata.get(f"general.sampling.{keys.get(f.name, f.name)}") for f in fields(cls)})
        path = Path(getattr(source, "tokenizer_dir", "")) / "generation_config.json"
        if not path.is_file():
            return cls()
        config = json.loads(path.read_text())
        values = {f.name: config.get(f.name) for f in fields(cls)}
        if config.get("do_sample") is False:  # transformers decodes greedily then
            values["temperature"] = 0.0
        return cls(**values)

    def get(self, name: str, fallback):
        value = getattr(self, name, None)
        return fallback if value is None else value


class Sampler:
    """One request's token selection; `prompt` seeds the repetition penalty's seen set."""

    def __init__(self, params: SamplingParams, device, vocab_size: int, prompt: list[int] = ()):
        self.params = params
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        self.bias = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias = torch.zeros(vocab_size, device=device).index_put_(
                (torch.tensor(ids, device=device),), torch.tensor(values, dtype=torch.float32, device=device))
        self.seen = self.counts = None
        if params.penalised:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V] prompt + output
            if prompt:
                self.seen[torch.tensor(list(prompt), device=device)] = True
            self.counts = torch.zeros(vocab_size, device=device)  # [V] output tokens drawn
            self._one = torch.ones(1, device=device)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] (fp32) -> a token id."""
        token = self.select(self.process(logits))
        self.observe(token)
        return int(token)

    def observe(self, token) -> None:
        """A token of the output, drawn here or written in by the caller (steering): the penalties see it."""
        if self.counts is not None:
            token = torch.as_tensor([int(token)] if isinstance(token, int) else token, device=self.seen.device)
            self.seen.index_fill_(0, token.reshape(-1), True)
            self.counts.index_add_(0, token.reshape(-1), self._one)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The bias and penalties applied: the logits greedy decoding takes the argmax of."""
        p = self.params
        if self.bias is not None:
            logits = logits + self.bias
        if self.seen is not None:
            if p.repetition_penalty != 1:
                r = p.repetition_penalty
                logits = torch.where(self.seen, torch.where(logits > 0, logits / r, logits * r), logits)
            if p.presence_penalty or p.frequency_penalty:
                logits = logits - p.frequency_penalty * self.counts - p.presence_penalty * (self.counts > 0)
        return logits

    def select(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed logits [V] -> the token [1] (on the device)."""
        p = self.params
        if p.temperature <= 0:
            return torch.argmax(logits).view(1)
        probs = self.distribution(logits)
        noise = torch.empty_like(probs).exponential_(1, generator=self.generator)
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # an exact 0 would make 0 / 0 of a dropped token
        return torch.argmax(probs / noise).view(1)

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed logits [V] -> the (unnormalised) probabilities drawn from [V]."""
        p = self.params
        logits = logits / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            values, ids = torch.topk(logits, p.top_k)
            logits = torch.full_like(logits, float("-inf")).scatter_(0, ids, values)
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            drop = torch.cumsum(sorted_p, 0) - sorted_p >= p.top_p  # never drops the first
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p.masked_fill(drop, 0.0))
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs
