#!/usr/bin/env bash
# The benchmark harness (docs/benchmarks.md): builds the CPU environment if needed, then runs
# benchmarks/harness/harness.py, which writes results/bench/{results.csv,results.json,*.png,README.md}. Extra
# arguments pass through (e.g. --num-prompts 2).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup_env.sh
VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind} exec .venv/bin/python benchmarks/harness/harness.py "$@"
