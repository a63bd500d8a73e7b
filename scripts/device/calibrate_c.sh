#!/usr/bin/env bash
# GPU machine, one call: issue [C]. Plan under the cap (capacity test, then the longest
# request run under it), a second plan with a smaller pool under the same cap, calibrate
# the cost model inside the engine, then the check: predicted against measured decode
# step of both plans (target: within 5%). A table, then one JSON line, last.
#   bash scripts/device/calibrate_c.sh [all|plan|calibrate|check]
# Reads $PROFILES/profile-dev.json and profile-held-out.json (default $OUT: issue [A]'s
# `skew --save-profiles $OUT/profile`); makes them (4 sessions a side) when missing.
# Work files in $WORK (kept while the machine stays warm); copies come back under $OUT.
# Knobs (environment): MODEL CAP THREADS SMALL_FRACTION SESSIONS STEPS BUDGET_S PLAN_ARGS CAL_ARGS CHECK_ARGS.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OSTINATO_CACHE=${OSTINATO_CACHE:-/tmp/ocache}
OUT=${OUT:-/tmp/out}; WORK=${WORK:-/tmp/ostinato-c}; mkdir -p "$OUT" "$WORK"
O="python3 -m ostinato.cli"
M=${MODEL:-synth:qwen3-30b-a3b}; CAP=${CAP:-32GiB}; THREADS=${THREADS:-16}
PROF=${PROFILES:-$OUT}; STEPS=${STEPS:-192}; STEP=${1:-all}
if [[ -z ${SESSIONS:-} ]]; then
  if [[ -d .carry/workloads ]]; then SESSIONS=.carry/workloads; else SESSIONS=embedded; fi
fi
LOG=$OUT/c_log.txt
DEADLINE=$((SECONDS + ${BUDGET_S:-575}))  # the whole call: stop starting steps after this
left() { local l=$((DEADLINE - SECONDS - 10)); (( l > $1 )) && l=$1; (( l < 1 )) && l=1; echo $l; }
say() { echo "== [$SECONDS s] $*" | tee -a "$LOG"; }
run() { local limit; limit=$(left "$1"); shift; timeout "$limit" "$@" 2>&1 | grep --line-buffered -v "it/s\]\|session/s\]" \
  | tee -a "$LOG"; local rc=${PIPESTATUS[0]}; (( rc == 124 )) && say "timed out after ${limit} s: $*"; return $rc; }

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  lscpu | grep -E "Model name"; python3 -c "import torch;print('torch', torch.__version__)"
  echo "commit $(git rev-parse HEAD) dirty files $(git status --short | wc -l)"
  echo "model $M cap $CAP threads $THREADS sessions $SESSIONS"; } 2>&1 | tee -a "$LOG"

if [[ ! -f $PROF/profile-dev.json || ! -f $PROF/profile-held-out.json ]]; then
  say "profiles missing under $PROF: profiling 4 sessions a side (issue [A] makes the real ones)"
  $O plan --model $M --hot-fraction 1.0 --no-verify -o "$WORK/all.json" > /dev/null
  run 240 $O skew --model $M --residency "$WORK/all.json" --sessions "$SESSIONS" --max-sessions 4 --fraction 0.4 \
    --save-profiles "$PROF/profile"
fi
# profiles made before max_tokens was recorded: plan for the engine's default context
KV=$(python3 -c "import json,sys;print('' if json.load(open(sys.argv[1])).get('max_tokens') else '--max-context 16384')" \
  "$PROF/profile-dev.json" 2>/dev/null)
PLAN="$O plan --model $M --profile $PROF/profile-dev.json --held-out $PROF/profile-held-out.json --gpu-memory $CAP $KV \
  ${PLAN_ARGS:-}"

if [[ $STEP == all || $STEP == plan ]]; then
  say "plan: capacity test under $CAP, verified"
  run 200 $PLAN --cpu-threads $THREADS -o "$WORK/res-cap.json"
  # the second pool: SMALL_FRACTION, default half the capacity plan's share of experts
  SMALL=${SMALL_FRACTION:-$(python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print(round(d['hot_experts'] \
    / (len(d['hot']) * d['num_experts']) / 2, 4))" "$WORK/res-cap.json" 2>/dev/null || echo 0.2)}
  say "plan: hot fraction $SMALL under the same cap"
  run 90 $PLAN --hot-fraction $SMALL --no-verify -o "$WORK/res-small.json"
fi
if [[ $STEP == all || $STEP == calibrate ]]; then
  say "calibrate in the engine"
  run 220 $O calibrate --model $M --residency "$WORK/res-cap.json" --gpu-memory $CAP --cpu-threads $THREADS \
    --sessions "$SESSIONS" ${CAL_ARGS:-}
fi
if [[ $STEP == all || $STEP == check ]]; then
  for name in cap small; do
    say "measure decode steps: $name"
    run 150 python3 scripts/predict_vs_measured.py --model $M --residency "$WORK/res-$name.json" \
      --calibration "$WORK/res-cap.json" --profile "$PROF/profile-held-out.json" --gpu-memory $CAP \
      --cpu-threads $THREADS --sessions "$SESSIONS" --split held-out --max-sessions 4 --max-steps $STEPS \
      --name "$name" --json-out "$WORK/pvm-$name.json" ${CHECK_ARGS:-}
  done
fi
cp "$WORK/res-cap.json" "$OUT/c_residency_cap.json" 2>/dev/null
cp "$WORK/res-small.json" "$OUT/c_residency_small.json" 2>/dev/null
say "predicted vs measured"
python3 scripts/predict_vs_measured.py --compare "$WORK/pvm-cap.json" "$WORK/pvm-small.json" \
  --calibration "$WORK/res-cap.json" 2>&1 | tee "$OUT/c_result.txt"
