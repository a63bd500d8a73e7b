#!/usr/bin/env bash
# Here, before a device call: .carry as scripts/device/run.sh reads it (README.md, "Before a call"), from ../shared
# and the committed results, so that a new checkout's first call has what its phases need.
#   PATH=<venv with .[test]>/bin:$PATH bash scripts/device/carry.sh   # everything below
#   NO_LLAMA=1 bash scripts/device/carry.sh                            # without the llama.cpp kit (44 MB)
#   bash scripts/device/carry.sh --check                               # only check that the inputs are here
# Then pass carry: [".carry"]; with the kit, move results/ aside for the call (the tree passes 64 MiB with both).
set -euo pipefail
cd "$(dirname "$0")/../.."
shared=${SHARED:-../shared}

# .carry/res/<name> <- the committed file that measured it; run.sh restores .carry/res into /tmp/res ($R)
RES=(
  # the 30B Q4_K_M replays: session 28's calibration and route profiles; llama.cpp's settings tuned in session 36
  "s28_30b_residency.json results/2026-12-04-h200-s28/pair_30b/residency.json"
  "profile-dev.json results/2026-12-04-h200-s28/pair_30b/profile-dev.json"
  "profile-held-out.json results/2026-12-04-h200-s28/pair_30b/profile-held-out.json"
  "s36_llama_tuning.json results/2026-12-06-h100-s36/pair/llama_tune/tuning.json"
  # the 235B shape (32 layers) under 24 GiB: session 28's profiles and calibration; llama.cpp's settings of session 18
  "bench_235b/profile-dev.json results/2026-12-04-h200-s28/pair_235b/profile-dev.json"
  "bench_235b/profile-held-out.json results/2026-12-04-h200-s28/pair_235b/profile-held-out.json"
  "bench_235b/residency.json results/2026-12-04-h200-s28/pair_235b/residency.json"
  "llama_s18_tuning.json results/2026-12-02-h200-s18/llama_235b/tuning.json"
)
missing=0
for entry in "${RES[@]}"; do
  read -r name src <<< "$entry"
  [[ -f $src ]] || { echo "carry: $src is missing (for .carry/res/$name)" >&2; missing=1; }
done
for f in "$shared/workloads" "$shared/llama/kit.tar.xz" "$shared/llama/unpack.sh"; do
  [[ -e $f || ( $f == *llama* && ${NO_LLAMA:-0} == 1 ) ]] || { echo "carry: $f is missing" >&2; missing=1; }
done
[[ $missing == 0 ]] || exit 1
[[ ${1:-} == --check ]] && { echo "carry: every input is here"; exit 0; }

for entry in "${RES[@]}"; do
  read -r name src <<< "$entry"
  install -D -m 644 "$src" ".carry/res/$name"
done
tar cJf .carry/workloads.tar.xz -C "$shared" workloads
if [[ ${NO_LLAMA:-0} != 1 ]]; then
  mkdir -p .carry/llama-kit && cp "$shared"/llama/{kit.tar.xz,unpack.sh} .carry/llama-kit/
fi
ls .carry/wheels/*.whl > /dev/null 2>&1 || bash scripts/device/wheels.sh
mib() { du -sm "$@" | awk '{s += $1} END {print s}'; }
tree=$(git ls-files -z -- . ':!results' | xargs -0 du -cm 2>/dev/null | tail -1 | cut -f1)
echo "carry: .carry $(mib .carry) MiB, the tracked tree without results/ about $tree MiB, results/ $(mib results) MiB" \
  "(a call carries 64 MiB in all)"
