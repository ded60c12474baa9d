#!/usr/bin/env bash
# The GPU runbook in one device call of about 8 minutes (docs/benchmarks.md, "GPU runbook"): check.sh's
# default_config step (the user's engine as a user starts it, cost model on, against plain vLLM; plus the same engine
# pinned), then bench.sh's large_model rows on the 8B / 1B shapes (plain engine, then one DSBD engine with the cost
# model on: its rows record the depths it chose, and pinned rows beside them). Each step has a time limit taken from
# RUNBOOK_S (the seconds this script may use, default 500) so the script ends, and its files come back, before the
# device call's own limit. At most 8 files land in $OUT (the device tool's limit): check's summary.txt, gpu.txt,
# default_config.log and bench_bare.log; bench/large_plain.log, bench/large_dsbd.log and
# bench/large_model/{rows.jsonl,README.md} (large_model.json, the same rows, is removed). Run on the GPU machine from the repository root after
#   source .gpu/gpu_setup.sh && python -m pip install --no-deps --no-build-isolation .
# RUNBOOK_CHECK_STEPS (default "default_config bench_bare") and RUNBOOK_ENGINES (default "plain dsbd") pick the steps; LM_ARGS
# as for bench.sh (default: 2 prompts at batch 1, 48 new tokens, beam rows of 24 tokens).
set -u
OUT=${OUT:-/tmp/dsbd-gpu-out}
mkdir -p "$OUT"
budget=${RUNBOOK_S:-500}
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }

DSBD_DEFAULT_CONFIG_S=${DSBD_DEFAULT_CONFIG_S:-230} DSBD_GPU_STEPS="${RUNBOOK_CHECK_STEPS:-default_config bench_bare}" \
  OUT=$OUT benchmarks/gpu/check.sh | tail -20

engines=${RUNBOOK_ENGINES:-plain dsbd}
plain_s=$(( $(left) < 110 ? $(left) : 110 ))
export LM_ARGS=${LM_ARGS:---b1-prompts 2 --max-tokens 48 --beam-tokens 24}
if [[ " $engines " == *" plain "* ]] && (( plain_s > 30 )); then
  DSBD_PLAIN_S=$plain_s LARGE_ENGINES=plain OUT=$OUT/bench benchmarks/gpu/bench.sh
fi
rest=$(( $(left) - 10 ))
if [[ " $engines " == *" dsbd "* ]] && (( rest > 60 )); then
  DSBD_DSBD_S=$rest LARGE_ENGINES=dsbd OUT=$OUT/bench benchmarks/gpu/bench.sh
else
  echo "runbook: no time left for the DSBD engine ($rest s)"
fi
# the same as $OUT/gpu.txt and as rows.jsonl: keeps $OUT within 8 files
rm -f "$OUT/bench/gpu.txt" "$OUT/bench/large_model/large_model.json"
echo "runbook: $(( $(date +%s) - start )) s of $budget"
