#!/usr/bin/env bash
# On the GPU machine: unpack a built ik_llama.cpp kit (ik-kit.tar.xz, or its parts ik-kit.tar.xz.partNN as
# build-on-gpu.sh leaves them in $OUT) into DEST (default /tmp/ik) and check that llama-server finds its
# libraries. Usage: [IK_KIT=FILE] bash unpack.sh [DEST]; then run DEST/ik-kit-dir/llama-server ...
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${1:-/tmp/ik}
mkdir -p "$dest"
kit=${IK_KIT:-$here/ik-kit.tar.xz}  # e.g. IK_KIT=.ik-kit/ik-kit.tar.xz, carried (git-ignored)
if [[ -f $kit ]]; then tar xJf "$kit" -C "$dest"
else cat "$kit".part* | tar xJ -C "$dest"; fi
# rpath: $ORIGIN/lib, $ORIGIN, /usr/local/cuda/targets/x86_64-linux/lib (cudart, cuBLAS 13), /usr/local/nvidia/lib64 (libcuda.so.1)
ldd "$dest"/ik-kit-dir/llama-server | grep -v "linux-vdso\|ld-linux"
missing=$(ldd "$dest"/ik-kit-dir/llama-server | grep "not found" || true)
[[ -z $missing ]] || { echo "missing libraries:"; echo "$missing"; exit 1; }
echo "ik_llama.cpp kit in $dest/ik-kit-dir (llama-server, llama-bench, llama-sweep-bench, llama-quantize; libraries in lib/)"
