"""The chi-square helpers themselves: the merged tail of ``goodness_of_fit`` counts, and its small-count term is
calibrated (never flakier than a chi-square(1) term); the thresholds are the chi-square quantiles at 1e-6; the minimum
detectable effect is what it says: a law exactly that far in total variation, in the direction hardest to see, is
rejected in >= 97.5% of simulated tests (0.99 expected), one and two samples."""
from __future__ import annotations

import math
from collections import Counter

import torch

import chisq
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


def test_thresholds_are_quantiles_at_one_in_a_million():
    assert abs(chisq.chi2_sf(3.841459, 1) - 0.05) < 1e-6 and abs(chisq.chi2_sf(18.307038, 10) - 0.05) < 1e-6
    assert abs(chisq.threshold(1) - 23.928) < 1e-2 and abs(chisq.threshold(10) - 46.856) < 1e-2
    for df in (1, 3, 27, 100, 700):
        assert abs(chisq.chi2_sf(chisq.threshold(df), df) / chisq.P_NULL - 1) < 1e-3
        assert chisq.threshold(df) >= df + 5 * math.sqrt(2 * df)  # never below the rule of thumb (small df: far above)


def test_noncentral_tail_matches_simulation():
    g = torch.Generator().manual_seed(0)
    df, lam, x = 6, 20.0, 30.0
    mean = torch.zeros(df, dtype=torch.float64)
    mean[0] = math.sqrt(lam)
    draws = ((torch.randn(200_000, df, generator=g, dtype=torch.float64) + mean) ** 2).sum(1)
    assert abs(float((draws > x).double().mean()) - chisq.noncentral_sf(x, df, lam)) < 0.005


def _hardest(tv: float, bins: int) -> tuple[list, list]:
    """A uniform law over ``bins`` bins and one at total variation ``tv`` whose chi-square divergence is 4 tv^2 (the
    least any law that far has: the one a test sees worst)."""
    p = [1.0 / bins] * bins
    return p, [pi * (1 + 2 * tv * (1 if i % 2 else -1)) for i, pi in enumerate(p)]


def test_mde_one_sample_is_met():
    n, bins, trials = 2000, 10, 2000
    tv = chisq.mde_tv(n, bins - 1)
    p, q = _hardest(tv, bins)
    g = torch.Generator().manual_seed(1)
    draws = torch.multinomial(torch.tensor(q, dtype=torch.float64), n * trials, replacement=True, generator=g)
    rejected = 0
    for row in draws.view(trials, n):
        stat, df, thr = goodness_of_fit(Counter(row.tolist()), dict(enumerate(p)), n)
        assert df == bins - 1
        rejected += stat > thr
    assert rejected / trials >= 0.975, (tv, rejected)


def test_mde_two_sample_is_met():
    n, bins, trials = 2000, 10, 1000
    tv = chisq.mde_tv(n, bins - 1, two_sample=True)
    p, q = _hardest(tv, bins)
    g = torch.Generator().manual_seed(2)
    a = torch.multinomial(torch.tensor(p, dtype=torch.float64), n * trials, replacement=True, generator=g)
    b = torch.multinomial(torch.tensor(q, dtype=torch.float64), n * trials, replacement=True, generator=g)
    rejected = sum(chisq.two_sample(Counter(x.tolist()), Counter(y.tolist()))[0] > chisq.threshold(bins - 1)
                   for x, y in zip(a.view(trials, n), b.view(trials, n)))
    assert rejected / trials >= 0.975, (tv, rejected)
    assert chisq.n_for_mde(tv, bins - 1, two_sample=True) in (n, n + 1)
