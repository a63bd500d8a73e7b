#!/usr/bin/env bash
# GPU machine: issue [B] whole-model check with residency files planned beforehand
# (.carry/{all,r40,cold}.json, made with `ostinato plan` from the [A] profiles).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OSTINATO_WORKLOADS=$PWD/.carry/workloads OSTINATO_CACHE=/tmp/ocache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${MODEL:-synth:qwen3-30b-a3b}
for spec in "all .carry/all.json" "hybrid40 .carry/r40.json 32GiB" "cpu .carry/cold.json 32GiB"; do
  set -- $spec
  timeout 170 python3 scripts/check_hybrid.py --model $M --name $1 --residency $2 ${3:+--gpu-memory $3} \
    --ref /tmp/ref.pt --steps ${STEPS:-32} 2>&1 | tail -3 | tee -a "$OUT/b_check.jsonl"
done
