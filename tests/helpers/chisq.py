"""Chi-square tests that never flake: threshold df + 10 * sqrt(2 df) (about 10 standard deviations of the statistic
under the null), bins with expected count < 5 merged into one tail bin that always counts."""
from __future__ import annotations

import math
from collections import Counter


def threshold(df: int) -> float:
    return df + 10.0 * math.sqrt(2.0 * df)


def goodness_of_fit(counts: Counter, probs: dict, n: int) -> tuple[float, int, float]:
    """Observed counts vs exact probabilities. Outcomes with probability 0 that were observed make the statistic
    infinite. Bins with expected count < 5 are merged into one tail bin, which always counts: with expected count >= 5
    as an ordinary bin, below 5 through ``tail_term`` (so mass observed where almost nothing is expected makes the
    statistic blow up, without a small expected count making the test flaky). Returns (statistic, df, threshold)."""
    if any(c > 0 and probs.get(k, 0.0) <= 0.0 for k, c in counts.items()):
        return math.inf, 1, threshold(1)
    stat, bins, rest_o, rest_e = 0.0, 0, 0, 0.0
    for k, p in probs.items():
        e, o = n * p, counts.get(k, 0)
        if e < 5:
            rest_o, rest_e = rest_o + o, rest_e + e
            continue
        stat += (o - e) ** 2 / e
        bins += 1
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e if rest_e >= 5 else tail_term(rest_o, rest_e)
        bins += 1
    df = max(bins - 1, 1)
    return stat, df, threshold(df)


def tail_term(o: int, e: float) -> float:
    """A bin with small expected count e < 5 and observed count o, as a chi-square(1) term that is calibrated: the
    Pearson term (o - e)^2 / e is heavy-tailed there (e = 0.01 and o = 1, a 1% event, gives 98), so an excess is
    scored by its exact Poisson tail probability instead, mapped to the chi-square(1) value with the same tail. A
    deficit (o <= e) scores (o - e)^2 / e <= e < 5. Underflow (an impossible excess) scores infinity."""
    if o <= e:
        return (o - e) ** 2 / e
    # P(X >= o) for X ~ Poisson(e), summed upwards from o (the terms fall fast since o > e)
    term = math.exp(-e + o * math.log(e) - math.lgamma(o + 1))
    tail, k = 0.0, o
    while term > 1e-17 * tail or tail == 0.0:
        tail += term
        k += 1
        term *= e / k
        if term == 0.0:
            break
    if tail <= 0.0:
        return math.inf
    # the chi-square(1) value q with P(chi2_1 > q) = erfc(sqrt(q / 2)) = tail, by bisection on x = sqrt(q / 2)
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erfc(mid) > tail else (lo, mid)
    return 2.0 * lo * lo


def two_sample(a: Counter, b: Counter) -> tuple[float, int, float]:
    """Two samples of equal size: sum (a - b)^2 / (a + b) over bins, bins with a + b < 10 merged."""
    assert sum(a.values()) == sum(b.values())
    stat, bins, ra, rb = 0.0, 0, 0, 0
    for k in set(a) | set(b):
        x, y = a.get(k, 0), b.get(k, 0)
        if x + y < 10:
            ra, rb = ra + x, rb + y
            continue
        stat += (x - y) ** 2 / (x + y)
        bins += 1
    if ra + rb > 0:
        stat += (ra - rb) ** 2 / (ra + rb)
        bins += 1
    df = max(bins - 1, 1)
    return stat, df, threshold(df)


def report(name: str, stat: float, df: int, thr: float) -> str:
    line = f"{name}: chi2={stat:.1f} df={df} threshold={thr:.1f}"
    print(line)
    return line


def report_power(name: str, correct: tuple, planted: tuple, variant: str) -> str:
    """One line: the statistic of the code under test and that of a planted wrong variant (the power check)."""
    line = (f"{name}: chi2={correct[0]:.1f} df={correct[1]} threshold={correct[2]:.1f} | planted {variant}: "
            f"chi2={planted[0]:.1f} df={planted[1]} threshold={planted[2]:.1f}")
    print(line)
    return line


def ordered_without_replacement_law(p, k: int) -> dict:
    """Exact law of the ordered k-tuple of sequential draws without replacement from the probabilities p [J]."""
    p = [float(x) for x in p]
    out = {}

    def rec(prefix, mass, left):
        if len(prefix) == k:
            out[tuple(prefix)] = mass
            return
        for z, pz in enumerate(p):
            if pz > 0 and z not in prefix:
                rec(prefix + [z], mass * pz / left, left - pz)

    rec([], 1.0, 1.0)
    return out
