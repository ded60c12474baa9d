#!/usr/bin/env bash
# The measurements of README.md (run from the repository root; HEAD = the trained head folder, assembled from
# drafts/smollm2-135m-eagle3 or written by the training command of README.md). Four processes in parallel; OUT=DIR
# writes the results to another page folder.
set -euo pipefail
HEAD=${1:?usage: measure.sh HEAD_DIR}
OUT=${OUT:-results/eagle3-head-2026-11-27}
PY=${PY:-.venv/bin/python}
TARGET=$($PY -c "from vllm_dsbd.testing import models; print(models.smollm2_dir())")
DRAFT=$($PY -c "import pathlib; from vllm_dsbd.testing import models; from vllm_dsbd.testing.drafts import draft_folder; print(draft_folder(models.smollm2_dir(), 8, pathlib.Path('.').resolve())[0])")
$PY benchmarks/engine/beam_acceptance.py --head "$HEAD" --ks 4,8,16,32,64 --num-prompts 8 --steps 16 --threads 1 \
    --json $OUT/coverage.json > $OUT/coverage.log 2>&1 &
$PY -m vllm_dsbd.distill eval --target "$TARGET" --draft "$DRAFT" --num-prompts 6 \
    --max-new-tokens 64 --gamma 3 --threads 1 --json $OUT/eval-t1-draft.json > $OUT/eval-t1-draft.log 2>&1 &
$PY -m vllm_dsbd.distill eval --target "$TARGET" --head "$HEAD" --num-prompts 6 \
    --max-new-tokens 64 --gamma 3 --threads 1 --json $OUT/eval-t1-head.json > $OUT/eval-t1-head.log 2>&1 &
$PY "$(dirname "$0")"/cost.py --head "$HEAD" --repeats 40 --json $OUT/cost.json > $OUT/cost.log 2>&1 &
wait
