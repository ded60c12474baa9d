#!/usr/bin/env bash
# One GPU measurement: distil the SmolLM2-135M draft on the GPU from far more target-generated text than the CPU run
# could, write its layers-only artifact to $OUT/draft, then run the demo (DSBD vs plain sampling through vLLM) with it.
# Run on the GPU machine from the repository root after benchmarks/gpu/check.sh's setup; the model and prompts
# arrive as benchmarks/gpu/smollm2_env.sh says.
set -u
OUT=${OUT:-/tmp/dsbd-gpu-out}
mkdir -p "$OUT"
source benchmarks/gpu/smollm2_env.sh || exit 1
t0=$(date +%s)
timeout "${DSBD_DISTILL_S:-420}" python -P -m vllm_dsbd.distill --target "$T" --out /tmp/draft-gpu --layers 2 \
  --tokens "${DSBD_DISTILL_TOKENS:-1500000}" --epochs 2 --device cuda --prompts "$SHAREGPT" \
  --gen-batch-size 512 --batch-size 64 --no-compile --no-progress --artifact "$OUT/draft" > "$OUT/distill.log" 2>&1
echo "distill rc=$? $(( $(date +%s) - t0 ))s"; tail -15 "$OUT/distill.log"
if [[ -f $OUT/draft/layers.safetensors && ${DSBD_DEMO:-1} == 1 ]]; then
  rm -rf drafts/smollm2-135m-2l && cp -r "$OUT/draft" drafts/smollm2-135m-2l  # this machine's copy only
  # a script run by path: its own folder on sys.path, never the repository root (no -P needed, see bench.sh)
  timeout "${DSBD_DEMO_S:-150}" python benchmarks/engine/demo_vllm.py --width 2 --depth 3 > "$OUT/demo.log" 2>&1
  echo "demo rc=$?"; grep -A6 "^method" "$OUT/demo.log"
fi
