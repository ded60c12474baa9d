"""Shared helpers of the kernel tests: device choice, per-dtype tolerances, verbose comparisons, forest shapes.

Importing this module sets TRITON_INTERPRET=1 when there is no GPU; import it before ``dsbd_kernels`` (Triton
decides interpreted-or-compiled when the kernels' module is first imported).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsbd_kernels.forest_attention import beam_forest_parents  # noqa: E402  (after TRITON_INTERPRET)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"

# Forest attention vs its fp32 reference, per input dtype (atol, rtol). The kernel accumulates in fp32 but feeds the
# softmax weights to the P@V product in the input dtype, so the error is that dtype's rounding of P (and of out).
# Seen on CPU (interpreter): fp32 max error ~1e-6, fp16 ~1e-3 on |out| <= ~3.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),  # GPU only
}


def dtype_param(dtype: torch.dtype):
    """A pytest param for a kernel dtype; bf16 skips on CPU (tl.dot on bf16 is garbage in Triton's interpreter)."""
    name = str(dtype).removeprefix("torch.")
    marks = []
    if dtype == torch.bfloat16 and not ON_GPU:
        marks.append(pytest.mark.skip(reason="bf16 tl.dot is wrong in Triton's CPU interpreter; runs on GPU only"))
    return pytest.param(dtype, id=name, marks=marks)


def assert_verbose_allclose(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float,
                            what: str = "output", max_report: int = 5) -> None:
    """``torch.allclose`` (NaN never equal) with a report of where and how much it differs (Liger style)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double().cpu(), expected.double().cpu()
    bad = ~((a - e).abs() <= atol + rtol * e.abs())  # NaN compares False -> counted as bad
    if not bool(bad.any()):
        return
    idx = torch.nonzero(bad)
    diff = (a - e).abs().nan_to_num(float("inf"))
    lines = [f"{what}: {idx.shape[0]} of {a.numel()} elements differ (atol={atol}, rtol={rtol}); "
             f"NaN in actual: {int(a.isnan().sum())}, in expected: {int(e.isnan().sum())}; "
             f"max |diff| = {float(diff.max()):.3g}"]
    for i in idx[:max_report].tolist():
        lines.append(f"  at {tuple(i)}: actual {float(a[tuple(i)]):.6g}, expected {float(e[tuple(i)]):.6g}")
    raise AssertionError("\n".join(lines))


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """Exact equality of the bits (NaN payloads included), with the first differing positions."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    a, e = actual.cpu().view(as_int), expected.cpu().view(as_int)
    if torch.equal(a, e):
        return
    idx = torch.nonzero(a != e)
    raise AssertionError(f"{what}: {idx.shape[0]} of {a.numel()} elements differ, first at "
                         f"{[tuple(i) for i in idx[:5].tolist()]}")


# Forest shapes: parent arrays in local indices, -1 = hangs off the context.

def forest_parents(kind: str, n: int, seed: int = 0) -> list[int]:
    """``single`` (n = 1), ``chain``, ``star`` (one root, n - 1 children), ``random`` (one random tree),
    ``multi`` (several random trees), ``shuffled`` (a random tree numbered so parents may come after children),
    ``beamW`` (DSBD layers of width W, e.g. ``beam4``; n must be a multiple of W)."""
    rng = random.Random(seed)
    if kind == "single":
        assert n == 1
        return [-1]
    if kind == "chain":
        return [i - 1 for i in range(n)]
    if kind == "star":
        return [-1] + [0] * (n - 1)
    if kind == "random":
        return [-1] + [rng.randrange(i) for i in range(1, n)]
    if kind == "multi":
        roots = max(2, n // 4)
        return [-1] * roots + [rng.randrange(-1, i) for i in range(roots, n)]
    if kind == "shuffled":
        tree = [-1] + [rng.randrange(i) for i in range(1, n)]
        perm = list(range(n))
        rng.shuffle(perm)  # old index i becomes perm[i]
        out = [0] * n
        for i, p in enumerate(tree):
            out[perm[i]] = -1 if p < 0 else perm[p]
        return out
    if kind.startswith("beam"):
        w = int(kind[4:])
        assert n % w == 0
        return beam_forest_parents(w, n // w)
    raise ValueError(kind)


def root_path(parents: list[int], node: int) -> list[int]:
    """Nodes from the root down to ``node`` (inclusive)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def depth_of(parents: list[int], node: int) -> int:
    return len(root_path(parents, node)) - 1
