"""Chi-square tests that never flake, and what they can see.

Thresholds: the chi-square(df) quantile at tail probability :data:`P_NULL` = 1e-6 (about df + 5 sqrt(2 df) for large
df, more for small df, where that formula's tail is up to 1e-3), so a correct test fails once in a million runs.
Bins with expected count < 5 are merged into one tail bin that always counts. :func:`mde_tv` is a test's minimum
detectable effect: the smallest total-variation distance (over the test's bins) at which EVERY wrong law is rejected
with probability :data:`POWER` at that sample size (a wrong law's chi-square divergence is at least 4 TV^2, so its
noncentrality is at least 4 N TV^2, or 2 N TV^2 for two samples of N each).
"""
from __future__ import annotations

import functools
import math
from collections import Counter

P_NULL = 1e-6  # a correct test's chance of failing
POWER = 0.99  # the chance that a wrong law at the minimum detectable effect is rejected


def chi2_sf(x: float, df: float) -> float:
    """P(chi-square(df) > x): the regularised upper incomplete gamma Q(df / 2, x / 2)."""
    a, z = df / 2.0, x / 2.0
    if z <= 0.0:
        return 1.0
    log_front = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1.0:  # series for P(a, z), then Q = 1 - P
        term = total = 1.0 / a
        k = a
        while abs(term) > 1e-17 * abs(total):
            k += 1.0
            term *= z / k
            total += term
        return max(0.0, 1.0 - math.exp(log_front) * total)
    # continued fraction for Q(a, z) (modified Lentz)
    tiny = 1e-300
    b = z + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(log_front) * h


@functools.lru_cache(maxsize=None)
def threshold(df: int, p: float = P_NULL) -> float:
    """The chi-square(df) value exceeded with probability ``p`` under the null."""
    lo, hi = 0.0, df + 40.0 * math.sqrt(2.0 * df) + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > p else (lo, mid)
    return hi


def noncentral_sf(x: float, df: int, lam: float) -> float:
    """P(noncentral chi-square(df, lam) > x), as a Poisson(lam / 2) mixture of central chi-squares."""
    h = lam / 2.0
    if h == 0.0:
        return chi2_sf(x, df)
    top = int(h + 12.0 * math.sqrt(h) + 30)
    return sum(math.exp(-h + j * math.log(h) - math.lgamma(j + 1)) * chi2_sf(x, df + 2 * j) for j in range(top + 1))


@functools.lru_cache(maxsize=None)
def noncentrality(df: int, power: float = POWER, p: float = P_NULL) -> float:
    """The noncentrality at which the test at :func:`threshold` rejects with probability ``power``."""
    thr, lo, hi = threshold(df, p), 0.0, 10.0 * (threshold(df, p) + 100.0)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if noncentral_sf(thr, df, mid) < power else (lo, mid)
    return hi


def mde_tv(n: int, df: int, two_sample: bool = False, power: float = POWER) -> float:
    """Minimum detectable effect in total variation of a test with ``df`` degrees of freedom on ``n`` draws (two
    samples: ``n`` each): every law at least this far (over the test's bins) is rejected with probability ``power``."""
    return math.sqrt(noncentrality(df, power) / ((2.0 if two_sample else 4.0) * n))


def n_for_mde(tv: float, df: int, two_sample: bool = False, power: float = POWER) -> int:
    """The sample size at which :func:`mde_tv` is ``tv``."""
    return math.ceil(noncentrality(df, power) / ((2.0 if two_sample else 4.0) * tv * tv))


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


def report(name: str, stat: float, df: int, thr: float, n: int | None = None, two_sample: bool = False) -> str:
    """One line: the statistic against its threshold and, given the sample size ``n``, the test's MDE."""
    line = f"{name}: chi2={stat:.1f} df={df} threshold={thr:.1f}" + _mde(n, df, two_sample)
    print(line)
    return line


def report_power(name: str, correct: tuple, planted: tuple, variant: str, n: int | None = None,
                 two_sample: bool = False) -> str:
    """One line: the statistic of the code under test and that of a planted wrong variant (the power check)."""
    line = (f"{name}: chi2={correct[0]:.1f} df={correct[1]} threshold={correct[2]:.1f} | planted {variant}: "
            f"chi2={planted[0]:.1f} df={planted[1]} threshold={planted[2]:.1f}" + _mde(n, correct[1], two_sample))
    print(line)
    return line


def _mde(n: int | None, df: int, two_sample: bool) -> str:
    return "" if n is None else f" | N={n}{' each' if two_sample else ''}, MDE TV={mde_tv(n, df, two_sample):.3f}"


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
