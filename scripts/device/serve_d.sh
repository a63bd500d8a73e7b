#!/usr/bin/env bash
# GPU machine, issue [D]: a 20-turn tau2 session replayed through `ostinato serve` with the
# full-size model; TTFT per turn against new prompt tokens shows that only new tokens are
# prefilled. Needs `.carry/wheels` (scripts/device/wheels.sh) and `.carry/agent` (sessions), and a
# residency for this model (run.sh plans: /tmp/res/r40.json; RESIDENCY= empty: all experts on the GPU).
set -uo pipefail
python3 -c "import fastapi, uvicorn" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OSTINATO_WORKLOADS=$PWD/.carry/agent OSTINATO_CACHE=/tmp/ocache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${MODEL:-synth:qwen3-30b-a3b}
RES=${RESIDENCY-/tmp/res/r40.json}  # from run.sh plans
python3 - <<'PY'
from ostinato.sessions.read import load_sessions, split_sessions, write_jsonl
_, held = split_sessions(load_sessions(".carry/agent/tau2"))
s = next(s for s in held if len(s.turns) >= 20)
write_jsonl([s], "/tmp/s20.jsonl")
print("session", s.id, len(s.turns), "turns")
PY
python3 -m ostinato.cli serve --model $M ${RES:+--residency $RES --gpu-memory 32GiB} --max-context 16384 --port 8080 \
  > "$OUT/d_server.log" 2>&1 &
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8080/health >/dev/null && break; sleep 2; done
curl -s http://127.0.0.1:8080/health; echo
timeout 400 python3 -m ostinato.cli replay --endpoint http://127.0.0.1:8080 --sessions /tmp/s20.jsonl --split all \
  --max-turns 20 2>&1 | tee "$OUT/d_replay.txt" | tail -30
curl -s http://127.0.0.1:8080/metrics > "$OUT/d_metrics.txt"
kill %1
