"""Host time of the cost model's choice (``cost.choose_shapes``) per step, by batch size: running sums against the
full sums it used until 2026-12-06, side by side.

    .venv/bin/python benchmarks/engine/choose_shapes_time.py [--batches 8 16 32 64 128 256] [--repeats 5]

"Before" is the same ``choose_shapes`` with ``_Step``'s ratio computed as it was (``math.fsum`` over every request's
expected tokens and a scan of every request's shape for a drafting one at each call: O(R) per call, R calls per sweep
and more, so O(R^2) a step) and the table's interpolation as it was (a list of its sizes built at every call); "after"
is the shipped code (running sums: O(depth) a call). Both choose the same shapes (checked here on every batch, and
in ``tests/unit/test_cost.py``). Batches: the default engine's plain requests (W = 2, G = 3: N' in {1, 2}, the
audit's case), and a mix of plain requests of W = 4 and T = 0 beam requests of W = 4, N = 16 (N' in 4, 6, 8, 11,
16). Rates are random per request (seeded); the table's passes are flat up to a few hundred tokens (a GPU's), so most
requests draft. Each cell is the best of ``--repeats`` runs, before and after alternating, in one process; prints a
markdown table.
"""
from __future__ import annotations

import argparse
import math
import platform
import random
import time

from vllm_dsbd.engine import cost
from vllm_dsbd.engine.cost import Candidate, CostTable, width_grid
from vllm_dsbd.testing.cost_reference import FsumStep, full_interp

TABLE = CostTable(target=((1, 0.010), (256, 0.011), (1024, 0.016), (4096, 0.050)),
                  draft=((1, 0.001), (256, 0.0012), (1024, 0.002)), step=0.002, draft_step=0.0005, node=2e-6)



def batch(kind: str, R: int, seed: int) -> list[Candidate]:
    rng = random.Random(seed)
    out = []
    for k in range(R):
        beam = kind == "mixed" and k % 2 == 1
        low, width = (4, 16) if beam else (1, 2 if kind == "plain" else 4)
        grid = width_grid(low, width)
        rates = sorted(rng.uniform(0.2, 0.9) for _ in grid)
        out.append(Candidate(leaves=low if beam else 1, width=width, depth=3, rate=rates[-1], catch_up=low,
                             options=tuple(zip(grid[:-1], rates[:-1]))[::-1]))
    return out


def timed(cands, repeats: int) -> tuple[float, float, list]:
    """(best seconds before, best seconds after, the shapes) of ``choose_shapes`` on ``cands``."""
    before, after, shapes = math.inf, math.inf, None
    real = cost._Step, cost._interp
    for _ in range(repeats):
        cost._Step, cost._interp = FsumStep, full_interp
        try:
            t0 = time.perf_counter()
            old = cost.choose_shapes(cands, TABLE)
            before = min(before, time.perf_counter() - t0)
        finally:
            cost._Step, cost._interp = real
        t0 = time.perf_counter()
        shapes = cost.choose_shapes(cands, TABLE)
        after = min(after, time.perf_counter() - t0)
        assert shapes == old, "the running sums chose other shapes"
    return before, after, shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    print(f"Python {platform.python_version()}, {platform.machine()}; best of {a.repeats}\n")
    print("| batch | R | before ms | after ms | before / after | shapes drafting |")
    print("|---|---|---|---|---|---|")
    for kind in ("plain", "mixed"):
        for R in a.batches:
            b, f, shapes = timed(batch(kind, R, R), a.repeats)
            name = "plain W = 2, G = 3" if kind == "plain" else "plain W = 4 + beam W = 4, N = 16; G = 3"
            print(f"| {name} | {R} | {1e3 * b:.2f} | {1e3 * f:.2f} | {b / f:.1f}x | "
                  f"{sum(1 for _, d in shapes if d)} of {R} |")


if __name__ == "__main__":
    main()
