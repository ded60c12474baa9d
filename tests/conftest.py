"""Shared test setup: the helper modules beside the tests (chisq, kernel_utils, ...) are importable; the repository
root is NOT put on sys.path, so `import triton_kernels` can never resolve to our kernels folder."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
