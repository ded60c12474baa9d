#!/usr/bin/env bash
# The main job (README): builds the CPU environment if needed, then runs DSBD through vLLM on SmolLM2-135M as a user
# gets it (draft-free sources, cost model on) side by side with plain vLLM. Extra arguments go to
# benchmarks/engine/demo_vllm.py (e.g. --width 4 --depth 3, --draft, --pinned).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup_env.sh
VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind} exec .venv/bin/python benchmarks/engine/demo_vllm.py "$@"
