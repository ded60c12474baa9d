"""Triton kernels of vllm-dsbd, installed under the import name ``dsbd_kernels`` (never ``triton_kernels``).

Each kernel is a torch reference, a ``@triton.jit`` kernel and a thin wrapper; none imports vLLM.
"""
