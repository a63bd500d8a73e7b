"""The llama.cpp tuner's logic (ostinato/bench/llamacpp.py), against fake servers: the search
for the smallest --n-cpu-moe that fits, and the knob-by-knob walk."""
from __future__ import annotations

import dataclasses

import pytest

from ostinato.bench.llamacpp import LlamaSettings, knob_values, smallest_fitting, tune


@pytest.mark.parametrize("need,layers", [(0, 48), (1, 48), (17, 48), (47, 48), (48, 48), (5, 7)])
def test_smallest_fitting_is_the_first_n_that_fits(need, layers):
    asked = []

    def fits(n):
        asked.append(n)
        return n >= need

    assert smallest_fitting(fits, layers) == need
    assert len(asked) <= layers.bit_length() + 2  # a binary search, not a scan


def test_smallest_fitting_refuses_when_nothing_fits():
    with pytest.raises(RuntimeError, match="all 48 layers"):
        smallest_fitting(lambda n: False, 48)


def test_tune_keeps_each_knobs_best_and_measures_each_setting_once():
    # a separable cost with a known optimum: n 13, ub 2048, load mode none, op-offload 128, 14 threads
    best = LlamaSettings(13, 2048, "none", 128, 14)

    def cost(s):
        return (abs(s.n_cpu_moe - 13) + (s.ubatch != 2048) + (s.load_mode != best.load_mode)
                + (s.op_offload != 128) + (s.threads != 14) + 1.0)

    calls = []

    def measure(s):
        calls.append(s)
        return cost(s)

    got, rows = tune(measure, LlamaSettings(13, threads=16), knob_values(13, 48, [16, 14]))
    assert got == best
    assert len(calls) == len(set(calls)) == len(rows)
    # 2 + 3 + 3 + 4 + 2 values, less the settings already measured (the start reappears in every knob)
    assert len(calls) == 1 + 1 + 2 + 2 + 3 + 1
    assert [r["knob"] for r in rows][:2] == ["n_cpu_moe", "n_cpu_moe"]


def test_tune_skips_failures_and_refuses_when_a_knob_has_no_working_value():
    def measure(s):
        return None if s.op_offload is None or s.ubatch == 2048 else 10.0 - s.ubatch / 1000

    got, rows = tune(measure, LlamaSettings(4), knob_values(4, 48, [16]))
    assert got.ubatch == 512 and got.op_offload is not None
    assert any(r["total_s"] is None for r in rows)
    with pytest.raises(RuntimeError, match="every value of n_cpu_moe failed"):
        tune(lambda s: None, LlamaSettings(4), knob_values(4, 48, [16]))


def test_server_arguments_and_environment():
    s = LlamaSettings(8, 128, "none", None, 14)
    args = s.args("m.gguf", 9216, 8090)
    assert args[args.index("--n-cpu-moe") + 1] == "8" and args[args.index("-ub") + 1] == "128"
    assert args[args.index("-b") + 1] == "128" and args[args.index("-t") + 1] == "14"
    assert args[args.index("--load-mode") + 1] == "none" and "--no-op-offload" in args and s.env() == {}
    assert "--no-mmap" not in args  # gone from llama.cpp (2026-09): --load-mode none
    d = dataclasses.replace(s, load_mode="auto", op_offload=512)
    assert "--load-mode" not in d.args("m.gguf", 9216, 8090) and d.env() == {"GGML_OP_OFFLOAD_MIN_BATCH": "512"}
