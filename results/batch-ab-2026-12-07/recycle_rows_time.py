"""The recycle source's rows of a bare step (``bare.LateRows.add``: the RECYCLE_K = 8 best tokens of each row and their
log-probabilities) in three forms on this CPU's 2 threads, rows of SmolLM2's vocabulary (49,152), batch 1 / 8 / 32:
``log_softmax`` then ``topk`` (the engine's), ``topk`` then ``logsumexp``, ``topk`` then a hand-written logsumexp.
Checks the three agree, then prints each one's mean time over 50 calls after 5 warm ones.

    .venv/bin/python results/batch-ab-2026-12-07/recycle_rows_time.py
"""
import time

import torch

K, V = 8, 49152


def softmax_first(x):
    return torch.log_softmax(x, -1).topk(K)


def lse(x):
    v, i = x.topk(K)
    return v - torch.logsumexp(x, -1, keepdim=True), i


def lse_by_hand(x):
    v, i = x.topk(K)
    m = v[:, :1]
    return v - (m + (x - m).exp_().sum(-1, keepdim=True).log()), i


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    print("| rows | log_softmax + topk (ms) | topk + logsumexp (ms) | topk + logsumexp by hand (ms) |")
    print("|---|---|---|---|")
    for rows in (1, 8, 32):
        x = torch.randn(rows, V) * 3
        ref = softmax_first(x)
        for f in (lse, lse_by_hand):
            got = f(x)
            assert torch.equal(got[1], ref[1]) and torch.allclose(got[0], ref[0], atol=1e-5)
        ms = []
        for f in (softmax_first, lse, lse_by_hand):
            for _ in range(5):
                f(x)
            t0 = time.perf_counter()
            for _ in range(50):
                f(x)
            ms.append((time.perf_counter() - t0) / 50 * 1e3)
        print(f"| {rows} | " + " | ".join(f"{t:.3f}" for t in ms) + " |")


if __name__ == "__main__":
    main()
