"""Builds the native cold-expert kernels on first use and caches the build.

The extension is compiled just in time with torch.utils.cpp_extension (ninja) into
  $OSTINATO_CACHE/ext/<key>/   (default ~/.cache/ostinato/ext/<key>/)
where <key> hashes the sources, the flags, torch, Python, the machine and the compiler;
a later start imports the cached library directly, without ninja.

No -march=native: the ISA-specific kernels are compiled for AVX-512 / AVX512_BF16 / AMX
through `#pragma GCC target` regions and chosen at run time from cpuid, so the cached
library is portable across x86-64 CPUs and the key need not contain CPU flags. It binds
with pybind11 alone (no torch headers), which keeps the first build to seconds.

When the build is impossible (no compiler, not x86-64 Linux, a compile error),
load_cpu_extension() returns None and load_error() says why in one line; callers then
use the plain-torch path.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

NAME = "ostinato_cpu_experts"
SOURCES = ("experts.cpp", "kernels_avx512.cpp", "kernels_amx.cpp", "kernels_amx8.cpp", "kernels_quant.cpp",
           "graph_worker.cpp",
           "bindings.cpp")
HEADERS = ("experts.h", "kernels.h", "threadpool.h", "graph_worker.h", "vecmath.h", "dequant.h")
# -std=c++17: the oldest standard a supported torch builds extensions with (2.11's; 2.13 passes c++20 before
# these flags). One standard everywhere, so that code C++20 accepts and C++17 does not (a template called by
# name before its declaration, session 50) fails here and in CI, not on the GPU machine alone.
CFLAGS = ("-O3", "-Wall", "-Wno-maybe-uninitialized", "-std=c++17")

_error: str | None = None


def load_error() -> str | None:
    """Why the last load_cpu_extension() returned None (None if it did not)."""
    return _error


def cache_dir() -> Path:
    from ostinato.config import cache_root

    return cache_root() / "ext" / build_key()


def build_key() -> str:
    h = hashlib.sha256()
    src = Path(__file__).parent
    for name in SOURCES + HEADERS:
        h.update(name.encode() + b"\0" + (src / name).read_bytes())
    parts = [torch.__version__, sys.version, platform.machine(), _compiler_id(), *CFLAGS]
    h.update("\0".join(parts).encode())
    return h.hexdigest()[:16]


def _compiler_id() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
        return out.stdout.splitlines()[0] if out.stdout else cxx
    except (OSError, subprocess.SubprocessError):
        return cxx


def _import_built(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@functools.cache
def load_cpu_extension(verbose: bool = False) -> ModuleType | None:
    """The compiled extension module, or None (see load_error())."""
    global _error
    _error = None
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        _error = f"native CPU experts need x86-64 Linux, not {sys.platform}/{platform.machine()}"
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        _error = "no C++ compiler found (set CXX or install g++)"
        return None
    try:
        build_dir = cache_dir()
        built = build_dir / f"{NAME}.so"
        if built.exists():
            return _import_built(built)
        build_dir.mkdir(parents=True, exist_ok=True)
        from torch.utils import cpp_extension

        src = Path(__file__).parent
        return cpp_extension.load(
            name=NAME,
            sources=[str(src / s) for s in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_include_paths=[str(src)],
            build_directory=str(build_dir),
            verbose=verbose,
        )
    except Exception as e:  # noqa: BLE001 - any build failure means "use the fallback"
        lines = str(e).strip().splitlines() or [""]
        first_error = next((ln for ln in lines if "error" in ln.lower() and "Error building" not in ln), lines[0])
        _error = f"building the CPU extension failed: {type(e).__name__}: {first_error.strip()[:300]}"
        return None
