"""Small host-side helpers shared by the kernel wrappers (no Triton code, no vLLM)."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` runs in Triton's CPU interpreter.

    Triton fixes this when the kernel's module is imported (``TRITON_INTERPRET=1`` at that moment), so set the
    variable before the first import of ``dsbd_kernels``; the kernel object then tells the truth.
    """
    return isinstance(kernel, InterpretedFunction)


def require(cond: bool, msg: str) -> None:
    """Raise ``ValueError(msg)`` unless ``cond``: the wrappers' contract check."""
    if not cond:
        raise ValueError(msg)


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    require(t.device == device, f"{name} is on {t.device}, expected {device} (all tensors on one device)")


def check_launchable(kernel, device: torch.device, what: str, reference: str) -> None:
    """Compiled kernels need CUDA tensors; CPU tensors need the interpreter."""
    if device.type == "cpu":
        require(
            is_interpreted(kernel),
            f"{what}: CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 set before dsbd_kernels is first "
            f"imported); on CPU the torch reference {reference} is the fast path",
        )
