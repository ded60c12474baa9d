"""The CPU path of forest attention as a pass runs it: ``attention.recompute_forest_outputs`` in every layer of one
forward pass (the batch's ``ForestBatch`` built once), on a CPU_ATTN cache, at SmolLM2-135M's shape (30 layers, 9 heads
over 3 kv heads, head size 64, block 128, float32), each request a width-2 depth-3 forest (6 nodes, the README
engine's) at a given context. Prints ms per pass (least and median of REPEATS) and aten operations per layer.

    .venv/bin/python benchmarks/kernels/forest_attention_cpu.py [--requests 1 8 32] [--context 128 256 512]

Uses only the engine's entry point, so the same script times any commit (results/forest-attention-cpu-2026-12-06).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_dsbd.engine.attention import ForestBatch, ForestEntry, drop_chain_queries, recompute_forest_outputs

LAYERS, HEADS, KV_HEADS, HEAD, BLOCK = 30, 9, 3, 64, 128
PARENTS = [-1, -1, 0, 1, 2, 3]  # width 2, depth 3, as the draft-free drafter lays a forest out
REPEATS = 15


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _case(reqs: int, ctx: int, gen: torch.Generator):
    entries, t = [], 0
    n = len(PARENTS)
    for i in range(reqs):
        entries.append(drop_chain_queries(ForestEntry(i, list(range(t + 1, t + 1 + n)), ctx, PARENTS,
                                                      list(range(n)))))
        t += 1 + n
    per = -(-(ctx + n) // BLOCK)
    caches = [torch.randn(reqs * per, KV_HEADS, BLOCK, 2 * HEAD, generator=gen) for _ in range(LAYERS)]
    table = torch.randperm(reqs * per, generator=gen).view(reqs, per).to(torch.int32)
    query = torch.randn(t, HEADS, HEAD, generator=gen)
    return entries, caches, table, query


def run(reqs: int, ctx: int) -> tuple[float, float, int]:
    gen = torch.Generator().manual_seed(0)
    entries, caches, table, query = _case(reqs, ctx, gen)
    out = torch.zeros_like(query)
    scale = HEAD ** -0.5

    def one_pass():
        batch = ForestBatch.build(entries, max_nodes=64)
        for cache in caches:
            recompute_forest_outputs(batch, query, cache, table, scale, out, "torch")
        return batch

    for _ in range(2):
        batch = one_pass()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - t0)
    ops = _Ops()
    with ops:  # a layer after the pass's first (which makes whatever the pass shares)
        recompute_forest_outputs(batch, query, caches[0], table, scale, out, "torch")
    return 1e3 * min(times), 1e3 * statistics.median(times), ops.n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[128, 256, 512])
    args = ap.parse_args()
    print(f"torch threads {torch.get_num_threads()}; {LAYERS} layers, {HEADS}/{KV_HEADS} heads, head {HEAD}, block "
          f"{BLOCK}, {len(PARENTS)} nodes a request")
    print("| requests | context | ms a pass (least) | ms a pass (median) | ops a layer |")
    print("|---|---|---|---|---|")
    for r in args.requests:
        for c in args.context:
            lo, med, ops = run(r, c)
            print(f"| {r} | {c} | {lo:.1f} | {med:.1f} | {ops} |", flush=True)


if __name__ == "__main__":
    main()
