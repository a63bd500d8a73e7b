"""Triton in the tests: kernels on the CPU through a script under TRITON_INTERPRET=1 in a
subprocess (the variable must be set before triton is imported, so not in the test
process); the mark of tests that need CUDA and triton, and a capture helper for them."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def has_cuda() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


needs_cuda = pytest.mark.skipif(not has_cuda(), reason="needs CUDA and triton")

PREAMBLE = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import triton.runtime.interpreter as interp
    # Triton 3.6's interpreter calls int() on 1-element arrays, an error since NumPy 2.4.
    if hasattr(interp, "_patch_lang_tensor"):
        _orig = interp._patch_lang_tensor
        def _patched(tensor, scope):
            _orig(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        interp._patch_lang_tensor = _patched
    sys.path.insert(0, {tests!r})
""")


def run_interpreted(body: str, timeout: int) -> None:
    """Run body (dedented) after the preamble; it must print INTERPRETER_OK."""
    script = PREAMBLE.format(tests=str(Path(__file__).parent)) + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and "INTERPRETER_OK" in proc.stdout, proc.stdout + proc.stderr


def capture(step) -> "torch.cuda.CUDAGraph":
    """step() captured as a CUDA graph, after two warm-up runs (compile, allocator) on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph
