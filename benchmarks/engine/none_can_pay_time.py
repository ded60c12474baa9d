"""Host time of the cost model's choice per step where no forest can pay, with and without the bound that returns at
once (``cost.none_can_pay``), by batch size.

    .venv/bin/python benchmarks/engine/none_can_pay_time.py [--batches 8 32 128 256] [--repeats 7]

A GPU-like table (flat 10-12 ms target passes, 1 ms draft passes, 2 ms a step) with a step's forest work priced as the
start-up probe prices it on a GPU-sized engine (30 ms a drafting step, 0.1 ms a node): at every batch size no forest
pays, so the full choice (every request's every shape tried, ``choose_shapes`` with the bound switched off) and the
bound both draft nothing (asserted). Plain requests of W = 2, depth 3 (N' in {1, 2}), rates random in 0.3-0.95
(seeded). Each cell is the best of ``--repeats`` runs; prints a markdown table.
"""
from __future__ import annotations

import argparse
import random
import time

from vllm_dsbd.engine import cost as cm
from vllm_dsbd.engine.cost import Candidate, CostTable, choose_shapes

TABLE = CostTable(target=((1, 0.010), (1024, 0.012)), draft=((1, 0.001), (1024, 0.001)), step=0.002,
                  draft_step=0.030, node=0.0001)


def _best(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128, 256])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(0)
    bound = cm.none_can_pay
    print("| requests | full choice ms | with the bound ms | full / bound |\n|---|---|---|---|")
    for n in args.batches:
        cands = []
        for _ in range(n):
            r1, r2 = sorted(rng.uniform(0.3, 0.95) for _ in range(2))
            cands.append(Candidate(leaves=1, width=2, depth=3, rate=r2, options=((1, r1),)))
        try:
            cm.none_can_pay = lambda cands, table: False
            full, a = _best(lambda: choose_shapes(cands, TABLE), args.repeats)
        finally:
            cm.none_can_pay = bound
        short, b = _best(lambda: choose_shapes(cands, TABLE), args.repeats)
        assert a == b and not any(d for _, d in a)
        print(f"| {n} | {1e3 * full:.3f} | {1e3 * short:.3f} | {full / short:.0f}x |")


if __name__ == "__main__":
    main()
