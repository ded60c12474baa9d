"""The chi-square helpers themselves: the merged tail of ``goodness_of_fit`` counts, and its small-count term is
calibrated (never flakier than a chi-square(1) term)."""
from __future__ import annotations

import math
from collections import Counter

from chisq import goodness_of_fit, tail_term


def test_mass_where_almost_nothing_is_expected_is_rejected():
    # 10 bins of expected 99.9 and 100 bins of expected 0.01 (tail: 1.0); 20 observations land in the tail
    probs = {**{f"b{i}": 0.0999 for i in range(10)}, **{f"r{i}": 0.00001 for i in range(100)}}
    bad = Counter({f"b{i}": 98 for i in range(10)})
    bad["r3"] = 20
    stat, df, thr = goodness_of_fit(bad, probs, 1000)
    assert df == 10 and stat > thr
    good = Counter({f"b{i}": 100 for i in range(10)})
    stat, df, thr = goodness_of_fit(good, probs, 1000)
    assert stat < thr


def test_zero_probability_outcome_is_infinite():
    assert goodness_of_fit(Counter({"a": 9, "z": 1}), {"a": 1.0}, 10)[0] == math.inf


def test_tail_term_is_calibrated():
    """Under the null (o ~ Poisson(e)), P(term > q) <= P(chi2_1 > q) = erfc(sqrt(q / 2)), for small e."""
    for e in (0.001, 0.05, 0.5, 1.0, 3.0, 4.99):
        for q in (3.84, 10.83, 30.0):
            p = sum(math.exp(-e + o * math.log(e) - math.lgamma(o + 1)) for o in range(200) if tail_term(o, e) > q)
            assert p <= math.erfc(math.sqrt(q / 2)) * (1 + 1e-9), (e, q, p)
    assert tail_term(3, 0.001) > 30 and tail_term(400, 0.001) == math.inf  # 3 where 0.001 is expected: p ~ 2e-10
