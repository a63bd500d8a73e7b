"""Registers, stack (spills) and shared memory of the split-K attention kernel under its launch plans,
compiled for a GPU architecture without a GPU: Triton lowers to PTX, ptxas assembles for the target and
cuobjdump (both in Triton's wheel) reads the resources. A kernel whose threads need more than 255
registers keeps the rest on its stack (local memory): a nonzero STACK is a spill.

Shapes: Qwen3-30B-A3B's heads (G = 8, Dk = Dv = 128) at decode (T = 1) and in captured passes of 64 and
255 tokens over an 8292-key window; DeepSeek-V3's latent attention (G = 128, Dk = 576, Dv = 512) at
decode and in a 32-token pass. --warps and --block-r override the plan's (as decode_attention's
arguments do), to see what a variant would hold before timing it.
Usage: python scripts/kernel_resources.py [--arch 90] [--warps 8] [--block-r 32]
(needs triton; session 36 ran it on the CPU-only development host with Triton 3.6).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [  # name, T, G, Dk, Dv, window
    ("qwen3 decode", 1, 8, 128, 128, 8292),
    ("qwen3 pass 64", 64, 8, 128, 128, 8292),
    ("qwen3 pass 255", 255, 8, 128, 128, 8292),
    ("mla decode", 1, 128, 576, 512, 8292),
    ("mla pass 32", 32, 128, 576, 512, 8292),
]
STRIDES = ["stride_qt", "stride_qh", "stride_qd", "stride_kn", "stride_kh", "stride_kd", "stride_vn", "stride_vh",
           "stride_vd"]
POINTERS = ["q_ptr", "k_ptr", "v_ptr", "pos_ptr", "m_ptr", "l_ptr", "acc_ptr"]


def split_kernel_binary(T: int, G: int, Dk: int, Dv: int, window: int, arch: int, warps: int | None,
                        block_r: int | None):
    """The split kernel compiled as decode_attention launches it (bf16, pointers 16-byte aligned, as torch's
    allocations are) -> (its launch plan, the compiled kernel)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ostinato.kernels.triton import decode_attention as da
    from ostinato.kernels.triton.decode_plan import launch_plan

    plan = launch_plan(T, G, Dv, window, num_warps=warps, block_r=block_r)
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "m_ptr": "*fp32",
           "l_ptr": "*fp32", "acc_ptr": "*fp32", "qk_scale": "fp32", "T": "i32", "W": "i32", "CHUNK": "i32",
           "NS": "i32", **{s: "i32" for s in STRIDES}}
    const = da.split_constexprs(T, G, Dk, Dv, plan, fp32=False)
    sig |= {k: "constexpr" for k in const}
    names = list(sig)
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in POINTERS}
    src = triton.compiler.ASTSource(fn=da._split_kernel, signature=sig, constexprs=const, attrs=attrs)
    return plan, triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": plan.num_warps, "num_stages": plan.num_stages})


def resources(kernel) -> dict:
    """REG, STACK and SHARED of a compiled kernel's cubin, by cuobjdump --dump-resource-usage; the shared
    memory Triton allocates dynamically is in its metadata."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    finally:
        os.unlink(f.name)
    found = dict(re.findall(r"(REG|STACK):(\d+)", out))
    return {"registers": int(found["REG"]), "stack_bytes": int(found["STACK"]),
            "shared_bytes": int(kernel.metadata.shared)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: Hopper)")
    ap.add_argument("--warps", type=int, help="num_warps instead of the plan's")
    ap.add_argument("--block-r", type=int, help="rows a split program instead of the plan's")
    a = ap.parse_args(argv)
    if importlib.util.find_spec("triton") is None:
        sys.exit("kernel_resources: needs triton")
    rows = []
    print(f"{'case':<16} {'block_r':>7} {'block_n':>7} {'warps':>5} {'stages':>6} {'regs':>5} {'stack B':>8} "
          f"{'shared KiB':>10}")
    for name, T, G, Dk, Dv, W in CASES:
        plan, kernel = split_kernel_binary(T, G, Dk, Dv, W, a.arch, a.warps, a.block_r)
        r = resources(kernel)
        rows.append({"case": name, "tokens": T, "G": G, "Dk": Dk, "Dv": Dv, "window": W, **plan._asdict(), **r})
        print(f"{name:<16} {plan.block_r:>7} {plan.block_n:>7} {plan.num_warps:>5} {plan.num_stages:>6} "
              f"{r['registers']:>5} {r['stack_bytes']:>8} {r['shared_bytes'] / 1024:>10.1f}")
    print(json.dumps({"arch": a.arch, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
