"""llama.cpp at its best on the same file ([L]): its server's settings, tuned on development
sessions under the same GPU memory cap, one knob at a time.

The knobs (BENCHMARK.md, the kit's README):
* `--n-cpu-moe N`: the experts of the first N layers stay in host memory. The smallest N
  whose server fits under the cap (a server's GPU memory is set at load: weights, KV cache,
  compute buffers), and N + 1: fewer host layers decode faster, but the extra slack can
  matter to the compute buffers of a large batch;
* `-ub` (with `-b` equal): the micro-batch a prefill pass runs in, 128, 512, 2048;
* `--load-mode`: auto (its default), mmap or none (host experts read from the page cache, or from
  a copy in the process's own buffers, which llama.cpp's loader advises when experts are
  overridden to the CPU, as --n-cpu-moe does). This build (2026-10-06) has no `--no-mmap`: it
  became `--load-mode none`;
* the op-offload threshold: `GGML_OP_OFFLOAD_MIN_BATCH` 32 (its default), 128, 512, or
  `--no-op-offload` (host experts never go to the GPU);
* CPU threads (`-t`, `-tb`): every core, or the worker count of our thread layout ([H]).

The same knobs tune ik_llama.cpp (`flavor`), the fork with its own MoE and CPU kernels
(scripts/device/ik_llama/README.md), through its own flags: its load modes are mmap (its default),
`--no-mmap`, and `-rtr` (the host tensors repacked at load into its interleaved types, no mmap);
its op-offload threshold is `-cuda offload-batch-size=N`, and `-op -1,0` turns offload off. What
its README recommends for MoE models is its default already: flash attention, the fused MoE, and
the offload of only the experts a pass routes to.

`tune` walks the knobs in that order, keeping the best value of each (lowest total request
time on the development turns) before the next: 2 + 3 + 3 + 4 + 2 settings, not their
product. A setting that fails (no start, a failed turn) counts as infinitely slow.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ostinato.engine.gpu_memory import process_gpu_mib


LOAD_MODES = {"llama.cpp": ("auto", "mmap", "none"), "ik_llama.cpp": ("auto", "none", "rtr")}  # by flavor
_IK_LOAD = {"auto": [], "none": ["--no-mmap"], "rtr": ["-rtr"]}


@dataclass(frozen=True)
class LlamaSettings:
    n_cpu_moe: int
    ubatch: int = 512
    load_mode: str = "auto"  # LOAD_MODES: llama.cpp's --load-mode (none: a buffered read); ik's flags above
    op_offload: int | None = 32  # the batch from which host experts go to the GPU; None: never
    threads: int = 16
    flavor: str = "llama.cpp"  # or "ik_llama.cpp"

    def __post_init__(self):
        if self.flavor not in LOAD_MODES:
            raise ValueError(f"flavor {self.flavor!r}: give one of {', '.join(LOAD_MODES)}")
        if self.load_mode not in LOAD_MODES[self.flavor]:
            raise ValueError(f"load mode {self.load_mode!r}: {self.flavor} has {', '.join(LOAD_MODES[self.flavor])}")

    def args(self, model: str, context: int, port: int) -> list[str]:
        """llama-server's arguments: every layer on the GPU but the first n_cpu_moe layers'
        experts, one slot, the given context."""
        a = ["-m", model, "-ngl", "999", "--n-cpu-moe", str(self.n_cpu_moe), "-c", str(context), "-np", "1",
             "-ub", str(self.ubatch), "-b", str(self.ubatch), "-t", str(self.threads), "-tb", str(self.threads),
             "--host", "127.0.0.1", "--port", str(port)]
        if self.flavor == "ik_llama.cpp":
            off = ["-op", "-1,0"] if self.op_offload is None else ["-cuda", f"offload-batch-size={self.op_offload}"]
            return a + _IK_LOAD[self.load_mode] + off
        a.append("--no-webui")
        if self.load_mode != "auto":
            a += ["--load-mode", self.load_mode]
        if self.op_offload is None:
            a.append("--no-op-offload")
        return a

    def env(self) -> dict[str, str]:
        if self.flavor != "llama.cpp" or self.op_offload is None:
            return {}
        return {"GGML_OP_OFFLOAD_MIN_BATCH": str(self.op_offload)}

    def label(self) -> str:
        off = "off" if self.op_offload is None else str(self.op_offload)
        return (("ik_llama.cpp: " if self.flavor != "llama.cpp" else "") +
                f"n-cpu-moe {self.n_cpu_moe}, ub {self.ubatch}, load {self.load_mode}, "
                f"op-offload {off}, {self.threads} threads")


class Measured:
    """What a tuning run has measured, kept in a JSON file after each server start, so that a run cut
    short (a call's deadline on the GPU machine: the 235B-shaped file takes about a minute a setting)
    resumes where it stopped. `key` names what the figures were measured on (server, file, cap,
    turns); a file with another key, or one a kill left unreadable, is started over, never mixed in."""

    def __init__(self, path: Path, key: dict):
        self.path, self.key = path, key
        try:
            old = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            old = {}
        self.data = old if old.get("key") == key else {"key": key, "fits": {}, "totals": {}, "gpu_mib": {}}
        self.resumed = bool(self.data["fits"] or self.data["totals"])

    def get(self, table: str, name: str, fn: Callable[[], tuple[object, bool]]):
        """The value measured before under this name, else fn()'s. fn() -> (value, definite): only a
        definite value is recorded (a server that did not start may have met a port or GPU memory that
        a killed run left behind: the resumed run measures it again)."""
        if name in self.data[table]:
            return self.data[table][name]
        value, definite = fn()
        if definite:
            self.data[table][name] = value
            self.save()
        return value

    def save(self) -> None:
        part = self.path.with_suffix(".part")
        part.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(part, self.path)  # a kill mid-write leaves the previous record whole


def smallest_fitting(fits: Callable[[int], bool], layers: int) -> int:
    """The smallest n in [0, layers] with fits(n), fits being monotone (more host layers, less GPU
    memory); binary search, so about log2(layers) server starts. Raises if even every layer's
    experts in host memory does not fit."""
    if not fits(layers):
        raise RuntimeError(f"llama.cpp does not fit the cap even with the experts of all {layers} layers on the host")
    lo, hi = 0, layers  # fits(hi) holds
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def knob_values(n_fit: int, layers: int, threads: Sequence[int], flavor: str = "llama.cpp") -> list[tuple[str, list]]:
    return [
        ("n_cpu_moe", sorted({n_fit, min(layers, n_fit + 1)})),
        ("ubatch", [128, 512, 2048]),
        ("load_mode", list(LOAD_MODES[flavor])),
        ("op_offload", [32, 128, 512, None]),
        ("threads", list(dict.fromkeys(threads))),
    ]


def tune(measure: Callable[[LlamaSettings], float | None], start: LlamaSettings,
         knobs: list[tuple[str, list]], layers: int | None = None) -> tuple[LlamaSettings, list[dict]]:
    """One knob at a time, in order, each set to its best value before the next; measure(settings)
    -> total seconds, or None for a failure (llama_tune: it did not start, or not under the cap).
    -> (the best settings, one row per measurement). A setting measured before (the same values) is
    not measured again.

    With `layers`, n_cpu_moe goes on past its values, one host layer at a time, while every one failed;
    and a value of a later knob that fails at the current n_cpu_moe is measured once more
    with the experts of one more layer on the host (up to `layers`), and the pair counts as that value:
    a larger ubatch needs a larger compute buffer, and a tuner that kept the smallest n_cpu_moe fixed
    would drop it for not fitting where one layer's experts would make room (session 33's tuning: -ub 2048
    at n-cpu-moe 20 held 12434 MiB against a 12288 MiB cap; session 10 had chosen it at 21)."""
    seen: dict[LlamaSettings, float] = {}
    rows = []

    def score(knob: str, v, s: LlamaSettings) -> float:
        if s not in seen:
            t = measure(s)
            seen[s] = math.inf if t is None else t
            rows.append({"knob": knob, "value": v, "settings": dataclasses.asdict(s), "label": s.label(),
                         "total_s": None if t is None else round(t, 4)})
        return seen[s]

    best = start
    for knob, values in knobs:
        tried, values = {}, list(values)
        for v in values:
            s = dataclasses.replace(best, **{knob: v})
            t = score(knob, v, s)
            if math.isinf(t) and knob != "n_cpu_moe" and layers is not None and s.n_cpu_moe < layers:
                s = dataclasses.replace(s, n_cpu_moe=s.n_cpu_moe + 1)
                t = score(knob, v, s)
            tried[v] = (t, s)
        # n_cpu_moe itself: where every value listed failed (each fit once ready, then grew past the cap in its
        # turns), one more host layer at a time
        while knob == "n_cpu_moe" and layers is not None and values[-1] < layers \
                and all(math.isinf(t) for t, _ in tried.values()):
            v = values[-1] + 1
            values.append(v)
            s = dataclasses.replace(best, n_cpu_moe=v)
            tried[v] = (score(knob, v, s), s)
        choice = min(values, key=lambda v: tried[v][0])  # ties: the first listed (the default)
        if math.isinf(tried[choice][0]):
            raise RuntimeError(f"llama.cpp: every value of {knob} failed ({values})")
        best = tried[choice][1]
    return best, rows


class LlamaServer:
    """One llama-server process with the given settings, on one GPU (CUDA_VISIBLE_DEVICES=gpu), its
    output in log; ready when /health answers 200 (within start_timeout seconds, else ready is False).
    load_s: the seconds to ready; mib: its GPU memory once ready (nvidia-smi).

    It refuses a port something already answers on: a server left running there would answer /health for
    this one, and its GPU memory and threads would weigh on the measurement. On Linux the server gets
    SIGTERM when the process that started it dies, however it dies."""

    def __init__(self, server: str, settings: LlamaSettings, model: str, *, context: int, port: int, gpu: str,
                 log: Path, start_timeout: float = 300):
        import httpx

        if _answers(port):
            raise RuntimeError(f"port {port} is in use on 127.0.0.1 (a llama-server left running?): stop it or "
                               f"give another port")
        env = {**os.environ, **settings.env(), "CUDA_VISIBLE_DEVICES": gpu}
        self.url = f"http://127.0.0.1:{port}"
        self.log = log.open("w")
        self.proc = subprocess.Popen([server, *settings.args(model, context, port)], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        t0 = time.perf_counter()
        self.ready = False
        while time.perf_counter() - t0 < start_timeout and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.ready = True
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.load_s = time.perf_counter() - t0
        self.mib = process_gpu_mib(self.proc.pid) if self.ready else None

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _answers(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:port."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _die_with_parent() -> None:
    """In the child before exec, on Linux: SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
