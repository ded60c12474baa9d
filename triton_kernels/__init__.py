"""Triton kernels of vllm-dsbd, installed under the import name ``dsbd_kernels`` (never ``triton_kernels``).

Each kernel is a torch reference, a ``@triton.jit`` kernel and a thin wrapper; none imports vLLM.
"""

if __name__ == "triton_kernels":
    # Reached only when the repository root is on sys.path (e.g. `python -m ...` run from it). Triton publishes a
    # package of this name that vLLM probes with a trial import (vllm.utils.import_utils._has_module); failing here
    # makes vLLM see "not available" instead of importing our folder as Triton's MoE kernels.
    raise ImportError("this folder is vllm-dsbd's kernels package, importable as `dsbd_kernels`; "
                      "it is not Triton's `triton_kernels`")
