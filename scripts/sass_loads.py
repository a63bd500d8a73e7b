"""The quantized expert kernels (kernels/triton/moe_quant.py) compiled for a GPU that is not here, and their global
loads counted by width: how a change to the kernels' loads shows before any GPU times it. Triton compiles for sm_90
without a device (its own ptxas); nvdisasm, shipped with it, reads the cubin. These are instruction counts, not
timings.

The arguments are specialized as the engine's launches are: pointers, D, F and the slot strides divisible by 16; a
row's stride too where it is (Q4_K and Q5_K rows always; --row16 says so for the others, e.g. Q6_K rows of 8 blocks).
The configs are the H100 tuning's for T <= 320 (prefill) and decode (kernels/tuned/moe_quant_h100_80gb_hbm3.json).
Session 58 ran it with Triton 3.6, the GPU machine's version, in a venv of its own.

Usage: python scripts/sass_loads.py [--qtypes Q6_K Q8_0 Q4_K] [--kernels prefill_w13 prefill_w2 decode_w13 decode_w2]
       [--row16] [--arch 90]
Prints a line per kernel and format; the last line is one JSON document.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ostinato.kernels.triton import moe_quant as mq  # noqa: E402

# kernel -> (function, signature, constexprs beyond QT, arguments specialized as multiples of 16, num_warps)
_PTR = {"x": "*bf16", "h": "*bf16", "w": "*u8", "f": "*fp32", "i": "*i32", "o": "*bf16"}
KERNELS = {
    "prefill_w13": (mq._prefill_w13_kernel,
                    {"x_ptr": "x", "w13_ptr": "w", "h_ptr": "h", "sorted_routes_ptr": "i", "block_slots_ptr": "i",
                     "num_padded_ptr": "i", "b13_ptr": "f", "R": "i32", "K": "i32", "D": "i32", "F": "i32",
                     "stride_xt": "i32", "stride_ws": "i32", "stride_wr": "i32", "ALPHA": "fp32", "LIMIT": "fp32"},
                    {"BLOCK_M": 32, "BLOCK_N": 64, "GROUPS": 2, "PRECISION": "tf32", "HAS_BIAS": False, "ACT": "silu"},
                    ("D", "F", "stride_xt", "stride_ws"), 4),
    "prefill_w2": (mq._prefill_w2_kernel,
                   {"h_ptr": "h", "w2_ptr": "w", "y_ptr": "f", "weights_ptr": "f", "sorted_routes_ptr": "i",
                    "block_slots_ptr": "i", "num_padded_ptr": "i", "b2_ptr": "f", "R": "i32", "D": "i32", "F": "i32",
                    "stride_ws": "i32", "stride_wr": "i32"},
                   {"BLOCK_M": 32, "BLOCK_N": 64, "GROUPS": 2, "PRECISION": "tf32", "HAS_BIAS": False},
                   ("D", "F", "stride_ws"), 4),
    "decode_w13": (mq._decode_w13_kernel,
                   {"x_ptr": "x", "slots_ptr": "i", "w13_ptr": "w", "h_ptr": "h", "b13_ptr": "f", "zero_lo": "i32",
                    "zero_hi": "i32", "K": "i32", "D": "i32", "F": "i32", "stride_xt": "i32", "stride_ws": "i32",
                    "stride_wr": "i32", "ALPHA": "fp32", "LIMIT": "fp32"},
                   {"BLOCK_F": 2, "GROUPS": 4, "NUM_STAGES": 1, "HAS_BIAS": False, "ACT": "silu"},
                   ("D", "F", "stride_xt", "stride_ws"), 1),
    "decode_w2": (mq._decode_w2_kernel,
                  {"h_ptr": "h", "slots_ptr": "i", "weights_ptr": "f", "w2_ptr": "w", "out_ptr": "o", "b2_ptr": "f",
                   "zero_lo": "i32", "zero_hi": "i32", "K": "i32", "D": "i32", "F": "i32", "stride_ws": "i32",
                   "stride_wr": "i32", "stride_ot": "i32"},
                  {"KP": 8, "BLOCK_D": 8, "GROUPS": 4, "NUM_STAGES": 1, "HAS_BIAS": False},
                  ("D", "F", "stride_ws", "stride_ot"), 4),
}
WIDTHS = {"8": r"LDG\.E\.(U|S)8", "16": r"LDG\.E\.(U|S)16", "64": r"LDG\.E\.64", "128": r"LDG\.E\.128"}


def compile_sass(kernel: str, qtype: str, row16: bool, arch: int) -> str:
    fn, args, consts, div16, warps = KERNELS[kernel]
    sig = {n: _PTR.get(t, t) for n, t in args.items()}
    sig.update({n: "constexpr" for n in ("QT", *consts)})
    names = list(sig)
    aligned = [n for n, t in args.items() if t in _PTR] + list(div16)
    if row16 or qtype in ("Q4_K", "Q5_K"):  # 144- and 176-byte blocks: every row stride is a multiple of 16
        aligned.append("stride_wr")
    src = ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in {"QT": qtype, **consts}.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": 1})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def count_loads(sass: str) -> dict:
    """Global load instructions by width (bits; "32" the plain LDG.E), and all instructions."""
    ins = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    loads = [line for line in ins if re.search(r"\bLDG\b|\bLDG\.", line)]
    out = {w: sum(bool(re.search(p, line)) for line in loads) for w, p in WIDTHS.items()}
    out["32"] = len(loads) - sum(out.values())
    return {"instructions": len(ins), "loads": len(loads), "by_width": {w: out[w] for w in ("8", "16", "32", "64", "128")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qtypes", nargs="+", default=["Q6_K", "Q8_0", "Q4_K"], choices=["Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"])
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--row16", action="store_true", help="rows' strides multiples of 16 bytes (Q6_K of 8k blocks)")
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args()
    rows = []
    for kernel in a.kernels:
        for qtype in a.qtypes:
            r = {"kernel": kernel, "qtype": qtype, **count_loads(compile_sass(kernel, qtype, a.row16, a.arch))}
            rows.append(r)
            widths = ", ".join(f"{n} of {w} bits" for w, n in r["by_width"].items() if n)
            print(f"{kernel:12} {qtype:5} {r['instructions']:5d} instructions, {r['loads']:3d} global loads ({widths})")
    from ostinato.bench.report import source_state

    print(json.dumps({"bench": "sass_loads", **source_state(), "triton": triton.__version__, "arch": a.arch,
                      "row16": a.row16, "rows": rows}))


if __name__ == "__main__":
    main()
