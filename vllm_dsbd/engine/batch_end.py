"""An offline batch's end as the cost model prices it (``cost.choose_shapes(..., left=)``): the expected drop of the
most tokens left over the batch's requests in one step, an order statistic of their gains, not one request's gain.

While no request waits, an offline batch ends with its last request. After a step where request i emits ``X_i``
tokens (``P(X_i >= k + 1) = a_i^k`` for ``k <= d_i``, its forest's depth), the most tokens left is
``max_i (R_i - X_i)``; the step moves the batch's end by ``E_end = R_max - E[max_i (R_i - X_i)]`` tokens, where the
minimal step (no forest) moves it by 1. With several requests tied at ``R_max`` (the README job: six of eight run to
``max_tokens``), the end moves past 1 only where every tied request passes: ``E_end <= 1 + sum_k prod_i a_i^k``, far
below each one's own ``E_i``. The cost model keeps ``E_end / T >= LAST_FLOOR / T_min``; the rule is one step ahead
(a policy improvement over never drafting: never expected to end the batch later than plain vLLM's step by more than
1 / LAST_FLOOR). Each rate is judged optimistically, at the upper confidence bound of the evidence behind it
(:meth:`End.hope`): a product of rates is harsh on estimates still near the prior, and a request's rate is learnt
only from its forests, so tied requests whose draft passes (a self-draft) would otherwise never draft again; with
evidence the bound falls to the estimate. Imports neither vLLM nor torch.
"""
from __future__ import annotations

from collections.abc import Sequence

from .acceptance import rate_bound


class End:
    """The batch's end for the tokens each request has left, ``left``, and the layers of evidence behind each one's
    rate, ``tried`` (the order of the step's candidates)."""

    def __init__(self, left: Sequence[int], tried: Sequence[float] | None = None):
        most = max(left)
        gaps = [most - max(r, 0) for r in left]
        self.tied = [i for i, g in enumerate(gaps) if g == 0]
        self.near = sorted(((g, i) for i, g in enumerate(gaps)))  # requests by their gap to the most left
        self.tried = list(tried) if tried is not None else [0.0] * len(left)

    def hope(self, i: int, a: float) -> float:
        """Request i's rate ``a`` at the upper confidence bound of its evidence, ``a + sqrt(a (1 - a) / (PRIOR_WEIGHT
        + tried))``, at most 1 (``acceptance.rate_bound``, the bound of ``upper_rate``)."""
        return rate_bound(a, self.tried[i])

    def tokens(self, rates: Sequence[float], depths: Sequence[int]) -> float:
        """``E_end`` with request i at per-layer rate ``hope(i, rates[i])`` and depth ``depths[i]`` (0: no forest):
        ``sum_z P(min_i (gap_i + X_i) >= z)``, each factor ``a_i^(z - gap_i - 1)`` (0 past its depth)."""
        top = min(depths[i] for i in self.tied) + 1  # the end moves at most this far
        total = 1.0
        for z in range(2, top + 1):
            p = 1.0
            for g, i in self.near:
                k = z - 1 - g  # layers request i must pass so that it keeps the end at least z lower
                if k <= 0:
                    break  # (the rest are further behind: they cannot hold the end this high)
                if k > depths[i]:
                    return total
                p *= self.hope(i, rates[i]) ** k
            total += p
        return total

    def bound(self, rates: Sequence[Sequence[float]], depths: Sequence[int]) -> float:
        """An upper bound of :meth:`tokens` over every shape: the tied requests alone, each at the highest of its
        rates ``rates[i]`` (one per N') as :meth:`hope` judges them and its deepest ``depths[i]``:
        ``1 + rho + ... + rho^D`` (``rho`` their product, ``D`` their least depth)."""
        rho, depth = 1.0, min(depths[i] for i in self.tied)
        for i in self.tied:
            rho *= max(self.hope(i, a) for a in rates[i])
        return sum(rho ** k for k in range(depth + 1))
