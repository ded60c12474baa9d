"""Peak working memory of the penalties and of beam drafting's T = 0 top-N, chunked against unchunked (CPU).

Measures torch's CPU allocator peak (``vllm_dsbd.testing.mem_peak``) of:
  * penalties: ``penalties.penalize_target`` over every row of a step (unchunked, the engine until 2026-11-27) against
    ``sampler.penalized_chunk`` chunk by chunk (the chunk's rows copied, sparse counts), at R plain requests of depth
    G = 3, width W = 4 (13 rows each), with histories of H tokens;
  * the draft's penalties at one depth: ``DraftPenalties.apply_dense`` (``[R, W, V]`` counts) against ``apply``
    (sparse; both return a new ``[R, W, V]`` copy of the draft rows, which the drafter's step needs);
  * over-drafted beams: the T = 0 top-N as three float64 [R, N, V] at once against ``beams.drafter.top_n``.
Sizes are the issue's divided by ``--scale`` in V and the budget (so the chunk sizes are the full-size ones); memory
scales with V, so the last column multiplies back. Prints a markdown table.

    .venv/bin/python benchmarks/engine/memory_peaks.py --scale 8
"""
from __future__ import annotations

import argparse
import random

import torch

from vllm_dsbd.engine import chunks, penalties, sampler
from vllm_dsbd.engine.beams.drafter import top_n
from vllm_dsbd.engine.state import RequestState
from vllm_dsbd.testing.mem_peak import peak_bytes

G, W = 3, 4
NODES = G * W  # scheduled forest nodes per request


def _plans(R: int, V: int, H: int, rnd: random.Random):
    plans, targets = [], []
    pen = penalties.RequestPenalties(0.5, 0.5, 1.2)
    for i in range(R):
        first = i * (1 + NODES)
        st = RequestState(req_id=f"r{i}", seed=i, width=W, temperature=1.0, top_k=0, top_p=1.0, eos=-1,
                          max_tokens=None, penalties=pen)
        plans.append(sampler.RowPlan(state=st, first_row=first, context_len=H, num_nodes=NODES))
        tokens = [rnd.randrange(V) for _ in range(NODES)]
        parents = [-1 if c < W else c - W for c in range(NODES)]  # W chains of depth G
        targets.append(penalties.TargetRows(first, tokens, parents, [rnd.randrange(V) for _ in range(H // 2)],
                                            [rnd.randrange(V) for _ in range(H - H // 2)], pen))
    return plans, targets


def penalties_row(R: int, V: int, H: int, budget: int) -> tuple[int, int, int]:
    """(unchunked peak, chunked peak, requests per chunk) in bytes."""
    rnd = random.Random(R)
    plans, targets = _plans(R, V, H, rnd)
    logits = torch.randn(R * (1 + NODES), V)
    n = chunks.verify_chunk(G, W, V, budget, penalties=True)

    def chunked():
        for a in range(0, R, n):
            lg, _ = sampler.penalized_chunk(logits, plans[a : a + n], targets[a : a + n])
            del lg

    _, whole = peak_bytes(penalties.penalize_target, logits, targets)
    _, part = peak_bytes(chunked)
    return whole, part, n


def draft_row(R: int, V: int, H: int) -> tuple[int, int]:
    """(dense peak, sparse peak) of one draft beam step's penalties at depth G over R penalized requests."""
    rnd = random.Random(R)
    pen = penalties.DraftPenalties(list(range(R)), [[rnd.randrange(V) for _ in range(H // 2)] for _ in range(R)],
                                   [[rnd.randrange(V) for _ in range(H - H // 2)] for _ in range(R)],
                                   [penalties.RequestPenalties(0.5, 0.5, 1.2)] * R, W, V, "cpu")
    for _ in range(G - 1):
        pen.advance(torch.randint(0, W, (R, W)), torch.randint(0, V, (R, W)))
    full = torch.randn(R, W, V)
    _, dense = peak_bytes(pen.apply_dense, full)
    _, sparse = peak_bytes(pen.apply, full)
    return dense, sparse


def beams_row(R: int, N: int, V: int, budget: int) -> tuple[int, int, int]:
    rows = torch.randn(R, N, V)
    sc = torch.zeros(R, N, dtype=torch.float64)
    eos = [2] * R

    def whole():
        joint = torch.log_softmax(rows.double(), dim=-1) + sc[:, :, None]
        joint[:, :, 2] = -torch.inf
        return torch.topk(joint.flatten(1), N)

    _, w = peak_bytes(whole)
    _, c = peak_bytes(top_n, lambda a, b: rows[a:b], sc, eos, N, V, budget)
    return w, c, max(1, budget // (4 * N * V))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=int, default=8, help="divide V and the budget by this")
    ap.add_argument("--history", type=int, default=1024, help="prompt + output tokens per request")
    a = ap.parse_args()
    s = a.scale
    budget = chunks.VERIFY_BUDGET // s
    mib = 2.0**20
    print(f"budget {chunks.VERIFY_BUDGET} / {s} float32 elements ({4 * budget / mib:.0f} MiB); torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| work | size (issue's, V / %d) | unchunked peak MiB | chunked peak MiB | per chunk | full size, "
          "unchunked -> chunked (x %d) |" % (s, s))
    print("|---|---|---|---|---|---|")
    for R in (64, 256):
        V = 152064 // s
        w, c, n = penalties_row(R, V, a.history, budget)
        print(f"| penalties | R = {R}, V = {V}, 13 rows, H = {a.history} | {w / mib:.1f} | {c / mib:.1f} | {n} "
              f"requests | {w * s / 2**30:.2f} GiB -> {c * s / mib:.0f} MiB |")
    for R in (64, 256):
        V = 152064 // s
        w, c = draft_row(R, V, a.history)
        print(f"| draft penalties (one depth) | R = {R}, W = {W}, V = {V}, H = {a.history} | {w / mib:.1f} | "
              f"{c / mib:.1f} | - | {w * s / 2**30:.2f} GiB -> {c * s / mib:.0f} MiB |")
    for R in (64,):
        N, V = 16, 128000 // s
        w, c, n = beams_row(R, N, V, budget)
        print(f"| beam top-N (T = 0) | R = {R}, N = {N}, V = {V} | {w / mib:.1f} | {c / mib:.1f} | {n} requests | "
              f"{w * s / 2**30:.2f} GiB -> {c * s / mib:.0f} MiB |")


if __name__ == "__main__":
    main()
