#!/usr/bin/env bash
# The GPU runbook in one device call of about 8 minutes (docs/benchmarks.md, "GPU runbook"): check.sh's
# default_config step (the user's engine as a user starts it, cost model on, against plain vLLM; plus the same engine
# pinned), then bench.sh's large_model rows on the 8B / 1B shapes (plain engine, then the DSBD engine a user gets from
# `vllm serve TARGET --speculative-method dsbd` (draft-free sources), then one with the 1B draft model, each with the
# cost model on: its rows record the depths it chose, and pinned rows beside them). Each step has a time limit taken from
# RUNBOOK_S (the seconds this script may use, default 500) so the script ends, and its files come back, before the
# device call's own limit. At most 8 files land in $OUT (the device tool's limit): check's summary.txt, gpu.txt,
# default_config.log and bench_bare.log; bench/large_plain.log, bench/large_dsbd_free.log (or large_dsbd.log: with
# three engines the third's log is dropped, its rows stay in rows.jsonl) and bench/large_model/{rows.jsonl,README.md}
# (large_model.json, the same rows, is removed). Run on the GPU machine from the repository root after
#   source .gpu/gpu_setup.sh && python -m pip install --no-deps --no-build-isolation .
# RUNBOOK_CHECK_STEPS (default "default_config bench_bare") and RUNBOOK_ENGINES (default "plain dsbd_free dsbd") pick the steps; LM_ARGS
# as for bench.sh (default: 2 prompts at batch 1, 48 new tokens, beam rows of 24 tokens).
#
# `benchmarks/gpu/runbook.sh decompose`: the loan's first vLLM call, before anything else (issue 47 item 1), a device
# call of its own of at most 5 minutes: benchmarks/gpu/decompose.py (plain vLLM in four configurations, vLLM's ngram,
# DSBD without forests and as a user starts it; step times, host phases, launches and synchronisations) within
# DECOMPOSE_S seconds (default 230: with the bundle's unpacking and the install the call stays under 300 s), into
# $OUT/decompose/ (README.md, decompose.json, decompose.log, gpu.txt). DECOMPOSE_ARGS adds arguments; for engines a
# first run had no time for, DECOMPOSE_FROM=results/gpu/DATE/decompose DECOMPOSE_ARGS="--engines ngram,ngram_gpu"
# merges the new rows into that run's decompose.json (committed first, so it travels with the working tree).
set -u
OUT=${OUT:-/tmp/dsbd-gpu-out}
mkdir -p "$OUT"
if [[ ${1:-} == decompose ]]; then
  mkdir -p "$OUT/decompose"
  [[ -n ${DECOMPOSE_FROM:-} ]] && cp "$DECOMPOSE_FROM/decompose.json" "$OUT/decompose/"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/decompose/gpu.txt"
  t0=$(date +%s)
  timeout $(( ${DECOMPOSE_S:-230} + 40 )) python benchmarks/gpu/decompose.py --budget-s "${DECOMPOSE_S:-230}" \
    --out "$OUT/decompose" ${DECOMPOSE_ARGS:-} 2>&1 | grep -v "^INFO\|^WARNING\|^\[W\|^(EngineCore" | tail -150
  echo "runbook decompose: $(( $(date +%s) - t0 )) s of ${DECOMPOSE_S:-230}"
  exit 0
fi
budget=${RUNBOOK_S:-500}
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }

DSBD_DEFAULT_CONFIG_S=${DSBD_DEFAULT_CONFIG_S:-230} DSBD_GPU_STEPS="${RUNBOOK_CHECK_STEPS:-default_config bench_bare}" \
  OUT=$OUT benchmarks/gpu/check.sh | tail -20

engines=${RUNBOOK_ENGINES:-plain dsbd_free dsbd}
export LM_ARGS=${LM_ARGS:---b1-prompts 2 --max-tokens 48 --beam-tokens 24}
for engine in $engines; do  # each engine gets the time left (plain at most 110 s); one that cannot start in 60 s is skipped
  rest=$(( $(left) - 10 ))
  [[ $engine == plain ]] && (( rest > 110 )) && rest=110
  if (( rest > 60 )); then
    env DSBD_PLAIN_S=$rest DSBD_DSBD_S=$rest DSBD_FREE_S=$rest DSBD_DRAFT_MODEL_S=$rest DSBD_CHAIN_S=$rest \
      LARGE_ENGINES=$engine OUT=$OUT/bench benchmarks/gpu/bench.sh
  else
    echo "runbook: no time left for the $engine engine ($rest s)"
  fi
done
# the same as $OUT/gpu.txt and as rows.jsonl: keeps $OUT within 8 files
rm -f "$OUT/bench/gpu.txt" "$OUT/bench/large_model/large_model.json"
n=$(find "$OUT" -type f | wc -l)
(( n > 8 )) && [[ -f $OUT/bench/large_dsbd.log && -f $OUT/bench/large_dsbd_free.log ]] && {
  tail -40 "$OUT/bench/large_dsbd.log"; rm -f "$OUT/bench/large_dsbd.log"; }  # printed above instead
echo "runbook: $(( $(date +%s) - start )) s of $budget"
