"""Shared test setup.

- The helper modules beside the tests (chisq, kernel_utils, ...) are importable; the repository root is NOT put on
  sys.path, so `import triton_kernels` can never resolve to our kernels folder.
- Without a GPU, Triton kernels run in the interpreter. Triton decides this when our kernels are first imported, so
  the variable is set here, before any test module imports them.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
