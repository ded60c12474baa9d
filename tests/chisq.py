"""Chi-square tests that never flake: threshold df + 10 * sqrt(2 df) (about 10 standard deviations of the statistic
under the null), bins with expected count < 5 merged into one."""
from __future__ import annotations

import math
from collections import Counter


def threshold(df: int) -> float:
    return df + 10.0 * math.sqrt(2.0 * df)


def goodness_of_fit(counts: Counter, probs: dict, n: int) -> tuple[float, int, float]:
    """Observed counts vs exact probabilities. Outcomes with probability 0 that were observed make the statistic
    infinite. Returns (statistic, df, threshold)."""
    if any(c > 0 and probs.get(k, 0.0) <= 0.0 for k, c in counts.items()):
        return math.inf, 1, threshold(1)
    stat, bins, rest_o, rest_e = 0.0, 0, 0, 0.0
    for k, p in probs.items():
        e = n * p
        if e < 5:
            rest_o += counts.get(k, 0)
            rest_e += e
            continue
        stat += (counts.get(k, 0) - e) ** 2 / e
        bins += 1
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / max(rest_e, 1e-12) if rest_e >= 1 else 0.0
        bins += rest_e >= 1
    df = max(bins - 1, 1)
    return stat, df, threshold(df)


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
