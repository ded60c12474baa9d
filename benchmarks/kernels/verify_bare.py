"""``sampler.verify`` on a step in which no request has a forest (the cost model drafted nothing): the narrow shapes
(one parent slot, one layer, which takes the width-1 chain path; what the engine runs) against the engine's full
[G + 1, W, V] shapes, general and static paths, ms per call. Both get the same inputs and the script checks their tokens are equal before timing (least of
``--reps`` interleaved calls each; the machine may be shared: compare the columns of one run).

    python benchmarks/kernels/verify_bare.py [--width 4] [--depth 3] [--cases 1x128256 32x32000] [--reps 5]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def bare_step(R: int, V: int, W: int, G: int, seed: int = 0):
    """(logits [R, V], [RowPlan] without forests, DSBDConfig): T = 1 and T = 0 requests of width W."""
    from vllm_dsbd.config import DSBDConfig
    from vllm_dsbd.engine import sampler
    from vllm_dsbd.engine.state import RequestState

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, V, generator=gen) * 3.0
    plans = [sampler.RowPlan(state=RequestState(req_id=f"r{i}", seed=1000 + i, width=W, temperature=0.0 if i % 4 == 3
                                                else 1.0, top_k=0, top_p=1.0, eos=-1, max_tokens=None),
                             first_row=i, context_len=20 + i) for i in range(R)]
    return logits, plans, DSBDConfig(width=W, depth=G)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--cases", nargs="+", default=["1x128256", "32x32000"], help="RxV: requests x vocabulary")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from vllm_dsbd.engine import reads, sampler

    print(f"W = {args.width}, G = {args.depth}, {'cuda' if torch.cuda.is_available() else 'cpu'}; least of "
          f"{args.reps} calls, ms")
    print("| path | R | V | narrow | full | full / narrow |\n|---|---|---|---|---|---|")
    for case in args.cases:
        R, V = (int(x) for x in case.split("x"))
        logits, plans, cfg = bare_step(R, V, args.width, args.depth)
        for static in (False, True):
            def call(narrow):
                return reads.run(sampler.verify(logits, plans, cfg, forest_static=static, chain_static=static,
                                                 narrow_bare=narrow))
            a, b = call(True), call(False)
            if [r.tokens for r in a] != [r.tokens for r in b]:
                print("the two shapes disagree", file=sys.stderr)
                return 1
            t = {True: [], False: []}
            for _ in range(args.reps):
                for narrow in (True, False):
                    t0 = time.perf_counter()
                    call(narrow)
                    t[narrow].append(time.perf_counter() - t0)
            n, f = 1e3 * min(t[True]), 1e3 * min(t[False])
            print(f"| {'static' if static else 'general'} | {R} | {V} | {n:.1f} | {f:.1f} | {f / n:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
