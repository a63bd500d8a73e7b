"""Triton kernels of the CUDA paths (imported where a CUDA pass needs them: triton itself is not
imported here)."""
from __future__ import annotations

import os


def fused_dense() -> bool:
    """Whether CUDA passes run the fused kernels of the step's GPU side outside the experts
    (rms_norm.py, qk_rope.py, route.py), as they do unless OSTINATO_FUSED_DENSE=0: the torch
    expressions then, to measure before against after in one process or to rule a kernel out.
    Read when a pass runs (a captured graph keeps its choice)."""
    return os.environ.get("OSTINATO_FUSED_DENSE", "1") != "0"


class _CompileCounter:
    """Triton compiles in this process (a kernel launched with a specialisation not yet in its
    in-memory cache: compiled, or loaded from the on-disk cache), through triton's JIT hooks.

    Why count them: triton compiles a kernel again for each new specialisation of its arguments
    (an integer divisible by 16 or equal to 1, a pointer aligned to 16 bytes), which can first
    occur on any pass; a compile costs a second or more, loading a cached one milliseconds. A
    replay turn that meets one is slow for a reason that is not the engine's."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self.recent: list[tuple[str, float]] = []  # (kernel with its specialisation, seconds), last 64
        self._started = 0.0
        self._installed = False

    def install(self) -> bool:
        """Chain our hooks in front of any already set; False where triton is not importable."""
        if self._installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        import time

        before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook

        def start(*args, **kwargs):
            self._started = time.perf_counter()
            return before(*args, **kwargs) if before else None  # True would skip the compile

        def done(*args, **kwargs):
            took = time.perf_counter() - self._started
            self.count += 1
            self.seconds += took
            self.recent = (self.recent + [(_label(kwargs), round(took, 3))])[-64:]
            return after(*args, **kwargs) if after else None

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = start, done
        self._installed = True
        return True

    def counters(self) -> dict[str, float]:
        """Cumulative {triton_compiles, triton_compile_s}; empty until installed."""
        if not self._installed:
            return {}
        return {"triton_compiles": self.count, "triton_compile_s": round(self.seconds, 4)}


def _label(hook_kwargs: dict) -> str:
    """A compile's kernel with its constexpr arguments and launch options, as triton's hook gives
    them (fn: the kernel, compile: constants by argument path, num_warps, num_stages); triton's own
    repr where they are not there (another triton version)."""
    try:
        fn, c = hook_kwargs["fn"], hook_kwargs["compile"]
        names = fn.jit_function.arg_names
        args = [f"{names[path[0]]}={value}" for path, value in c["constants"].items() if len(path) == 1]
        args += [f"num_warps={c['num_warps']}", f"num_stages={c['num_stages']}"]
        return f"{fn.name}({', '.join(args)})"
    except (KeyError, AttributeError, IndexError, TypeError):
        return str(hook_kwargs.get("repr", "?"))


compiles = _CompileCounter()
