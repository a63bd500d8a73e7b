"""The llama.cpp tuner's logic (ostinato/bench/llamacpp.py), against fake servers: the search
for the smallest --n-cpu-moe that fits, and the knob-by-knob walk."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from ostinato.bench.llamacpp import LlamaSettings, Measured, knob_values, smallest_fitting, tune


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


def test_ik_llama_cpp_takes_the_same_knobs_through_its_own_flags():
    """ik_llama.cpp (its common/common.cpp): mmap by default, --no-mmap, -rtr; its op-offload
    threshold as a CUDA parameter, and offload off through its offload policy; no --no-webui,
    --load-mode or environment. Its load modes are tuned in place of llama.cpp's."""
    ik = LlamaSettings(18, 2048, "rtr", 128, 16, flavor="ik_llama.cpp")
    args = ik.args("m.gguf", 9216, 8090)
    assert "-rtr" in args and args[args.index("-cuda") + 1] == "offload-batch-size=128" and ik.env() == {}
    assert not {"--no-webui", "--load-mode", "--no-op-offload", "--no-mmap"} & set(args)
    assert args[args.index("--n-cpu-moe") + 1] == "18" and args[args.index("-ub") + 1] == "2048"
    off = dataclasses.replace(ik, load_mode="none", op_offload=None).args("m.gguf", 9216, 8090)
    assert "--no-mmap" in off and off[off.index("-op") + 1] == "-1,0" and "-cuda" not in off and "-rtr" not in off
    assert "ik_llama.cpp" in ik.label() and "ik" not in LlamaSettings(18).label()
    assert dict(knob_values(4, 48, [16], "ik_llama.cpp"))["load_mode"] == ["auto", "none", "rtr"]
    assert dict(knob_values(4, 48, [16]))["load_mode"] == ["auto", "mmap", "none"]
    with pytest.raises(ValueError, match="load mode 'rtr'"):
        LlamaSettings(4, load_mode="rtr")
    with pytest.raises(ValueError, match="flavor"):
        LlamaSettings(4, flavor="vllm")


def test_a_tuning_cut_short_resumes_from_what_it_measured(tmp_path):
    # the first run is killed (a call's deadline) during its fifth setting; the second measures only the rest
    path, key = tmp_path / "progress.json", {"model": "m.gguf", "cap_mib": 12288}

    def cost(s):
        return 10.0 - s.ubatch / 1000 - (s.load_mode == "none")

    class Deadline(Exception):
        pass

    def run(done, budget):
        calls = []

        def measure(s):
            def now():
                if len(calls) == budget:
                    raise Deadline
                calls.append(s)
                return cost(s), True
            return done.get("totals", s.label(), now)

        fits = lambda n: done.get("fits", str(n), lambda: (n >= 5, True))  # noqa: E731
        n = smallest_fitting(fits, 48)
        return tune(measure, LlamaSettings(n), knob_values(n, 48, [16])), calls

    first = Measured(path, key)
    assert not first.resumed
    with pytest.raises(Deadline):
        run(first, 4)
    second = Measured(path, key)
    assert second.resumed and len(second.data["totals"]) == 4
    (got, rows), calls = run(second, 99)
    whole, _ = run(Measured(tmp_path / "other.json", key), 99)
    assert got == whole[0] and got.ubatch == 2048 and got.load_mode == "none"
    assert len(calls) == len(rows) - 4  # nothing measured twice
    assert {r["label"] for r in rows} >= set(Measured(path, key).data["totals"])
    # another file, cap or sample starts over: its figures are not mixed in
    assert not Measured(path, {**key, "cap_mib": 24576}).resumed


def test_a_progress_record_a_kill_left_unreadable_or_a_failed_start_is_measured_again(tmp_path):
    path, key = tmp_path / "progress.json", {"model": "m.gguf"}
    path.write_text('{"key": {"model": "m.g')  # killed mid-write (before writes went through a rename)
    done = Measured(path, key)
    assert not done.resumed
    assert done.get("fits", "18", lambda: (True, True)) is True
    assert done.get("totals", "a", lambda: (None, False)) is None  # the server did not start: not recorded
    again = Measured(path, key)
    assert again.data["fits"] == {"18": True} and "a" not in again.data["totals"]
    assert again.get("totals", "a", lambda: (12.5, True)) == 12.5
    assert Measured(path, key).data["totals"] == {"a": 12.5}
    assert not list(tmp_path.glob("*.part"))


def test_a_replay_takes_an_earlier_tunings_choice_under_the_same_cap(tmp_path):
    """scripts/llama_tune.py --settings: the choice of session 18's tuning on the 235B shape, refused
    under another cap or from a file that is not a tuning."""
    from scripts.llama_tune import chosen

    s18 = {"cap_mib": 24576, "chosen_settings": {"n_cpu_moe": 18, "ubatch": 2048, "load_mode": "none",
                                                  "op_offload": 32, "threads": 16}}
    f = tmp_path / "tuning.json"
    f.write_text(json.dumps(s18))
    assert chosen(f, 24576) == LlamaSettings(18, ubatch=2048, load_mode="none", op_offload=32, threads=16)
    with pytest.raises(SystemExit, match="tuned under 24576 MiB"):
        chosen(f, 12288)
    f.write_text(json.dumps({"cap_mib": 24576}))
    with pytest.raises(SystemExit, match="not a tuning.json"):
        chosen(f, 24576)


def test_tune_gives_a_value_that_does_not_fit_one_more_host_layer():
    """A larger ubatch that does not fit at the smallest n_cpu_moe is measured at the next one, and wins
    there if it is faster: it takes n_cpu_moe along (session 33: -ub 2048 over the cap at 20)."""
    def measure(s):
        if s.ubatch == 2048 and s.n_cpu_moe < 21:
            return None  # over the cap
        return 10.0 - s.ubatch / 1000 + 0.1 * s.n_cpu_moe

    got, rows = tune(measure, LlamaSettings(20), knob_values(20, 48, [16]), layers=48)
    assert (got.n_cpu_moe, got.ubatch) == (21, 2048)
    ub = [(r["settings"]["n_cpu_moe"], r["total_s"]) for r in rows if r["knob"] == "ubatch" and r["value"] == 2048]
    assert ub[0] == (20, None) and ub[1][0] == 21 and ub[1][1] is not None
    # without layers, as before: the value that does not fit is dropped
    got, _ = tune(measure, LlamaSettings(20), knob_values(20, 48, [16]))
    assert (got.n_cpu_moe, got.ubatch) == (20, 512)
    # one layer more only: a value that fits nowhere near still fails, and the next knob goes on
    got, _ = tune(lambda s: None if s.ubatch == 2048 else 5.0 + 0.1 * s.n_cpu_moe, LlamaSettings(47),
                  knob_values(47, 48, [16]), layers=48)
    assert got.ubatch != 2048 and got.n_cpu_moe == 47


def test_tune_moves_n_cpu_moe_on_while_every_value_fails():
    """Each n_cpu_moe value fit once ready but failed in its turns (over the cap after them): the
    tuner goes on one host layer at a time, and stops at the model's layers."""
    got, rows = tune(lambda s: None if s.n_cpu_moe < 23 else 9.0, LlamaSettings(20), knob_values(20, 48, [16]),
                     layers=48)
    assert got.n_cpu_moe == 23
    assert [r["settings"]["n_cpu_moe"] for r in rows if r["knob"] == "n_cpu_moe"] == [20, 21, 22, 23]
    with pytest.raises(RuntimeError, match="every value of n_cpu_moe failed"):
        tune(lambda s: None, LlamaSettings(46), knob_values(46, 48, [16]), layers=48)


def test_a_server_refuses_a_port_something_answers_on(tmp_path):
    """A llama-server left on the port would answer this one's /health: LlamaServer says so and starts
    nothing (the server path does not exist, so starting it would fail otherwise)."""
    import socket

    from ostinato.bench.llamacpp import LlamaServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} is in use"):
            LlamaServer(str(tmp_path / "no-server"), LlamaSettings(0), "m.gguf", context=64, port=port, gpu="0",
                        log=tmp_path / "log")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_dies_with_the_process_that_started_it(tmp_path):
    """The tuner killed outright (SIGKILL: no `finally` runs) still leaves no server behind."""
    import os
    import signal
    import subprocess
    import time

    from tests.test_server import free_port

    pid_file = tmp_path / "server.pid"
    server = tmp_path / "server.sh"
    server.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 120\n")
    server.chmod(0o755)
    parent = subprocess.Popen([sys.executable, "-c", (
        "from pathlib import Path; from ostinato.bench.llamacpp import LlamaServer, LlamaSettings; "
        f"LlamaServer({str(server)!r}, LlamaSettings(0), 'm.gguf', context=64, port={free_port()}, gpu='0', "
        f"log=Path({str(tmp_path / 'log')!r}), start_timeout=120)")])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert parent.poll() is None and time.monotonic() < deadline, "the fake server never started"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        parent.send_signal(signal.SIGKILL)
        parent.wait()

        def alive() -> bool:
            try:
                return Path(f"/proc/{child}/status").read_text().split("State:")[1].split()[0] != "Z"
            except (OSError, IndexError):
                return False

        deadline = time.monotonic() + 10
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(), "the server outlived the process that started it"
    finally:
        parent.kill()
        if pid_file.exists() and pid_file.read_text().strip():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
