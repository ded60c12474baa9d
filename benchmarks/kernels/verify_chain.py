"""``sampler.verify`` at width 1 (chain forests): the chain fast path (``core/chain.py``) vs the general path, ms per
call, on a synthetic engine step (``vllm_dsbd.testing.chain_steps``, which the tests of ``test_verify_chain.py`` draw
their cases from too).

    python benchmarks/kernels/verify_chain.py [--batch 32] [--depth 3] [--vocabs 400 49152] [--reps 30]

A step: R requests, each with a chain drafted like the engine's drafter does (beam_step on the draft's logits with
the request's settings, DRAFT_DRAW stream), the draft's logits a noisy copy of the target's so that layers pass and
fail, and the logits rows of one target pass (the root, then one row after each scheduled node). Both paths get the
very same inputs; the script checks that their results are equal before timing them (median of ``--reps`` calls
each, interleaved; the machine may be shared: compare the two columns of one run).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from vllm_dsbd.testing.chain_steps import Req, build_step


def time_verify(R: int, G: int, V: int, reps: int, seed: int = 0) -> dict:
    from vllm_dsbd.engine import reads, sampler

    reqs = [Req(depth=G, noise=0.5 + 0.5 * (i % 3)) for i in range(R)]
    logits, plans, cfg = build_step(reqs, G, V, seed)
    fast = reads.run(sampler.verify(logits, plans, cfg))
    slow = reads.run(sampler.verify(logits, plans, cfg, chain_fast_path=False))
    assert fast == slow, "the chain fast path and the general path disagree"
    times = {True: [], False: []}
    for _ in range(reps):
        for on in (True, False):
            t0 = time.perf_counter()
            reads.run(sampler.verify(logits, plans, cfg, chain_fast_path=on))
            times[on].append(1e3 * (time.perf_counter() - t0))
    ms_fast, ms_gen = statistics.median(times[True]), statistics.median(times[False])
    return {"batch": R, "depth": G, "vocab": V, "fast_ms": ms_fast, "general_ms": ms_gen,
            "passed_mean": sum(r.passed for r in fast) / R}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[400, 49152])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| batch | depth | vocab | layers passed (mean) | general ms | chain fast path ms | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for V in args.vocabs:
        r = time_verify(args.batch, args.depth, V, args.reps)
        print(f"| {r['batch']} | {r['depth']} | {r['vocab']} | {r['passed_mean']:.2f} | {r['general_ms']:.2f} | "
              f"{r['fast_ms']:.2f} | {r['general_ms'] / r['fast_ms']:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
