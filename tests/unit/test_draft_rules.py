"""The draft-set rules of ``vllm_dsbd.testing.draft_rules`` (what ``benchmarks/engine/draft_rules.py`` measures) are
exact, and their acceptance numbers are right.

Law: per rule and N, the emitted token of 20,000 independent layers against p (chi-square, ``chisq`` thresholds);
power: the same statistic rejects planted wrong variants: point-mass drafts (greedy, top) accepted with
min(1, T / q) as if they were sampled from q, the engine's without-replacement drafts verified with the
with-replacement law (Q_j = q), and i.i.d. drafts with the residual dropped (T left as it was after a rejection).
Acceptance: the closed forms equal the mean conditional acceptance and the counted accepts (within 6 standard
errors); the without-replacement rule's Monte Carlo equals its exact value by enumeration of the ordered draft sets,
and the engine's own layer (``core.verify.verify_layer``) accepts as often.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from chisq import goodness_of_fit, ordered_without_replacement_law, report_power
from vllm_dsbd.core import rng
from vllm_dsbd.core.sampling import gumbel_topk
from vllm_dsbd.core.verify import verify_layer
from vllm_dsbd.testing import draft_rules as dr

V, DRAWS = 6, 20_000


def _pq():
    """A target p and a draft q far from it (q's favourites are p's rare tokens), so rejections and residuals
    matter: p = [.40 .25 .15 .10 .06 .04], q = [.05 .10 .10 .15 .25 .35]."""
    p = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=torch.float64)
    q = torch.tensor([0.05, 0.10, 0.10, 0.15, 0.25, 0.35], dtype=torch.float64)
    return p, q


def _chi2(tokens: torch.Tensor, p: torch.Tensor):
    counts = Counter(tokens.tolist())
    return goodness_of_fit(counts, {i: float(p[i]) for i in range(V)}, tokens.numel())


def _rrs_dropped_residual(p, q, drafts, u, r):
    """Planted: ``rrs`` with i.i.d. laws but T never updated after a rejection."""
    D, n = drafts.shape
    token = torch.full((D,), -1, dtype=torch.int64)
    done = torch.zeros(D, dtype=torch.bool)
    for j in range(n):
        z = drafts[:, j]
        acc = ~done & (u[:, j] < (p[z] / q[z]).clamp(max=1.0))
        token, done = torch.where(acc, z, token), done | acc
    y = torch.searchsorted(p.cumsum(0), r).clamp(max=V - 1)
    return torch.where(done, token, y)


def _planted(rule: str, p, q, n, gen):
    drafts = dr.draw(rule, q, n, DRAWS, gen)
    u = torch.rand(DRAWS, n, dtype=torch.float64, generator=gen)
    r = torch.rand(DRAWS, dtype=torch.float64, generator=gen)
    if rule == "iid":
        return _rrs_dropped_residual(p, q, drafts, u, r), "dropped residual"
    as_q = (lambda j: q[None, :].expand(DRAWS, V))  # every draft's law taken as q
    what = "with-replacement law" if rule == "wor" else "point masses accepted as if drawn from q"
    return dr.rrs(p, rule, q, drafts, u, r, laws=as_q)[0], what


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rule", dr.RULES)
def test_rule_emits_p_and_planted_variant_is_rejected(rule, n):
    p, q = _pq()
    gen = torch.Generator().manual_seed(100 * n + dr.RULES.index(rule))
    tok, _, _ = dr.sample(rule, p, q, n, DRAWS, gen)
    good = _chi2(tok, p)
    bad_tok, what = _planted(rule, p, q, n, gen)
    bad = _chi2(bad_tok, p)
    report_power(f"{rule} N={n}", good, bad, what, n=DRAWS)
    assert good[0] < good[2], f"{rule} N={n}: emitted law differs from p (chi2 {good[0]:.1f} > {good[2]:.1f})"
    assert bad[0] > bad[2], f"{rule} N={n}: planted {what} not rejected (chi2 {bad[0]:.1f})"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("rule", ["iid", "greedy", "greedy_zfirst", "top"])
def test_closed_form_equals_monte_carlo(rule, n):
    p, q = _pq()
    gen = torch.Generator().manual_seed(7 + n)
    exact = dr.exact_acceptance(rule, p, q, n)
    _, acc, cond = dr.sample(rule, p, q, n, DRAWS, gen)
    freq, se_freq = float(acc.double().mean()), float(acc.double().std()) / DRAWS**0.5
    mean, se = dr.mc_acceptance(rule, p, q, n, DRAWS, gen)
    print(f"{rule} N={n}: exact {exact:.4f}, counted {freq:.4f} ± {se_freq:.4f}, conditional {mean:.4f} ± {se:.4f}")
    assert abs(freq - exact) < 6 * se_freq + 1e-12
    assert abs(mean - exact) < 6 * se + 1e-12
    assert abs(float(cond.mean()) - exact) < 6 * float(cond.std()) / DRAWS**0.5 + 1e-12


@pytest.mark.parametrize("n", [2, 3, 4])
def test_without_replacement_monte_carlo_and_engine_layer_match_enumeration(n):
    p, q = _pq()
    law = ordered_without_replacement_law(q.tolist(), n)
    sets = torch.tensor(list(law.keys()))
    exact = float((torch.tensor(list(law.values()), dtype=torch.float64) * dr.rrs(p, "wor", q, sets)[2]).sum())
    gen = torch.Generator().manual_seed(11 + n)
    mean, se = dr.mc_acceptance("wor", p, q, n, DRAWS, gen)
    # the engine's layer: drafts by gumbel_topk on log q (keyed), one output, accepts counted
    d = DRAWS
    seeds, pos = torch.arange(d, dtype=torch.int64), torch.full((d,), 3, dtype=torch.int64)
    lq, lp = torch.log(q).float()[None].expand(d, V).contiguous(), torch.log(p).float()[None].expand(d, V).contiguous()
    didx, dval = gumbel_topk(lq, n, rng.request_key(seeds, pos, rng.Stream.DRAFT_DRAW))
    out, _ = verify_layer(lp, didx, dval, lq, torch.ones(d, dtype=torch.int64), seeds, pos)
    eng = (out[:, :1] == didx).any(1).double()
    freq, se_eng = float(eng.mean()), float(eng.std()) / d**0.5
    print(f"wor N={n}: enumeration {exact:.4f}, Monte Carlo {mean:.4f} ± {se:.4f}, engine {freq:.4f} ± {se_eng:.4f}")
    assert abs(mean - exact) < 6 * se
    assert abs(freq - exact) < 6 * se_eng


def test_sampled_draft_first_is_never_worse():
    """greedy_zfirst (the sampled draft verified against p first) accepts at least as often as greedy (the point
    masses first) on the same set, and no less than the set's point masses alone (p of the top N - 1)."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        p = torch.softmax(3 * torch.randn(50, dtype=torch.float64, generator=gen), 0)
        q = torch.softmax(3 * torch.randn(50, dtype=torch.float64, generator=gen), 0)
        for n in (2, 3, 4, 8):
            a, b = dr.exact_acceptance("greedy_zfirst", p, q, n), dr.exact_acceptance("greedy", p, q, n)
            assert a >= b - 1e-12
            assert a >= float(p[torch.topk(q, n - 1).indices].sum()) - 1e-12
