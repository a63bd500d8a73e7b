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
