"""Settings of the placement policies: one dataclass, documented defaults, checked once.

Every policy runs under the same expert budget: the bytes the capacity test leaves for
the expert pool (cap - dense weights - KV cache - activations - margin), computed once and
handed to every policy alike, in bytes (a GGUF file's experts keep their block formats, one
pool per format: engine/experts.py); a budget given in slots counts the mean expert's bytes. A policy's whole pool
must fit it: its resident or cached experts, the K zero slots, and the staging slots of
its upload path if it has one (one layer's experts, E, for `layers` and the caches;
Ostinato's flex slots, the most cold experts of a layer up to its plan's bound, or none where
the planner found its upload path did not pay for them: planner/pipeline.py plan_upload_path).
So a policy without an upload path (fixed-per-layer) keeps more experts resident, and none gets
memory another lacks.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ostinato.config import ConfigError

# Ostinato with steps of its design off or on, for the ablation: its residency and decode graph
# with the split path alone, + the upload path at Np, + split passes with uploads (Ostinato as it
# runs by default), + borrowed memory (`--borrow`: it decoded 6% slower on the held-out sessions,
# results/2026-12-01-h200-s6/README.md). Variant -> (upload path, mixed uploads, borrowing).
OSTINATO_STEPS = {"ostinato-split": (False, False, False), "ostinato-upload": (True, False, False),
                  "ostinato": (True, True, False), "ostinato-borrow": (True, True, True)}
# the steps whose own mechanism lives in the flex slots (the upload path, borrowed memory): they run
# the plan with the upload path even where the planner dropped it (Residency.upload_plan), in the
# same budget; `ostinato` and `ostinato-split` run the plan as made
FLEX_STEPS = ("ostinato-upload", "ostinato-borrow")
POLICIES = ("ostinato", "ktransformers", "layers", "expert-cache", "decaying-cache", "fixed-per-layer",
            "fixed-uniform", "cpu", "gpu", "ostinato-split", "ostinato-upload", "ostinato-borrow")
BASELINES = tuple(p for p in POLICIES if p not in OSTINATO_STEPS)
# the report's ablation, from nothing resident to the full design (BENCHMARK.md)
ABLATION = (("cpu", "nothing resident"), ("layers", "whole layers (llama.cpp's fit)"),
            ("fixed-uniform", "the same ids in every layer (KTransformers' uniform)"),
            ("fixed-per-layer", "each layer's most routed (per-layer frequency)"),
            ("ktransformers", "cross-layer fill by routes, KTransformers' rules"),
            ("ostinato-split", "Ostinato's fill by time saved, split prefill"), ("ostinato-upload", "+ upload path"),
            ("ostinato", "+ mixed uploads (Ostinato)"), ("ostinato-borrow", "+ borrowed memory (`--borrow`)"))
# llama.cpp's op-offload threshold (GGML_OP_OFFLOAD_MIN_BATCH) defaults to 32 tokens; the
# values a tuning run chooses from (the reference paper found 512 best for its caches). 2048 (a whole
# prefill chunk) joined after both caches chose 1024, the top of the grid then, on the H200 machine
# (results/2026-12-01-h200-s7/): a choice at the edge says the best may lie beyond it.
OFFLOAD_THRESHOLDS = (32, 128, 512, 1024, 2048)
TUNED = ("ktransformers", "layers", "expert-cache", "decaying-cache")  # the policies with an offload threshold


@dataclass(frozen=True)
class PolicySettings:
    # the budget in expert-sized pool slots (same for every policy); without it,
    # budget_bytes // expert bytes, else the pool of the residency (hot + K + flex)
    expert_slots: int | None = None
    budget_bytes: int | None = None
    gpu_memory: int | None = None  # device cap in bytes (set before anything is allocated)
    # layers, expert-cache, decaying-cache: passes of at least this many tokens upload the
    # host experts they use (each once, into staging), smaller ones compute them on the CPU
    offload_threshold: int = 32
    cache_max_tokens: int = 32  # expert-cache: only passes of at most this many tokens use the cache
    decay: float = 0.95  # decaying-cache: every score is multiplied by this after each decode step
    # dev profile (RouteCounts or a path): fixed-per-layer's ranking, decaying-cache's warm start
    profile: object = None
    residency: object = None  # ostinato: a Residency or a path
    upload_threshold: int | None = None  # ostinato's Np (default: the residency's calibrated value)
    cpu_backend: str = "auto"  # CpuExperts backend: auto | native | torch
    allow_over_budget: bool = False  # gpu: run although all experts exceed the budget (an upper bound only)
    # every policy alike: "native" keeps a GGUF file's experts in its block formats, "bf16" dequantizes them
    experts: str = "native"

    def __post_init__(self):
        if self.offload_threshold < 1 or self.cache_max_tokens < 0:
            raise ConfigError("offload_threshold must be >= 1 and cache_max_tokens >= 0")
        if not 0.0 < self.decay <= 1.0:
            raise ConfigError(f"decay must be in (0, 1], got {self.decay}")
        if self.experts not in ("native", "bf16"):
            raise ConfigError(f"experts {self.experts!r}: give native or bf16")
        if self.expert_slots is not None and self.expert_slots < 0:
            raise ConfigError(f"expert_slots must be >= 0, got {self.expert_slots}")

    def with_(self, **kw) -> "PolicySettings":
        return replace(self, **kw)


def check_policy(name: str) -> str:
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    return name
