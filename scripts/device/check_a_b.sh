#!/usr/bin/env bash
# GPU machine, one call: issue [A] (skew of the full-size synthetic model, all-GPU decode)
# and issue [B] (hybrid 40% resident under a 32 GiB cap vs all-GPU vs all-CPU experts,
# CPU expert kernel micro-benchmark). Logs and JSON under $OUT.
#   bash scripts/device/check_a_b.sh [all|a|b|bench|tests]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OSTINATO_WORKLOADS=$PWD/.carry/workloads OSTINATO_CACHE=/tmp/ocache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
O="python3 -m ostinato.cli"
M=${MODEL:-synth:qwen3-30b-a3b}
STEP=${1:-all}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  lscpu | grep -E "Model name"; free -g | head -2
  python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"
  git rev-parse HEAD; git status --short | wc -l; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [[ $STEP == all || $STEP == a ]]; then
  $O plan --model $M --hot-fraction 1.0 -o /tmp/all.json
  timeout 300 $O skew --model $M --residency /tmp/all.json --sessions .carry/workloads --max-sessions ${SKEW_SESSIONS:-16} \
    --fraction 0.40 0.44 --save-profiles "$OUT/profile" 2>&1 | grep -v "session/s\]" | tee "$OUT/a_skew.txt"
fi
if [[ $STEP == all || $STEP == b ]]; then
  $O plan --model $M --hot-fraction 1.0 -o /tmp/all.json
  $O plan --model $M --hot-fraction 0.0 -o /tmp/cold.json
  $O plan --model $M --profile "$OUT/profile-dev.json" --held-out "$OUT/profile-held-out.json" --hot-fraction 0.4 \
    -o "$OUT/residency-40.json" | tee "$OUT/b_plan.txt"
  for spec in "all /tmp/all.json" "hybrid40 $OUT/residency-40.json 32GiB" "cpu /tmp/cold.json 32GiB"; do
    set -- $spec
    timeout 200 python3 scripts/check_hybrid.py --model $M --name $1 --residency $2 ${3:+--gpu-memory $3} \
      --ref /tmp/ref.pt --steps ${STEPS:-64} 2>&1 | tail -3 | tee -a "$OUT/b_check.jsonl"
  done
fi
if [[ $STEP == all || $STEP == a ]]; then
  timeout 150 $O generate --model $M --prompt "Check the order status for order #W2378156 and tell me the delivery date." \
    --max-tokens 64 --json 2>&1 | tail -2 | tee "$OUT/a_generate_reference.json"
fi
if [[ $STEP == all || $STEP == bench ]]; then
  timeout 120 python3 scripts/bench_cpu_experts.py --layers 24 2>&1 | tail -30 | tee "$OUT/bench_cpu.txt"
fi
if [[ $STEP == tests ]]; then
  timeout 300 python3 -m pytest -q -x tests/test_gpu_experts.py tests/test_cpu_experts.py tests/test_hybrid.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
  timeout 150 python3 scripts/bench_gpu_experts.py 2>&1 | tail -40 | tee "$OUT/bench_gpu.txt"
fi
