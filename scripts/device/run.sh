#!/usr/bin/env bash
# GPU machine: the measurements of issues [A]-[C], [E]-[G] as phases, run in the order given,
# each stopped at the call's deadline (a phase that cannot start in time is skipped and said).
#   OSTINATO_COMMIT=<hash> OSTINATO_DIRTY=0 bash scripts/device/run.sh PHASE...
# (the copied tree has no .git: the commit comes from whoever sends it). Phases:
#   env        machine facts (GPUs, CPU, NUMA, memory, versions)
#   native     the native CPU expert kernel builds and runs here (else the call stops)
#   tests      GPU-marked tests: decode graphs bitwise equal to the synchronous path, the two-GPU split
#   tests_prefetch GPU-marked tests of captured passes: staging, and the next layer's experts prefetched (session 53)
#   tests_store    GPU-marked tests of every policy over a bench's kept store of host copies (session 51) and of a pass of
#                  several chunks staging each wave once (session 52: tests/test_layer_major.py)
#   tests_kernels  GPU-marked tests: kernel oracles, hybrid paths (bf16 and quantized), every policy on CUDA, triton's
#              compiles (none after the warm-up), the cap
#   skew       [A] the skew figure of $MODEL on the development / held-out split; saves the profiles (SKEW_LIMIT s, 200;
#              SKEW_HOT=0.0 profiles with every expert on the host, for models whose experts do not fit the GPU)
#   generate   [A] 64 tokens with every expert in the GPU pool (decode graph)
#   micro      [B] GPU branch kernels (scripts/bench_gpu_experts.py)
#   micro_cpu  [B] CPU branch kernel against host read bandwidth (scripts/bench_cpu_experts.py)
#   micro_attn [F] decode attention over a device-side length: Triton split-K against SDPA
#   micro_handshake [Q] the handshake's join of the CPU worker's partial (wait, copy, add) per pass size, and its copy alone
#   micro_synth [O] where a synthetic gpt-oss-120b's load goes, step by step over one layer (scripts/bench_synth_load.py)
#   micro_zero_copy [Q] a kernel's own reads of page-locked host memory over PCIe against a memcpy (scripts/bench_zero_copy.py)
#   micro_quant_ab [L] the quantized GPU kernels of this tree against AB_COMMIT's (.carry/ab.tgz), alternating, T = 256
#   micro_stage_copy [L] the staging copies' pace by programs, alone and beside GPU work on another stream (scripts/bench_stage_copy.py)
#   plans      residencies from the profiles: all, cold, 40% hot, and 40% over two GPUs
#   check      [B][F] whole model: all-GPU reference, 40% hot under $CAP (+ decode ablation), all CPU
#   calib      [C] plan under $CAP (capacity test), a half-size pool, calibrate in the engine
#   recalib    [C] calibrate only, on the plan phase calib left
#   predict    [C][F] predicted against measured decode step of both pools, and the bound
#   bench      [E] `ostinato bench` on the held-out sessions (sizes: BENCH_ARGS)
#   split      [B][E] where a split pass's time goes (scripts/split_interference.py)
#   llama      [E] llama.cpp (llama-server, GGUF bf16) against Ostinato on the 16-layer model, same turns
#   multi      [G] the 40% plan split over $DEVICES (cuda:0,cuda:1) under $CAP_PER_GPU each, checked
#   multi_replay [G] a plan under $CAP_PER_GPU per GPU, replayed on the held-out sessions (REPLAY_ARGS)
#   threads    [H] decode steps and replayed TPOT under several thread layouts (scripts/thread_sweep.py)
#   gguf       [K] the GGUF file of $M's preset, $LQUANT (default Q4_K_M), written by `ostinato synth` (or $LGGUF)
#              in the background: the phases after it that need the file wait for it; another model's file
#              is removed first (the 30B and 235B files do not fit the disk together)
#   greedy     [K] greedy tokens of Ostinato and llama.cpp on that file (scripts/greedy_vs_llama.py)
#   plan_gguf  [K] `ostinato plan` on that file under $QCAP (profiles of phase skew or .carry/res), verified by
#              running its largest pass under the cap
#   bench_gguf [K] `ostinato bench` on that file under $QCAP (default 12GiB; QBENCH_ARGS: policies, sizes, --merge)
#   ab_gguf    a change measured before and after on one machine: Ostinato's replay on that file from this tree (A),
#              from another commit's `git archive` (B: AB_TGZ, default .carry/ab.tgz, of commit AB_COMMIT), or
#              from this tree with AB_ENV's settings and AB_ARGS' bench flags (B: e.g. AB_ENV="OSTINATO_AMX_QUANT=4",
#              AB_ARGS="--margin 0.5GiB"), and from this tree
#              again, in turn, on one calibration (AB_CAL, default bench_gguf's), into $R/ab/{a1,b,a2}; more runs
#              of this tree by AB_RUNS (e.g. "a1 b c a2", run c with AB_ENV_C's settings)
#   llama_tune [L] llama.cpp tuned on development sessions under $QCAP (else $CAP) on that file, then the
#              held-out replay (scripts/llama_tune.py; the kit from .carry/llama-kit: ../shared/llama's kit)
#   ik_tune    [L] ik_llama.cpp as llama_tune tunes and replays llama.cpp (--flavor ik_llama.cpp; $R/ik_tune,
#              IK_TUNE_ARGS), from the kit scripts/device/ik_llama/build-on-gpu.sh packs (carry .ik-kit/ik-kit.tar.xz)
#   profile    [Q] one decode step kernel by kernel, every expert resident and under the capacity plan
#              (scripts/profile_decode.py), against the HBM bound
#   profile_prefill [K][Q] prefill passes (PREFILL_SIZES, default 16 64 256 1024 2048 tokens after a 4096-token context) on
#              the GGUF file under $QCAP on bench_gguf's plan ($QBENCH_OUT, after it), kernel by kernel with the uploads apart,
#              and where the wall time went: host inside and outside the MoE backend, its waits, each stream's busy time
#              (scripts/profile_decode.py --prefill)
#   llama_bench [Q] llama-bench -ngl 99 (decode at depth 0 and 2048) on the Q4_K_M file and on a bf16 GGUF of
#              LB_LAYERS (24) layers, and Ostinato's decode step on that bf16 file
#   tests_wave2 [M][O][K][Q] GPU-marked tests: the fused RMSNorm, q/k norm + rotary and router kernels, the route tally in the decode graph, gpt-oss and DeepSeek-V3 on CUDA,
#              prefill attention in SDPA's fused kernels alone (and whether they take MLA's head dims),
#              the cap as nvidia-smi counts it, every expert resident in the pool, the quant tuner
#   tests_quant [K] the quantized kernels' tests (GPU and CPU; gguf from .carry/wheels)
#   micro_dense [K][L] attention and head kept in GGUF blocks: the matvec tuned, against bf16 (scripts/bench_quant_linear.py)
#   amx_quant  [K][L] quantized experts on the AMX tiles (rows decoded to bf16, ColdArgs::amx_quant_min_tokens): the
#              CPU kernels' oracle tests, then prefill against the row kernels at the 30B and 235B shapes
#              (scripts/bench_cpu_quant.py --amx-quant)
#   amx_int8   [L] quantized experts on the AMX int8 tiles (ColdArgs::amx_int8_min_tokens): their tests, and
#              scripts/bench_cpu_quant.py --amx-int8 (AMX8_MIN) at the 30B shape, by prefill size (AMX8_PREFILL)
#   cpu_threads [H][K] one decode token's cold experts (bench_cpu_quant.py) at pool sizes CPU_THREADS (1 4 8 14)
#   micro_quant [K] their benchmarks (scripts/bench_gpu_quant.py, scripts/bench_cpu_quant.py; QTUNE=1 tunes the GPU
#              kernels first and sets dequant_min_tokens by measurement, QGPU=0 or QCPU=0 leaves one side out,
#              QPF=1,4,8 sweeps the CPU kernels' prefetch distance)
#   serve_cached [M] a plan served from its file (SERVE_PLAN, default serve_plan's) and replayed, then in-process
#   serve_plan [M][N] `serve --gpu-memory $CAP` from an empty plan cache to ready (each phase timed, /health
#              polled) and the held-out replay through chat completions; a second start from the cache and the
#              same turns through /v1/messages; the same turns in-process on its plan (SERVE_REPLAY_ARGS)
#   ablation   [I] every step of the ablation table and expert-cache on $MODEL under $CAP, one bench folder ($R/ablation)
#              filled over several calls (each runs the policies it lacks, --merge; ABLATION_POLICIES, ABLATION_ARGS)
#   sweep      [I] the length sweep (prefill 128-2048 new tokens after development prefixes) of Ostinato and
#              expert-cache in one bench run, its own plan and calibration ($R/sweep; SWEEP_ARGS)
#   regimes    [J] ostinato, fixed-per-layer and both caches under each routing regime of $M (REGIMES: flat layered
#              layered-persistent; sizes REGIMES_ARGS), one bench run each in $R/regimes/REGIME, then `report --regimes`
#              over every regime measured in full; about one regime a call (REGIMES=layered), a cut run is completed
#              by the next call (--merge), a complete one kept (remove its folder to measure it again)
# Results gather in $R (default /tmp/res; kept while the machine stays warm, else restored from
# .carry/res); the call ends by packing $R into $OUT/res.tgz beside $OUT/log.txt.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OSTINATO_CACHE=${OSTINATO_CACHE:-/tmp/ocache}
# the recorded workloads travel compressed (beside the llama.cpp kit, plain JSON would not fit in 64 MiB):
# `tar cJf .carry/workloads.tar.xz -C ../shared workloads` here
[[ -f .carry/workloads.tar.xz && ! -d .carry/workloads ]] && tar xJf .carry/workloads.tar.xz -C .carry
# the synthetic tokenizer is trained on the recorded workloads, as beside a checkout here
[[ -d .carry/workloads ]] && export OSTINATO_WORKLOADS=${OSTINATO_WORKLOADS:-$PWD/.carry/workloads}
# the replayed sessions: tau2 and SWE-agent, made here from the carried workloads
if [[ -d .carry/workloads && ! -d .carry/agent ]]; then
  mkdir -p .carry/agent && cp -r .carry/workloads/tau2 .carry/workloads/swe-agent .carry/agent/
fi
OUT=${OUT:-/tmp/out}; R=${R:-/tmp/res}; mkdir -p "$OUT" "$R"
# dependencies of the package and its tests that the GPU machine's image lacks (gguf, the server's fastapi,
# uvicorn and pydantic, the openai and anthropic clients) travel as wheels in .carry/wheels (cp312 manylinux,
# fetched here by scripts/device/wheels.sh), installed into /tmp/site ahead of the image's packages
[[ -d /tmp/site ]] && export PYTHONPATH=$PWD:/tmp/site  # installed by an earlier call to this machine
if ! python3 -c "import gguf, fastapi, uvicorn, pydantic, openai, anthropic" 2>/dev/null; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .carry/wheels/*.whl \
      >> "$OUT/pip.txt" 2>&1; then export PYTHONPATH=$PWD:/tmp/site
  else echo "note: the carried wheels did not install ($OUT/pip.txt): the CLI or the server may not start" >&2; fi
fi
# the package imports gguf at every entry point: without it every phase fails, so stop at once (session 50's first
# call lost its budget so: the run tool's carry argument had not named .carry)
if ! python3 -c "import gguf" 2>/dev/null; then
  echo "error: gguf is not importable: carry .carry (with .carry/wheels, scripts/device/wheels.sh) to this machine" >&2
  exit 2
fi
if [[ -d .carry/res && ! -f $R/.restored ]]; then cp -rn .carry/res/. "$R"/; touch "$R/.restored"; fi
# KEEP_TUNED=1: the kernel tunings an earlier call's phase wrote into $R (micro_quant with QTUNE=1, micro_dense) replace
# the tree's, so that a later call on the same warm machine runs with them (the tree is copied afresh each call)
if [[ ${KEEP_TUNED:-0} == 1 ]] && ls "$R"/moe_quant_*.json >/dev/null 2>&1; then cp "$R"/moe_quant_*.json ostinato/kernels/tuned/; fi
O="python3 -m ostinato.cli"
M=${MODEL:-synth:qwen3-30b-a3b}; CAP=${CAP:-32GiB}; CAP_PER_GPU=${CAP_PER_GPU:-16GiB}; DEVICES=${DEVICES:-cuda:0,cuda:1}
THREADS=${THREADS:-}  # CPU expert workers; empty: the engine's thread layout (ostinato/threads.py) chooses
S=${SESSIONS:-.carry/agent}; NS=${SKEW_SESSIONS:-8}; STEPS=${STEPS:-128}
LOG=$OUT/log.txt
DEADLINE=$((SECONDS + ${BUDGET_S:-565}))
say() { echo "== [$SECONDS s] $*" | tee -a "$LOG"; }
# field FILE EXPR: a Python expression over the JSON document d of FILE, printed ('' if missing or false)
field() { python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print($2 or '')" "$1" 2>/dev/null; }
# --attention-scores of the capacity plan (phase calib writes its share; without it, the model's default)
att() { [[ -f $R/attention_scores.txt ]] && echo "--attention-scores $(cat "$R/attention_scores.txt")"; }
# fresh FILE: written on this machine since its results were restored from .carry/res (a calibration restored
# from an earlier session measured older code: the fused dense kernels halved the step it models)
fresh() { [[ -f $1 && ( ! -f $R/.restored || $1 -nt $R/.restored ) ]]; }
# lacking DIR "POLICIES": the policies a bench folder still lacks ('-': none; '': no readable results.json, so all)
lacking() {
  [[ -f $1/results.json ]] || return 0
  field "$1/results.json" "' '.join(p for p in '$2'.split() if 'summary' not in d['policies'].get(p, {})) or '-'"
}
# kernel tunings measured on this machine since the restore (phase micro_dense, QTUNE=1) replace the checkout's:
# a later call's tree is a fresh copy of the working tree
for f in "$R"/moe_*.json; do
  fresh "$f" && cp "$f" ostinato/kernels/tuned/ && echo "== tuned kernels: $f (measured by an earlier call)" >> "$OUT/log.txt"
done
# usable_calibration FILE ARGS: FILE if a bench may replay with its calibration: measured on this machine since
# the restore, or restored from .carry/res where ARGS add to an earlier run (--merge on a machine other than the
# first run's needs that run's calibration, or the plan would differ: in session 16 a fresh calibration dropped
# the upload path and --merge refused the run after 180 s); else nothing
usable_calibration() {
  if [[ $2 == *--merge* ]] && ! fresh "$1" && [[ -f $1 ]]; then say "bench: --merge takes $1 (restored)" >&2
  elif ! fresh "$1"; then return; fi
  echo "$1"
}
# calibration_arg FILE: --calibration FILE where FILE holds the cost model's constants and Np
calibration_arg() {
  [[ -n $1 && -n $(field "$1" "d['calibration'].get('layers') and d['calibration'].get('upload_threshold')") ]] \
    && echo "--calibration $1"
}
# run LIMIT FILE CMD...: at most LIMIT seconds (less if the deadline is nearer), output to FILE and the log
run() {
  local limit=$1 file=$2; shift 2
  local l=$((DEADLINE - SECONDS - 5)); (( l > limit )) && l=$limit
  if (( l < 20 )); then say "skipped (no time left): $*"; return 124; fi
  say "$* (limit ${l} s)"
  timeout "$l" "$@" 2>&1 | grep --line-buffered -v "it/s\]\|s/it\]\|session/s\]\|turn/s\]" | tee -a "$file" "$LOG"
  local rc=${PIPESTATUS[0]}
  (( rc == 124 )) && say "timed out after ${l} s"
  (( rc != 0 && rc != 124 )) && say "exit $rc"
  return $rc
}
check() {  # check NAME RESIDENCY [ARGS...]: scripts/check_hybrid.py against the all-GPU reference
  local name=$1 res=$2; shift 2
  run 150 "$R/check_$name.log" python3 scripts/check_hybrid.py --model "$M" --name "$name" --residency "$res" \
    --ref "$R/ref.pt" --steps "$STEPS" ${THREADS:+--cpu-threads $THREADS} "$@"
  grep '^{' "$R/check_$name.log" >> "$R/check.jsonl"
}

phase_env() {
  { date -u; echo "commit ${OSTINATO_COMMIT:-unknown} dirty ${OSTINATO_DIRTY:-unknown}"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
    nvidia-smi topo -m 2>/dev/null | head -5; nproc; lscpu | grep -E "Model name|Socket|NUMA|Thread|Core"
    free -g | head -2; echo "transparent huge pages: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>&1)"
    python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'triton',triton.__version__,
'transformers',transformers.__version__)"; } > "$R/env.txt" 2>&1
  cat "$R/env.txt" >> "$LOG"
}
phase_native() {  # the native CPU expert kernel must build and run here, or the hybrid numbers mean nothing
  { grep -o -w 'avx512f\|avx512bw\|avx512vl\|avx512_bf16\|amx_bf16\|amx_tile' /proc/cpuinfo | sort | uniq -c
    python3 -c "from ostinato.layers.moe.cpu_experts import _native_unavailable as u; r = u('auto'); \
print('native CPU experts:', r or 'available'); raise SystemExit(1 if r else 0)"; } 2>&1 | tee -a "$R/env.txt" "$LOG"
  (( PIPESTATUS[0] == 0 )) || { say "no native CPU experts: stopping"; DEADLINE=$SECONDS; }
}
# the GPU-marked tests (test_server needs the openai client, which the GPU image lacks)
phase_tests() {  # decode graphs bitwise equal to the synchronous path; the embedding in host memory; two GPUs
  run 200 "$R/tests.txt" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests/test_graph.py \
    tests/test_model.py tests/test_multi_device.py
}
phase_tests_passes() {  # short prefill passes as graphs: the multi-token attention (gpt-oss's sinks, MLA's
  # latent too), the worker's rows (native), the captured passes against the host-driven ones (Qwen3, gpt-oss
  # and DeepSeek-V3), borrowed memory in the decode graph over two expert pools
  run 150 "$R/tests_passes.txt" python3 -m pytest -q -p no:cacheprovider --durations=8 tests/test_graph_worker.py \
    tests/test_handshake.py tests/test_staging.py
  run 300 "$R/tests_passes.txt" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests/test_graph.py \
    tests/test_decode_attention.py tests/test_gpt_oss.py tests/test_deepseek_v3.py tests/test_borrow.py
}
phase_tests_kernels() {  # kernel oracles, the hybrid paths and every policy on CUDA
  run 200 "$R/tests_kernels.txt" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 \
    tests/test_gpu_experts.py tests/test_hybrid.py tests/test_policies.py tests/test_decode_attention.py \
    tests/test_triton_compiles.py tests/test_gpu_memory.py tests/test_quant_engine.py
}
phase_tests_store() {  # sessions 51-52's changes on CUDA before a bench relies on them: every policy over a kept
  # store of host copies (views of page-locked memory, their pools filled from it), the calibration's staged branch,
  # a pass of several chunks staging each wave once for all of them (copies after every chunk's GEMMs)
  run 150 "$R/tests_store.txt" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests/test_policies.py \
    tests/test_hybrid.py -k "kept_store or whole_model or all_staged"
  run 120 "$R/tests_chunks.txt" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests/test_layer_major.py
}
phase_tests_prefetch() {  # session 53's prefetch of the next layer's experts in captured passes, with the other
  # captured-pass tests it must leave as they were (staging by either rule, from a pass size, none)
  run 150 "$R/tests_prefetch.txt" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests/test_graph.py \
    -k "pass_graphs"
}
# [K] the quantized-expert kernels: the Triton ones compiled on CUDA (their interpreted runs are CI's), the
# native CPU ones on this machine's AVX-512/AMX, the GGUF loader
phase_tests_quant() {  # the native CPU kernels first (this CPU's AVX-512/AMX paths), then the Triton ones
  # (KTESTS=gpu: the Triton ones alone, e.g. beside phase gguf's writer, which the CPU ones would slow)
  [[ ${KTESTS:-all} == gpu ]] || run 200 "$R/k_tests.txt" python3 -m pytest -q -p no:cacheprovider --durations=8 \
    tests/test_cpu_quant.py tests/test_gguf.py
  run 150 "$R/k_tests.txt" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests/test_moe_quant_triton.py \
    tests/test_quant_linear.py
}
phase_micro_dense() {  # [K][L] attention and head kept in blocks: the matvec tuned (written into the tuned file, copied
  # to $R), against bf16 GEMM and dequantize + GEMM by tokens (scripts/bench_quant_linear.py); not beside phase
  # gguf's writer
  if kill -0 "$(cat /tmp/gguf.pid 2>/dev/null)" 2>/dev/null; then gguf_wait; fi
  run 300 "$R/k_dense.txt" python3 scripts/bench_quant_linear.py --tune
  cp ostinato/kernels/tuned/moe_quant_*.json "$R"/ 2>/dev/null
}
phase_micro_quant() {  # [K] the quantized kernels' bandwidths (after phase gguf's writer: it would share the machine)
  gguf_wait
  if [[ ${QTUNE:-0} == 1 ]]; then  # QTUNE=1: tune first (writes kernels/tuned/moe_quant_<device>.json, kept in $R)
    run 300 "$R/k_tune_gpu.txt" python3 scripts/bench_gpu_quant.py --tune --dequant-prefill
    cp ostinato/kernels/tuned/moe_quant_*.json "$R"/ 2>/dev/null
  elif [[ ${QGPU:-1} == 1 ]]; then run 150 "$R/k_bench_gpu.txt" python3 scripts/bench_gpu_quant.py --dequant-prefill; fi
  local hp=""; [[ ${QHUGE:-0} == 1 ]] && hp=--huge-pages  # QHUGE=1: experts and probe on transparent huge pages
  if [[ -n ${QPF:-} ]]; then  # QPF=4,8,16,32: the CPU kernels' prefetch distance swept (KiB) instead
    run 240 "$R/k_bench_cpu_pf${hp:+_huge}.txt" python3 scripts/bench_cpu_quant.py --formats Q4_K,Q6_K,Q4_K/Q6_K \
      --prefill "" --rounds 3 --prefetch-kib "$QPF" $hp
  elif [[ ${QCPU:-1} == 1 ]]; then run 120 "$R/k_bench_cpu${hp:+_huge}.txt" python3 scripts/bench_cpu_quant.py $hp; fi
}
phase_micro_quant_ab() {  # [L] the quantized GPU kernels of this tree against AB_COMMIT's (.carry/ab.tgz), on one
  # machine (QAB_RUNS, default "old new"): this tree's bench_gpu_quant.py on either tree's kernels, at T = 256
  local tgz=${AB_TGZ:-.carry/ab.tgz} b=/tmp/ab_tree v args="--qtypes Q4_K Q6_K --no-bf16 --prefill-tokens 256"
  [[ -f $tgz && -n ${AB_COMMIT:-} ]] || { say "micro_quant_ab: needs AB_COMMIT and $tgz"; return 1; }
  rm -rf "$b" && mkdir -p "$b" && tar xzf "$tgz" -C "$b" && cp scripts/bench_gpu_quant.py "$b/scripts/"
  for v in ${QAB_RUNS:-old new}; do
    say "micro_quant_ab: the kernels of $([[ $v == old ]] && echo "$AB_COMMIT" || echo "this tree")" | tee -a "$R/k_quant_ab.txt"
    if [[ $v == old ]]; then (cd "$b" && export OSTINATO_COMMIT=$AB_COMMIT && run 150 "$R/k_quant_ab.txt" \
      python3 scripts/bench_gpu_quant.py $args)
    else run 150 "$R/k_quant_ab.txt" python3 scripts/bench_gpu_quant.py $args; fi
  done
}
phase_cpu_threads() {  # [H][K] one decode token's cold experts by pool size: does spreading an expert over more
  # workers cost bandwidth? (CPU_THREADS, default 1 4 8 14; CPU_SHAPE: bench_cpu_quant.py's shape flags, gpt-oss-120b's)
  local t
  for t in ${CPU_THREADS:-1 4 8 14}; do
    run 60 "$R/cpu_threads.txt" python3 scripts/bench_cpu_quant.py --threads "$t" --prefill "" --rounds 3 \
      ${CPU_SHAPE:---formats MXFP4 --experts 128 --hidden 2880 --ffn 2880 --topk 4}
  done
}
phase_amx_quant() {  # the break-even of ColdArgs::amx_quant_min_tokens, by routes an expert (T * 8 / 128)
  run 240 "$R/amx_quant_tests.txt" python3 -m pytest -q -p no:cacheprovider tests/test_cpu_quant.py
  run 150 "$R/amx_quant_30b.txt" python3 scripts/bench_cpu_quant.py --formats Q4_K/Q6_K,Q4_K --rounds 1 --iters 10 \
    --prefill 16,64,128,256,512,1024 --amx-quant 1,4
  run 200 "$R/amx_quant_235b.txt" python3 scripts/bench_cpu_quant.py --formats Q4_K/Q6_K --hidden 4096 --ffn 1536 \
    --rounds 1 --iters 10 --prefill 16,64,256,512 --amx-quant 1,4
}
phase_amx_int8() {  # the quantized experts on the AMX int8 tiles (ColdArgs::amx_int8_min_tokens): their tests, and
  # the prefill of one layer against the row kernels by routes an expert (T * 8 / 128), 15 workers
  run 120 "$R/amx_int8_tests.txt" python3 -m pytest -q -p no:cacheprovider tests/test_cpu_quant.py -k "amx_int8 or exact"
  # AMX8_SHAPE: bench_cpu_quant.py's format and shape flags (default Qwen3-30B-A3B's; AMX8_NAME names the file)
  run 150 "$R/amx_int8_${AMX8_NAME:-30b}.txt" python3 scripts/bench_cpu_quant.py \
    ${AMX8_SHAPE:---formats Q4_K/Q6_K,Q4_K} --rounds 1 --iters 10 \
    --prefill ${AMX8_PREFILL:-32,64,128,256,512} --amx-int8 ${AMX8_MIN:-4,6,8,12}
}
phase_tests_wave2() {  # [M][O][K][Q] the GPU-marked tests of the served-route tally, the new model families, the
  # cap as nvidia-smi counts it, every expert resident through the pool executor, the fused dense kernels
  run 300 "$R/tests_wave2.txt" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 \
    tests/test_dense_triton.py \
    tests/test_serve_plan.py tests/test_gpt_oss.py tests/test_deepseek_v3.py tests/test_expert_act_triton.py \
    tests/test_conversations.py tests/test_gpu_memory.py tests/test_quant_tuning.py tests/test_fused_attention.py \
    "tests/test_gguf.py::test_every_expert_resident_on_the_gpu_keeps_the_blocks"
  # the fused-attention probe's answer at each big shape's real head dims (the capacity test asks it), kept in the log
  python3 -c "
import torch
from ostinato.config import ModelConfig
from ostinato.models.common import fused_attention_available
from ostinato.models.registry import attention_shape
from ostinato.synth.presets import preset_config
for p in ('qwen3-30b-a3b', 'qwen3-235b-a22b', 'gpt-oss-120b', 'deepseek-v3-shaped'):
    s = attention_shape(ModelConfig.from_dict(preset_config(p)))
    print(f'fused attention, {p}: q/k {s.qk_dim}, v {s.v_dim}:', fused_attention_available(s.qk_dim, s.v_dim,
          torch.bfloat16, 'cuda'))" 2>&1 | tee -a "$R/tests_wave2.txt" "$LOG"
}
phase_skew() {
  local res=$R/all.json
  [[ ${SKEW_HOT:-1.0} == 1.0 ]] || res=$R/skew_hot.json
  $O plan --model "$M" --hot-fraction "${SKEW_HOT:-1.0}" --no-verify -o "$res" >> "$LOG" 2>&1
  run ${SKEW_LIMIT:-200} "$R/a_skew.txt" $O skew --model "$M" --residency "$res" --sessions "$S" --max-sessions "$NS" \
    --fraction 0.40 0.44 --save-profiles "$R/profile"
}
phase_generate() {
  run 120 "$R/a_generate.json" $O generate --model "$M" --residency "$R/all.json" --max-tokens 64 --json \
    --prompt "Check the order status for order #W2378156 and tell me the delivery date."
}
phase_micro() { run 150 "$R/b_bench_gpu.txt" python3 scripts/bench_gpu_experts.py; }
phase_micro_attn() {  # Qwen3-30B-A3B's heads, then DeepSeek-V3's latent attention, then Qwen3's passes
  run 90 "$R/f_bench_attention.txt" python3 scripts/bench_decode_attention.py
  run 90 "$R/f_bench_attention_mla.txt" python3 scripts/bench_decode_attention.py --shape deepseek-v3
  local t; for t in 64 255; do  # a captured prefill pass's attention against the host-driven pass's
    run 90 "$R/f_bench_attention_pass$t.txt" python3 scripts/bench_decode_attention.py --tokens $t --contexts 1024 4096
  done
}
phase_micro_handshake() {  # [Q] the join of the CPU worker's partial per pass size (scripts/bench_handshake.py)
  run 60 "$R/q_bench_handshake.txt" python3 scripts/bench_handshake.py
}
phase_micro_synth() {  # [O] the steps of a synthetic MXFP4 expert's load, and one layer through the loader
  run 120 "$R/o_bench_synth_load.txt" python3 scripts/bench_synth_load.py --json "$R/o_bench_synth_load.json"
}
phase_micro_zero_copy() {  # [Q] can a captured pass's kernels read cold experts in host memory? (scripts/bench_zero_copy.py)
  run 120 "$R/q_bench_zero_copy.txt" python3 scripts/bench_zero_copy.py
}
phase_micro_stage_copy() {  # [L] the staging and prefetch copies by programs: their pace, and what they cost the layer's
  # work beside them (the quantized prefill kernels, and bf16 GEMMs as session 57 timed)
  run 180 "$R/l_bench_stage_copy.txt" python3 scripts/bench_stage_copy.py
}
phase_micro_cpu() {
  run 120 "$R/b_bench_cpu.txt" python3 scripts/bench_cpu_experts.py --layers 24 ${THREADS:+--threads $THREADS}
}
phase_plans() {
  local P="--profile $R/profile-dev.json --held-out $R/profile-held-out.json"
  $O plan --model "$M" --hot-fraction 0.0 --no-verify -o "$R/cold.json" >> "$LOG" 2>&1
  run 60 "$R/b_plan.txt" $O plan --model "$M" $P --hot-fraction 0.4 --no-verify -o "$R/r40.json"
  run 60 "$R/g_plan.txt" $O plan --model "$M" $P --hot-fraction 0.4 --devices "$DEVICES" --no-verify \
    -o "$R/r40x2.json"
}
phase_check() {
  rm -f "$R/check.jsonl"
  check all "$R/all.json"
  local cal=""  # the split-path prompt again with uploads, by the calibrated costs (phase calib)
  [[ -f $R/res-cap.json ]] && cal="--calibration $R/res-cap.json"
  check hybrid40 "$R/r40.json" --gpu-memory "$CAP" --ablation $cal
  check cpu "$R/cold.json" --gpu-memory "$CAP"
}
phase_calib() {
  local P="--profile $R/profile-dev.json --held-out $R/profile-held-out.json"
  # the model's default (SDPA's fused prefill attention where it takes the model: no score matrix): the
  # verification run under the cap checks that claim; if it fails, plan again with torch's math kernel counted
  rm -f "$R/attention_scores.txt"
  run 200 "$R/c_plan.txt" $O plan --model "$M" $P --gpu-memory "$CAP" \
    ${THREADS:+--cpu-threads $THREADS} -o "$R/res-cap.json" || { echo 1 > "$R/attention_scores.txt"
    run 200 "$R/c_plan.txt" $O plan --model "$M" $P --gpu-memory "$CAP" --attention-scores 1 \
      ${THREADS:+--cpu-threads $THREADS} -o "$R/res-cap.json"; }
  local small
  small=$(field "$R/res-cap.json" "round(d['hot_experts'] / (len(d['hot']) * d['num_experts']) / 2, 4)")
  run 60 "$R/c_plan_small.txt" $O plan --model "$M" $P --hot-fraction "${small:-0.2}" --no-verify -o "$R/res-small.json"
  run 240 "$R/c_calibrate.txt" $O calibrate --model "$M" --residency "$R/res-cap.json" --gpu-memory "$CAP" \
    ${THREADS:+--cpu-threads $THREADS} --sessions "$S"
}
phase_recalib() {  # calibrate again on the plan of phase calib (kept in .carry/res): no capacity test
  run 240 "$R/c_calibrate.txt" $O calibrate --model "$M" --residency "$R/res-cap.json" --gpu-memory "$CAP" \
    ${THREADS:+--cpu-threads $THREADS} --sessions "$S"
}
phase_predict() {
  for name in cap small; do
    run 150 "$R/c_predict_$name.txt" python3 scripts/predict_vs_measured.py --model "$M" \
      --residency "$R/res-$name.json" --calibration "$R/res-cap.json" --profile "$R/profile-held-out.json" \
      --gpu-memory "$CAP" ${THREADS:+--cpu-threads $THREADS} --sessions "$S" --split held-out --max-sessions 4 \
      --max-steps 192 --name "$name" --json-out "$R/pvm-$name.json"
  done
  python3 scripts/predict_vs_measured.py --compare "$R/pvm-cap.json" "$R/pvm-small.json" \
    --calibration "$R/res-cap.json" 2>&1 | tee "$R/c_result.txt" >> "$LOG"
}
phase_bench() {
  local cal="" f=$R/res-cap.json  # the constants and Np of phase calib (same machine, model and cap); else bench
  # calibrates. --merge needs the Np of the run it adds to: a calibration with another Np gives way to BENCH_CAL
  if [[ ${BENCH_ARGS:-} == *--merge* && -n ${BENCH_CAL:-} && $(field "$f" "d['calibration'].get('upload_threshold')") != \
        $(field "$R/bench/results.json" "d['np']['value']") ]]; then f=$BENCH_CAL; say "bench: Np of $f (--merge)"; fi
  f=$(usable_calibration "$f" "${BENCH_ARGS:-}"); cal=$(calibration_arg "$f")
  local kv  # the KV cache the capacity plan holds (the longest development request)
  kv=$(field "$R/res-cap.json" "d['capacity'].get('kv_tokens')")
  run 560 "$R/e_bench.txt" $O bench --model "$M" --gpu-memory "$CAP" ${THREADS:+--cpu-threads $THREADS} --sessions "$S" \
    ${kv:+--max-context $kv} \
    --profiles "$R/profile-dev.json" "$R/profile-held-out.json" $cal --no-progress \
    $(att) --out "$R/bench" ${BENCH_ARGS:-}
}
phase_sweep() {  # [I] BENCHMARK.md's length sweep, Ostinato and expert-cache in one process (one load, profile,
  # plan and calibration): 8 development prefixes of 1024 tokens, then 128-2048 new tokens; the held-out replay is
  # cut to the first turns (SWEEP_ARGS), as the sweep is what this run measures
  run 580 "$R/i_sweep.txt" $O bench --model "$M" --gpu-memory "$CAP" ${THREADS:+--cpu-threads $THREADS} --sessions "$S" \
    --no-progress $(att) --out "$R/sweep" ${SWEEP_ARGS:---policies ostinato expert-cache --max-sessions 8 --max-turns 1 \
    --max-output 64 --sweep-output 64 --tune-sessions 2 --tune-max-turns 4 --thresholds 512 1024 2048 --max-context 8292}
}
phase_regimes() {  # [J] the same bench under each routing regime; the calibration of phase calib (routing aside, the same)
  local pols="ostinato fixed-per-layer expert-cache decaying-cache" f=$R/res-cap.json cal="" kv sep="?" r d todo merge
  # thresholds: the caches chose 512-1024 in every tuned run so far (sessions 7 and 13); the grid keeps a regime to a call
  local A=${REGIMES_ARGS:---max-sessions 4 --max-turns 4 --max-output 32 --sweep-prefixes 0 --tune-sessions 2 --tune-max-turns 4 \
    --thresholds 512 1024 2048 --max-context 8292}
  [[ $M == synth:* ]] || { say "regimes: $M is not a synthetic model: it has no routing regimes"; return 1; }
  [[ $M == *\?* ]] && sep="&"
  f=$(usable_calibration "$f" "${BENCH_ARGS:-}"); cal=$(calibration_arg "$f")
  kv=$(field "$f" "d['capacity'].get('kv_tokens')")
  for r in ${REGIMES:-flat layered layered-persistent}; do
    d=$R/regimes/$r; todo=$(lacking "$d" "$pols"); merge=--merge
    [[ $todo == - ]] && { say "regimes: $r already measured in $d (remove it to measure again)"; continue; }
    [[ -z $todo ]] && { todo=$pols; merge=""; }
    run 560 "$R/j_regimes_$r.txt" $O bench --model "$M${sep}regime=$r" --gpu-memory "$CAP" ${THREADS:+--cpu-threads $THREADS} \
      --sessions "$S" ${kv:+--max-context $kv} $cal --no-progress $(att) --policies $todo \
      --out "$d" $merge $A
  done
  local specs=()
  for d in "$R"/regimes/*/; do
    [[ -f $d/results.json ]] || continue
    r=$(basename "$d")
    if [[ $(field "$d/results.json" "all('summary' in d['policies'].get(p, {}) for p in '$pols'.split())") == True ]]; then
      specs+=("$r=${d%/}")
    else say "regimes: $r is not measured in full yet: left out of the report"; fi
  done
  (( ${#specs[@]} )) || { say "regimes: no regime measured in full yet"; return 1; }
  run 60 "$R/j_regimes_report.txt" $O report --regimes "${specs[@]}" --out "$R/regimes"
}
phase_ablation() {  # [I] every step of the report's ablation table (ostinato/policies/settings.py ABLATION) and
  # expert-cache, on $M under $CAP, into one bench folder ($R/ablation) filled over as many calls as it takes: each
  # call runs, in that order, the policies the folder lacks (--merge); one cut by the deadline runs again next call.
  # One calibration for them all: ABLATION_CAL, else the folder's own once it exists, else phase calib's (else the
  # first call calibrates). ABLATION_POLICIES and ABLATION_ARGS (the sample, tuning) change the defaults.
  local pols=${ABLATION_POLICIES:-"cpu layers fixed-uniform fixed-per-layer ktransformers ostinato-split ostinato-upload \
ostinato ostinato-borrow expert-cache"} d=$R/ablation todo merge=--merge f
  todo=$(lacking "$d" "$pols")
  [[ $todo == - ]] && { say "ablation: every policy measured in $d (remove it to measure again)"; return 0; }
  [[ -z $todo ]] && { todo=$pols; merge=""; }
  f=${ABLATION_CAL:-}
  # the folder's plan: a run cut by the deadline before its first policy ended has one too (written before any replay)
  [[ -z $f && -f $d/residency.json ]] && f=$d/residency.json
  [[ -z $f ]] && f=$(usable_calibration "$R/res-cap.json" "")
  # the route counts of phase skew, else those the folder's first run profiled, else this run profiles (one load less)
  local prof="" src="profiled by this run" p
  for p in "$R" "$d"; do
    [[ -f $p/profile-dev.json && -f $p/profile-held-out.json ]] || continue
    prof="--profiles $p/profile-dev.json $p/profile-held-out.json"; src="from $p"; break
  done
  say "ablation: $todo${merge:+ (added to $d)}; route counts $src"
  run 560 "$R/i_ablation.txt" $O bench --model "$M" --gpu-memory "$CAP" ${THREADS:+--cpu-threads $THREADS} \
    --sessions "$S" $prof $(calibration_arg "$f") --no-progress \
    $(att) --policies $todo --out "$d" $merge \
    ${ABLATION_ARGS:---max-context 8292 --rounds 1 --max-sessions 8 --max-turns 12 --max-output 64 --sweep-prefixes 0}
}
phase_split() {  # where a split pass's time goes: split_path against its CPU branch alone and in parts
  run 240 "$R/b_split.txt" python3 scripts/split_interference.py --model "$M" --residency "$R/res-cap.json" \
    --gpu-memory "$CAP" ${THREADS:+--cpu-threads $THREADS} --sessions "$S" ${SPLIT_ARGS:-}
}
phase_multi() {
  # the same 40% of experts hot, split over the GPUs: against the one-GPU reference and hybrid40
  [[ -f $R/ref.pt ]] || check all "$R/all.json"
  check split2 "$R/r40x2.json" --gpu-memory "$CAP_PER_GPU"
  # alone: in phase tests it failed at load with a CUDA error left over from the test before it
  run 60 "$R/tests_alone.txt" python3 -m pytest -q -p no:cacheprovider \
    tests/test_multi_device.py::test_graph_per_gpu_all_resident_bitwise_equals_eager
}
phase_multi_replay() {
  # the capacity plan per GPU, replayed as bench replays Ostinato (REPLAY_ARGS: bench's sizes)
  local P="--profile $R/profile-dev.json --held-out $R/profile-held-out.json" np
  run 90 "$R/g_plan_cap.txt" $O plan --model "$M" $P --gpu-memory "$CAP_PER_GPU" --devices "$DEVICES" \
    $(att) --no-verify -o "$R/r2cap.json"
  np=$(field "$R/res-cap.json" "d['calibration'].get('upload_threshold')")
  run 300 "$R/g_replay_2gpu.txt" $O replay --model "$M" --sessions "$S" ${THREADS:+--cpu-threads $THREADS} \
    --residency "$R/r2cap.json" --gpu-memory "$CAP_PER_GPU" ${np:+--upload-threshold $np} \
    ${REPLAY_ARGS:---max-sessions 4 --max-turns 4 --max-output 32}
}

# the quantized file of $M's preset ($LQUANT, default Q4_K_M) that greedy, bench_gguf and llama_tune share:
# $LGGUF if given, else written here once (kept while the machine stays warm)
# synth_args: `ostinato synth`'s arguments for $M (synth:PRESET[?layers=N&seed=S&regime=R])
synth_args() {
  local spec=${M#synth:} kv q out
  out="--preset ${spec%%\?*}"
  if [[ $spec == *\?* ]]; then
    q=${spec#*\?}
    for kv in ${q//&/ }; do out+=" --${kv%%=*} ${kv#*=}"; done
  fi
  echo "$out"
}
gguf_file() {  # the folder is named after all of $M (synth:P?layers=32 and synth:P are other files)
  if [[ -n ${LGGUF:-} ]]; then echo "$LGGUF"; return; fi
  local spec=${M#synth:} preset; preset=${spec%%\?*}
  echo "/tmp/gguf/${spec//[^A-Za-z0-9.-]/_}/$preset-${LQUANT:-Q4_K_M}.gguf"
}
phase_gguf() {  # written in the background (a session of its own, so it outlives the call): phases that
  # do not need the file run meanwhile; those that do wait for it (gguf_wait)
  local g; g=$(gguf_file)
  if [[ -f $g ]]; then say "gguf: $g is there ($(du -h "$g" | cut -f1))"; return; fi
  if kill -0 "$(cat /tmp/gguf.pid 2>/dev/null)" 2>/dev/null; then say "gguf: $g is being written"; return; fi
  [[ -n ${LGGUF:-} ]] && { say "gguf: no file $LGGUF"; return 1; }
  [[ $M == synth:* ]] || { say "gguf: $M is not a synthetic model: give its file as LGGUF"; return 1; }
  local d; for d in /tmp/gguf/*/; do  # one model's file at a time: the 30B file (18 GB) and the 235B shape's
    # (46 GB) do not fit the 64 GiB disk together
    [[ -d $d && ${d%/} != "$(dirname "$g")" ]] && rm -rf "$d" && say "gguf: removed $d to make room"
  done
  mkdir -p "$(dirname "$g")"; rm -rf /tmp/gguf.part
  say "gguf: writing $g in the background ($(synth_args)); disk: $(df -h --output=avail /tmp | tail -1)"
  setsid bash -c "t0=\$SECONDS; $O synth $(synth_args) --format gguf --quant ${LQUANT:-Q4_K_M} --out /tmp/gguf.part \
    && mv /tmp/gguf.part/$(basename "$g") $g; echo \"synth: exit \$? after \$((SECONDS - t0)) s\"" \
    >> "$R/k_synth_gguf.txt" 2>&1 < /dev/null &
  echo $! > /tmp/gguf.pid
}
gguf_wait() {  # until phase gguf's file is there (1: its writer ended without it, or the deadline is near)
  local g; g=$(gguf_file)
  while [[ ! -f $g ]] && kill -0 "$(cat /tmp/gguf.pid 2>/dev/null)" 2>/dev/null; do
    (( DEADLINE - SECONDS < 60 )) && { say "gguf: $g not written yet"; return 1; }
    sleep 3
  done
  [[ -f $g ]] || { say "gguf: no file $g (phase gguf; $R/k_synth_gguf.txt)"; return 1; }
  [[ -n ${GGUF_SAID:-} ]] && return 0
  say "gguf: $g ($(du -h "$g" | cut -f1)); $(tail -1 "$R/k_synth_gguf.txt" 2>/dev/null)"; GGUF_SAID=1
  # the freshly written file's dirty pages go to disk before anything is timed: in sessions 21 and 22 the first
  # replay after a write slowed by up to 2 s on the same few turns (235B and 30B files alike) while the kernel
  # wrote them back; a later replay on the same machine ran those turns at their size's pace
  local t=$SECONDS; sync; say "gguf: dirty pages written back (sync: $((SECONDS - t)) s)"
}
llama_kit() {  # the llama.cpp kit unpacked to /tmp/llama/kit (from .carry/llama-kit: ../shared/llama's kit)
  [[ -x /tmp/llama/kit/llama-server ]] || bash .carry/llama-kit/unpack.sh /tmp/llama >> "$LOG" 2>&1 \
    || { say "no llama.cpp kit"; return 1; }
}
phase_greedy() {  # [K] greedy tokens of both engines on the same file (every layer on the GPU)
  local g; g=$(gguf_file)
  gguf_wait && llama_kit || return 1
  run 200 "$R/k_greedy.txt" python3 scripts/greedy_vs_llama.py --server /tmp/llama/kit/llama-server --model "$g" \
    --tokens 32 --log "$R/k_greedy_llama.log" --json-out "$R/k_greedy.json"
}
phase_plan_gguf() {  # [K] the capacity plan on that file under $QCAP, verified: the largest pass of the longest
  # request (2048 tokens over --max-context, QPLAN_CONTEXT, default 8292) run under the cap, its peak read back
  local g; g=$(gguf_file)
  gguf_wait || return 1
  run 240 "$R/k_plan.txt" $O plan --model "$g" --profile "$R/profile-dev.json" --held-out "$R/profile-held-out.json" \
    --gpu-memory "${QCAP:-12GiB}" --max-context "${QPLAN_CONTEXT:-8292}" ${THREADS:+--cpu-threads $THREADS} \
    -o "$R/k_plan.json"
}
phase_bench_gguf() {  # [K] bench on the quantized file under $QCAP (QBENCH_ARGS: policies, sample, --merge)
  local g f=$R/${QBENCH_OUT:-bench_q4}/residency.json cal="" kv; g=$(gguf_file)
  gguf_wait || return 1
  # the calibration and Np of this bench's first call (a --merge adds to it); the first call calibrates
  f=$(usable_calibration "$f" "${QBENCH_ARGS:-}"); cal=$(calibration_arg "$f")
  kv=$(field "$R/res-cap.json" "d['capacity'].get('kv_tokens')")
  # the route counts of the bf16 model of the same weights (phase skew, $QPROFILED): the quantized model's
  # own routing is what the replay measures (pool hit rates, cold routes); another model profiles itself
  local prof=""
  [[ $M == "${QPROFILED:-synth:qwen3-30b-a3b}" ]] && prof="--profiles $R/profile-dev.json $R/profile-held-out.json"
  run 560 "$R/k_bench.txt" $O bench --model "$g" --gpu-memory "${QCAP:-12GiB}" ${THREADS:+--cpu-threads $THREADS} \
    --sessions "$S" ${kv:+--max-context $kv} $prof $cal \
    --no-progress $(att) --out "$R/${QBENCH_OUT:-bench_q4}" ${QBENCH_ARGS:-}
}
phase_ab_gguf() {  # A, B, A on one calibration: drift between the replays shows as A's two results apart
  local cal=${AB_CAL:-$R/${QBENCH_OUT:-bench_q4}/residency.json} tgz=${AB_TGZ:-.carry/ab.tgz} b=/tmp/ab_tree
  [[ -f $cal ]] || { say "ab_gguf: needs a calibration ($cal)"; return 1; }
  local here=${AB_ENV:-}${AB_ARGS:-}  # B is this tree with other settings, else another commit
  if [[ -z $here ]]; then
    [[ -f $tgz && -n ${AB_COMMIT:-} ]] || { say "ab_gguf: needs AB_ENV or AB_ARGS, or AB_COMMIT and $tgz"; return 1; }
    rm -rf "$b" && mkdir -p "$b" && tar xzf "$tgz" -C "$b" && ln -sfn "$PWD/.carry" "$b/.carry"
  fi
  local v args="--policies ostinato --calibration $cal"
  rm -rf "$R/ab"  # an earlier call's A/B/A is in its res.tgz
  for v in ${AB_RUNS:-a1 b a2}; do  # AB_RUNS="a1 b": no second A where the device time is short (no drift check)
    local env_v="AB_ENV_${v^^}"  # a run other than a1 / a2 / b (AB_RUNS="a1 b c a2") takes AB_ENV_C, else AB_ENV
    local e=${!env_v:-${AB_ENV:-}}
    if [[ $v != a* && -n $here ]]; then
      say "ab_gguf: $v is this tree with${e:+ $e}${AB_ARGS:+ $AB_ARGS}"
      ([[ -n $e ]] && export $e; QBENCH_OUT=ab/$v QBENCH_ARGS="${QBENCH_ARGS:-} $args ${AB_ARGS:-}" phase_bench_gguf)
    elif [[ $v == b ]]; then
      (cd "$b" && OSTINATO_COMMIT=$AB_COMMIT QBENCH_OUT=ab/$v QBENCH_ARGS="${QBENCH_ARGS:-} $args" \
        BUDGET_S=$((DEADLINE - SECONDS)) OUT=/tmp/ab_out R=$R bash scripts/device/run.sh bench_gguf)
      cat /tmp/ab_out/log.txt >> "$LOG"; rm -rf /tmp/ab_out
    else QBENCH_OUT=ab/$v QBENCH_ARGS="${QBENCH_ARGS:-} $args" phase_bench_gguf; fi
  done
  python3 - "$R/ab" <<'PY' | tee -a "$LOG"
import json, os, sys
for v in sorted(os.listdir(sys.argv[1])):
    f = os.path.join(sys.argv[1], v, "results.json")
    if not os.path.exists(f):
        print(f"{v}: no result"); continue
    d = json.load(open(f)); r = d["policies"]["ostinato"]; s = r["summary"]
    print(f"{v} {d['commit']} (OSTINATO_AMX_QUANT {d.get('amx_quant_min_tokens', 0)}, OSTINATO_AMX_INT8 {d.get('amx_int8_min_tokens', 0)}, deferred combine {d.get('defer_combine', False)}, pass graphs {d.get('pass_graphs', 0)} (midpoints from {d.get('pass_midpoints', 0)}), staging {d.get('stage_routes')}, OSTINATO_STAGE_FROM {d.get('stage_from')}, prefetch {d.get('prefetch', 0)} from {d.get('prefetch_from')} on {d.get('prefetch_programs', 64)} programs, resident {r.get('resident_experts')}): TTFT after tool {s['ttft_ms']['median']['tool']} ms, first {s['ttft_ms']['median']['first']} ms, "
          f"TPOT {s['tpot_ms']['median']} ms (p90 {s['tpot_ms']['p90']}), total {s['request_s']['total']} s, host read {r.get('host_read_gbps')}, host meanwhile {r.get('host_counters')}")
    if s['tpot_ms']['p90'] > 1.5 * s['tpot_ms']['median']:  # as in results/2026-12-07-h100-s55/
        print(f"  {v}: decode steps unsteady (TPOT p90 over 1.5x the median): unless the change is to decode, the "
              "machine was disturbed during this run, which then compares with no other")
PY
}
phase_llama_tune() {
  local g; g=$(gguf_file)
  gguf_wait && llama_kit || return 1
  local kv  # the turns Ostinato's bench replays: those within the capacity plan's KV cache
  kv=$(field "$R/res-cap.json" "d['capacity'].get('kv_tokens')")
  run 560 "$R/l_tune.txt" python3 scripts/llama_tune.py --server /tmp/llama/kit/llama-server --model "$g" \
    --cap "${QCAP:-$CAP}" --sessions "$S" ${kv:+--max-context $kv} --threads 16 14 --out "$R/llama_tune" \
    ${LLAMA_TUNE_ARGS:-}
}
phase_ik_tune() {
  local g kv; g=$(gguf_file)
  gguf_wait || return 1
  [[ -x /tmp/ik/ik-kit-dir/llama-server ]] || IK_KIT=${IK_KIT:-$PWD/.ik-kit/ik-kit.tar.xz} \
    bash scripts/device/ik_llama/unpack.sh /tmp/ik >> "$LOG" 2>&1 || { say "no ik_llama.cpp kit (.ik-kit)"; return 1; }
  kv=$(field "$R/res-cap.json" "d['capacity'].get('kv_tokens')")
  run 560 "$R/ik_tune.txt" python3 scripts/llama_tune.py --server /tmp/ik/ik-kit-dir/llama-server \
    --flavor ik_llama.cpp --model "$g" --cap "${QCAP:-$CAP}" --sessions "$S" ${kv:+--max-context $kv} \
    --threads 16 14 --out "$R/ik_tune" ${IK_TUNE_ARGS:-}
}
phase_profile() {  # [Q] where a decode step's GPU time goes (PROFILES, default all of): all resident with the
  # dense part's torch expressions (unfused: OSTINATO_FUSED_DENSE=0) and with its fused kernels (all), the
  # capacity plan under $CAP (cap: phase calib's, else serve_plan's), the GGUF file all resident (gguf)
  local want=" ${PROFILES:-unfused all cap gguf} " cap=$R/res-cap.json
  [[ -f $cap ]] || cap=$R/m_plan.json
  [[ $want == *" unfused "* ]] && OSTINATO_FUSED_DENSE=0 run 200 "$R/q_profile_unfused.txt" \
    python3 scripts/profile_decode.py --model "$M" --out "$R/q_profile_unfused"
  [[ $want == *" all "* ]] && run 200 "$R/q_profile_all.txt" python3 scripts/profile_decode.py --model "$M" \
    --out "$R/q_profile_all"
  [[ $want == *" cap "* && -f $cap ]] && run 200 "$R/q_profile_cap.txt" python3 scripts/profile_decode.py \
    --model "$M" --residency "$cap" --gpu-memory "$CAP" --out "$R/q_profile_cap"
  local g; g=$(gguf_file)  # the same model's GGUF file, every expert resident in its blocks, if phase gguf wrote it
  if [[ $want == *" gguf "* && -f $g ]] && ! kill -0 "$(cat /tmp/gguf.pid 2>/dev/null)" 2>/dev/null; then
    run 200 "$R/q_profile_gguf.txt" python3 scripts/profile_decode.py --model "$g" --out "$R/q_profile_gguf"
  fi
  return 0
}
phase_profile_prefill() {  # [K][Q] where a tool turn's TTFT goes: prefill passes of PREFILL_SIZES new tokens after
  # a 4096-token context, on the GGUF file under $QCAP with the plan phase bench_gguf made on this machine (an
  # earlier session's plan was sized by an older capacity test)
  local g plan=$R/${QBENCH_OUT:-bench_q4}/residency.json; g=$(gguf_file)
  gguf_wait || return 1
  fresh "$plan" || { say "profile_prefill: no plan of this session's bench_gguf ($plan)"; return 1; }
  local out=${PREFILL_OUT:-q_prefill}  # e.g. a second run with OSTINATO_PASS_GRAPHS=0 beside the default's
  run 300 "$R/$out.txt" python3 scripts/profile_decode.py --model "$g" --residency "$plan" \
    --gpu-memory "${QCAP:-12GiB}" --context 4096 \
    --prefill ${PREFILL_SIZES:-16 64 256 1024 2048} --steps 5 --profile-steps 2 --out "$R/$out"
}
phase_llama_bench() {  # [Q] llama.cpp's decode with every layer on the GPU (llama-bench -ngl 99 at depth 0 and 2048)
  # on the Q4_K_M file if phase gguf was asked for, and on a bf16 GGUF of LB_LAYERS layers (default 24, 30 GB: the
  # 48-layer one would not fit the disk beside the Q4_K_M file), and Ostinato's step on that same bf16 file
  # (scripts/profile_decode.py)
  local g b n=${LB_LAYERS:-24}; g=$(gguf_file)
  llama_kit || return 1
  b=/tmp/gguf/bf16-$n/qwen3-30b-a3b-BF16.gguf
  [[ -f /tmp/gguf.pid || -f $g ]] && gguf_wait && run 150 "$R/q_llama_bench_q4.json" env CUDA_VISIBLE_DEVICES=0 \
    /tmp/llama/kit/llama-bench -m "$g" -ngl 99 -p 0 -n 128 -d 0,2048 -r 3 -o json
  if [[ ! -f $b ]]; then
    rm -rf /tmp/gguf.bf16.part; mkdir -p "$(dirname "$b")"
    run 240 "$R/q_synth_bf16.txt" $O synth --preset qwen3-30b-a3b --layers "$n" --format gguf --quant BF16 \
      --out /tmp/gguf.bf16.part && mv /tmp/gguf.bf16.part/qwen3-30b-a3b-BF16.gguf "$b"
  fi
  [[ -f $b ]] || { say "llama_bench: no bf16 file $b"; return 1; }
  run 150 "$R/q_llama_bench_bf16.json" env CUDA_VISIBLE_DEVICES=0 /tmp/llama/kit/llama-bench -m "$b" -ngl 99 \
    -p 0 -n 128 -d 0,2048 -r 3 -o json
  run 200 "$R/q_profile_bf16.txt" python3 scripts/profile_decode.py --model "$b" --out "$R/q_profile_bf16_gguf"
}
# serve_ready PORT LOG LIMIT [ARGS...]: start `serve` on PORT, poll /health each second into $R/m_health.jsonl
# until it answers ok (prints the seconds it took) or the process ends or LIMIT passes; the server's pid: $SERVE_PID
serve_ready() {
  local port=$1 log=$2 limit=$3; shift 3
  $O serve --model "$M" --port "$port" ${THREADS:+--cpu-threads $THREADS} "$@" > "$log" 2>&1 &
  SERVE_PID=$!
  python3 - "$port" "$SERVE_PID" "$limit" "$R/m_health.jsonl" <<'PY' | tee -a "$LOG"
import json, os, sys, time, urllib.error, urllib.request
port, pid, limit, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
t0 = time.monotonic()
while time.monotonic() - t0 < limit:
    try:
        os.kill(pid, 0)
    except OSError:
        print(f"serve exited before it was ready ({time.monotonic() - t0:.1f} s)"); sys.exit(1)
    try:
        body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read())
    except urllib.error.HTTPError as e:
        body = json.loads(e.read() or b"{}")
    except OSError:
        body = {"status": "not listening"}
    with open(out, "a") as f:
        f.write(json.dumps({"t": round(time.monotonic() - t0, 1), **body}) + "\n")
    if body.get("status") == "ok":
        print(f"serve ready after {time.monotonic() - t0:.1f} s"); sys.exit(0)
    time.sleep(1)
print(f"serve not ready after {limit} s"); sys.exit(1)
PY
}
phase_serve_plan() {  # each replay on a server of its own (one keeps the KV of its last conversations)
  local port=8091 A=${SERVE_REPLAY_ARGS:---max-sessions 8 --max-turns 4 --max-output 32} plan
  rm -rf "$OSTINATO_CACHE/plans"
  say "serve from an empty plan cache"
  serve_ready $port "$R/m_serve_first.log" 420 --gpu-memory "$CAP" || { kill $SERVE_PID 2>/dev/null; return 1; }
  grep -a "planned\|ready:\|experts:\|context:\|threads:" "$R/m_serve_first.log" | tee -a "$LOG"
  run 200 "$R/m_replay_http.txt" $O replay --endpoint http://127.0.0.1:$port --sessions "$S" $A
  kill $SERVE_PID; wait $SERVE_PID 2>/dev/null
  say "serve again: the plan from the cache"
  serve_ready $port "$R/m_serve_second.log" 200 --gpu-memory "$CAP" || { kill $SERVE_PID 2>/dev/null; return 1; }
  run 200 "$R/m_replay_messages.txt" $O replay --endpoint http://127.0.0.1:$port --api anthropic --tokenizer "$M" \
    --sessions "$S" $A
  kill $SERVE_PID; wait $SERVE_PID 2>/dev/null
  plan=$(ls "$OSTINATO_CACHE"/plans/*/residency.json | head -1)
  cp "$plan" "$R/m_plan.json"; cp "${plan%.json}.served.json" "$R/m_plan.served.json" 2>/dev/null
  run 200 "$R/m_replay_inproc.txt" $O replay --model "$M" --residency "$plan" --sessions "$S" \
    ${THREADS:+--cpu-threads $THREADS} $A
}
phase_serve_cached() {  # [M] a plan served from its file (SERVE_PLAN, default serve_plan's, restored from
  # .carry/res) and the same turns in-process on it: the server's cost apart from planning in its own process
  local port=8092 A=${SERVE_REPLAY_ARGS:---max-sessions 8 --max-turns 4 --max-output 32} plan=${SERVE_PLAN:-$R/m_plan.json}
  [[ -f $plan ]] || { say "serve_cached: no plan $plan"; return 1; }
  serve_ready $port "$R/m_serve_cached.log" 200 --residency "$plan" || { kill $SERVE_PID 2>/dev/null; return 1; }
  run 200 "$R/m_replay_http_cached.txt" $O replay --endpoint http://127.0.0.1:$port --sessions "$S" $A
  kill $SERVE_PID; wait $SERVE_PID 2>/dev/null
  run 200 "$R/m_replay_inproc_cached.txt" $O replay --model "$M" --residency "$plan" --sessions "$S" \
    ${THREADS:+--cpu-threads $THREADS} $A
}
phase_threads() {  # [H] the default layout against explicit worker counts and 5a8b237's layout, one process
  run 420 "$R/h_threads.txt" python3 scripts/thread_sweep.py --model "$M" --residency "$R/res-cap.json" \
    --gpu-memory "$CAP" --sessions "$S" --json-out "$R/h_threads.json" ${THREADS_ARGS:-}
}

phase_llama() {
  # [E] llama.cpp on the same weights (BENCHMARK.md): the 16-layer model written to disk, converted to GGUF
  # bf16 by llama.cpp's own converter, served by llama-server with the experts of the first $NCMOE layers in
  # host memory (-ngl 99 --n-cpu-moe), 16 threads; then Ostinato's bench on the same checkpoint under $LCAP;
  # both replay the same held-out turns (LLAMA_ARGS). $LLAMA: a folder with llama-server (or .xz), its
  # libraries in lib/, convert.py and the converter's sources in src/ (not in this repository)
  local K=${LLAMA:-.carry/llama} ck=${L16:-/tmp/l16} gguf=${L16:-/tmp/l16}.gguf n=${NCMOE:-8} port=8090 nv pid
  local A=${LLAMA_ARGS:---max-sessions 3 --max-turns 4 --max-output 32}
  nv=$(python3 -c "import glob,site,os;print(':'.join(sorted({os.path.dirname(p) for sp in site.getsitepackages()
for p in glob.glob(os.path.join(sp,'nvidia','**','libcu*.so.13'),recursive=True)})))")
  export LD_LIBRARY_PATH=$K/lib:$nv:${LD_LIBRARY_PATH:-}
  [[ -x $K/llama-server ]] || { xz -dc "$K/llama-server.xz" > "$K/llama-server" && chmod +x "$K/llama-server"; }
  ldd "$K/llama-server" | grep "not found" | tee -a "$LOG"
  [[ -f $ck/config.json ]] || run 200 "$R/l_synth.txt" $O synth ${L16_SYNTH:---preset qwen3-30b-a3b --layers 16} --out "$ck"
  [[ -f $gguf ]] || run 300 "$R/l_convert.txt" python3 "$K/convert.py" "$K/src" "$ck" --outtype bf16 --outfile "$gguf"
  [[ -f $gguf ]] || { say "no GGUF: llama.cpp not measured"; return 1; }
  # one GPU, as Ostinato (llama.cpp splits the layers over every visible GPU)
  CUDA_VISIBLE_DEVICES=${LLAMA_GPU:-0} "$K/llama-server" -m "$gguf" -ngl 99 --n-cpu-moe "$n" -t 16 -tb 16 -c 9216 \
    -np 1 --host 127.0.0.1 --port $port --no-webui > "$R/l_server.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 150); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null && break
    sleep 1
  done
  { say "llama-server --n-cpu-moe $n: GPU memory"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv; } \
    2>&1 | tee -a "$R/l_memory.txt" "$LOG"
  run 240 "$R/l_llama.txt" $O replay --endpoint http://127.0.0.1:$port --endpoint-kind openai --first-token text \
    --tokenizer "$ck" --sessions "$S" $A
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>&1 | tee -a "$R/l_memory.txt" "$LOG"
  kill $pid; wait $pid 2>/dev/null
  run 300 "$R/l_ostinato.txt" $O bench --model "$ck" --gpu-memory "${LCAP:-12GiB}" ${THREADS:+--cpu-threads $THREADS} \
    --sessions "$S" --policies ostinato $A --no-tune --sweep-prefixes 0 --no-progress \
    --max-context 9216 --out "$R/bench_l16"
}

say "phases: $* (model $M, cap $CAP, CPU expert workers ${THREADS:-by the default layout}, sessions $S)"
for p in "$@"; do
  if (( DEADLINE - SECONDS < 30 )); then say "skipped phase $p: no time left"; continue; fi
  say "phase $p"
  "phase_$p"
done
rm -f "$R/ref.pt.tmp"
tar czf "$OUT/res.tgz" --exclude=ref.pt --exclude=.restored -C "$R" . && say "packed $(du -h "$OUT/res.tgz" | cut -f1)"
