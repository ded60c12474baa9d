"""Host time of the cost model's choice with and without the batch's end (ad-hoc, this page's): ``choose_shapes``
on random batches shaped like the README job's (width 2, depth 3, N' = 1 beside it, rates 0.2-1.0 or code-like
0.85-1.0, 0-32 layers of evidence; the job's corrected CPU table of 2026-12-07), all tied at 48 tokens left or
spread over 1-48, floors by tokens left; median microseconds a choice over 300 batches, and how many chose a forest
(the output, choose_time.txt, at 321bf40).

    .venv/bin/python results/batch-end-2026-12-07/choose_time.py
"""
import dataclasses
import random
import statistics
import time

from vllm_dsbd.engine.cost import Candidate, CostTable, choose_shapes, request_floors

TARGET_MS = {1: 27.11, 2: 27.11, 4: 27.11, 8: 32.29, 16: 41.98, 32: 64.47, 64: 104.81, 128: 192.65, 256: 374.55}
TABLE = dataclasses.replace(CostTable.from_times({n: t / 1e3 for n, t in TARGET_MS.items()}, {1: 0.0}, 9.88e-3),
                            draft_step=5.07e-3, node=0.616e-3)


def batch(rng, n, tied, low):
    cands = []
    for _ in range(n):
        a = rng.uniform(low, 1.0)
        cands.append(Candidate(1, 2, 3, a, options=((1, a * 0.8),), tried=float(rng.randint(0, 32))))
    left = [48] * n if tied else [rng.randint(1, 48) for _ in range(n)]
    return cands, left


def timed(fn):
    t0 = time.perf_counter()
    got = fn()
    return (time.perf_counter() - t0) * 1e6, any(d for _, d in got)


rng = random.Random(0)
print("| requests | rates | tokens left | floors alone: median us (forests chosen) "
      "| with the batch's end: median us (forests chosen) |\n|---|---|---|---|---|")
for n, low, tied in [(n, low, tied) for n in (8, 32, 128) for low in (0.2, 0.85) for tied in (True, False)]:
    a, b = [], []
    for _ in range(300):
        cands, left = batch(rng, n, tied, low)
        floors = request_floors(left)
        a.append(timed(lambda: choose_shapes(cands, TABLE, floor=floors)))
        b.append(timed(lambda: choose_shapes(cands, TABLE, floor=floors, left=left)))
    print(f"| {n} | {low}-1.0 | {'all 48' if tied else '1-48'} | {statistics.median(t for t, _ in a):.0f} "
          f"({sum(f for _, f in a)}) | {statistics.median(t for t, _ in b):.0f} ({sum(f for _, f in b)}) |")
