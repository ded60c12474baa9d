#!/usr/bin/env bash
# Builds a slim vLLM 0.26.0 bundle for the GPU machine (Python 3.12, torch 2.11.0+cu130, no network), small
# enough to reach it in two transfers of at most 64 MiB. Run it from the project root on your own machine.
#
# Result, in the project root (the folder is added to .git/info/exclude; never commit it):
#   .gpu/vllm026.part-00, .gpu/vllm026.part-01   xz tarball of an installed --target tree, split in two
#   .gpu/gpu_setup.sh                            on the GPU machine: unpacks, exports PYTHONPATH and env
#
# On the GPU machine: both parts go to /tmp/gpu-parts/, then `source .gpu/gpu_setup.sh` (docs/environment.md, "GPU runs").
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
out=.gpu
mkdir -p "$out"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
if [[ -f $out/vllm026.part-01 && -f $out/gpu_setup.sh && ${FORCE:-0} != 1 ]]; then
  echo "bundle already in $out (FORCE=1 rebuilds)"; ls -la "$out"; exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
# The 28 packages that vLLM 0.26.0 imports for LLM(...), draft-model speculation, beam search and `vllm serve`
# on a dense model, and that the GPU image lacks (found by running, package by package).
deps=(annotated-types==0.8.0 apache-tvm-ffi==0.1.10 cachetools==8.0.1 cbor2==6.2.1 fastapi==0.136.3
      httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 jmespath==1.1.0 llguidance==1.7.6
      model-hosting-container-standards==0.1.16 msgspec==0.22.0 openai-harmony==0.0.8 openai==3.54.0
      partial-json-parser==0.2.1.1.post7 prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1
      pydantic==2.14.3 pydantic-core==2.50.4 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 supervisor==4.3.0
      truststore==0.10.5 typing-inspection==0.4.5 uvicorn==0.54.0 watchfiles==1.3.0 xgrammar==0.2.7)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/dl" vllm==0.26.0 "${deps[@]}"
# Drop what a dense model on Hopper never loads: FlashAttention 2 (FA3 is used on SM90), MoE and MLA kernels,
# Blackwell/FP8 third-party kernels, quantisation kernels and the Rust front end.
python3 - "$work/dl" <<'PY'
import sys, zipfile, pathlib
d = pathlib.Path(sys.argv[1])
whl = next(d.glob("vllm-0.26.0-*.whl"))
drop = ("vllm/vllm_flash_attn/_vllm_fa2_C", "vllm/_moe_C", "vllm/_flashmla", "vllm/_qutlass_C", "vllm/vllm-rs",
        "vllm/third_party/deep_gemm/", "vllm/third_party/fmha_sm100/", "vllm/third_party/tml_fa4/",
        "vllm/third_party/flashmla/")
slim = whl.with_suffix(".slim")
with zipfile.ZipFile(whl) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if not info.filename.startswith(drop):
            dst.writestr(info, src.read(info.filename))
slim.replace(whl)
PY
python3 -m pip install -q --no-deps --no-compile "${plat[@]}" --target "$work/site" "$work"/dl/*.whl
rm -rf "$work/site/bin"
tar -C "$work/site" -cf - . | xz -T0 -6 > "$work/vllm026.tar.xz"
split -n 2 -d -a 2 "$work/vllm026.tar.xz" "$out/vllm026.part-"
cat > "$out/gpu_setup.sh" <<'SH'
# source this on the GPU machine after both parts lie in /tmp/gpu-parts
if [[ ! -f /tmp/vllm026/.ok ]]; then
  mkdir -p /tmp/vllm026 && cat /tmp/gpu-parts/vllm026.part-* | xz -d -T0 | tar -x -C /tmp/vllm026 && touch /tmp/vllm026/.ok
fi
export PYTHONPATH=/tmp/vllm026${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0   # flashinfer is not in the bundle
python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available())'
SH
ls -la "$out"
