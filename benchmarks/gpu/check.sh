#!/usr/bin/env bash
# One GPU check: the Triton kernels compiled (their tests against the torch references, bf16 included), the user's
# default configuration against plain vLLM in that configuration (bf16, vLLM's default compilation and CUDA graphs,
# static verification, fused kernel: tests/engine/test_engine_default_config.py), the engine's float32 eager tests,
# the kernel benchmarks. Logs and CSVs go to $OUT; a short table comes last. Run on the GPU machine from the
# repository root after
#   source .gpu/gpu_setup.sh && python -m pip install --no-deps --no-build-isolation .
# (see docs/environment.md, GPU runs; pytest comes from .gpu/wheels when the image lacks it). DSBD_GPU_STEPS picks
# steps (kernel_tests needs no vLLM: it can run before the bundle is unpacked); DSBD_ENGINE_TESTS narrows engine_tests
# to some files; DSBD_<STEP>_S overrides a step's time limit.
set -u
OUT=${OUT:-/tmp/dsbd-gpu-out}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
if ! python -c "import pytest" 2>/dev/null && ls .gpu/wheels/pytest-*.whl >/dev/null 2>&1; then
  pip install -q --no-deps .gpu/wheels/{pytest,pluggy,iniconfig}-*.whl
fi
# -P: do not put the repository root on sys.path (our kernels folder must import as dsbd_kernels only)
PYTEST=(python -P -m pytest -q -p no:cacheprovider -rfE)

STEPS=${DSBD_GPU_STEPS:-kernel_tests default_config engine_tests bench_kernels bench_verify bench_bare full_graphs}
step() {  # step NAME SECONDS CMD...: runs CMD with a time limit, logs to $OUT/NAME.log, one summary line
  local name=$1 limit=$2 t0 rc
  shift 2
  [[ " $STEPS " == *" $name "* ]] || return 0
  t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%-16s rc=%-4s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" \
    "$(grep -E '^[0-9]+ (passed|failed)|passed|failed|error' "$OUT/$name.log" | tail -1 | cut -c1-90)" \
    | tee -a "$OUT/summary.txt"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null | tee -a "$OUT/gpu.txt"

step kernel_tests "${DSBD_KERNEL_TEST_S:-240}" "${PYTEST[@]}" -m gpu tests/kernels
# the user's default configuration (bf16, compiled, CUDA graphs, fused verification) against plain vLLM in it
step default_config "${DSBD_DEFAULT_CONFIG_S:-300}" "${PYTEST[@]}" -s -m gpu tests/engine/test_engine_default_config.py
step bench_kernels 120 python benchmarks/kernels/attention_kv.py --quick --csv "$OUT/bench_kernels.csv"
step bench_verify 90 python benchmarks/kernels/verify.py --quick --out "$OUT/verify"
# a step without forests (the cost model drafted nothing): narrow shapes against the full ones
step bench_bare 90 python benchmarks/kernels/verify_bare.py
# on CUDA the sampler takes the static verification paths and beam requests their device steps (beams equal to vLLM's
# LLM.beam_search in test_engine_beams; the static layer and forest paths equal to the general ones on CUDA tensors)
step engine_tests "${DSBD_ENGINE_TEST_S:-540}" "${PYTEST[@]}" -m gpu \
  ${DSBD_ENGINE_TESTS:-tests/unit tests/method tests/engine --ignore=tests/engine/test_engine_full_graphs_gpu.py \
   --ignore=tests/engine/test_engine_default_config.py}
# full CUDA graphs over passes without forest attention (setting full_cuda_graphs): tokens equal to eager
step full_graphs "${DSBD_FULL_GRAPHS_S:-400}" "${PYTEST[@]}" -s -m gpu tests/engine/test_engine_full_graphs_gpu.py

for f in bench_kernels bench_verify bench_bare; do [[ -f $OUT/$f.log ]] && { echo "== $f (last lines)"; tail -25 "$OUT/$f.log"; }; done
for f in kernel_tests default_config engine_tests full_graphs; do
  [[ -f $OUT/$f.log ]] && { echo "== $f (failures)"; grep -E "^(FAILED|ERROR) |^E  +[A-Za-z]*Error" "$OUT/$f.log" | head -15 | cut -c1-300; }
done
echo "== summary"
cat "$OUT/summary.txt"
