"""The cost model's choice rule and acceptance estimate (``vllm_dsbd.engine.cost``): pure functions, no engine.

At batch 1 the rule must be ``argmax_d E(d) / cost(d)`` (checked against a brute force over every depth); in a batch it
must never do worse than drafting nothing or drafting everything (checked against both), draft nothing where the draft
is bad or dear, and everything where the pass rate is high and passes are flat.
"""
from __future__ import annotations

import itertools

import pytest

from vllm_dsbd.engine.cost import (MAX_WAIT, MEMORY, PRIOR_RATE, Acceptance, Candidate, CostTable, choose,
                                   expected_tokens)

FLAT = CostTable.from_times({1: 0.010, 1024: 0.010}, {1: 0.001, 1024: 0.001})  # flat passes, a cheap draft
CPU = CostTable.from_times({1: 0.010, 2: 0.012, 4: 0.016, 8: 0.024, 16: 0.040},  # a CPU: time grows with tokens
                           {1: 0.003, 2: 0.0035, 4: 0.0045, 8: 0.0065})


def step_time(table: CostTable, cands, depths) -> float:
    """The model's step time, written out pass by pass (the oracle the rule's incremental sums must agree with)."""
    tokens = sum(c.leaves + c.width * d for c, d in zip(cands, depths))
    t = table.step + table.target_time(tokens)
    t += table.draft_time(sum(c.catch_up for c, d in zip(cands, depths) if d >= 1))  # pass 0: catch-up
    for k in range(1, max(depths, default=0)):  # pass k: the depth-k nodes of requests drafting deeper
        t += table.draft_time(sum(c.width for c, d in zip(cands, depths) if d > k))
    return t


def rate_of(table, cands, depths) -> float:
    return sum(expected_tokens(c.rate, d) for c, d in zip(cands, depths)) / step_time(table, cands, depths)


def test_interpolation_and_extrapolation():
    assert CPU.target_time(1) == 0.010 and CPU.target_time(3) == pytest.approx(0.014)
    assert CPU.target_time(32) == pytest.approx(0.040 + 16 * 0.002)  # past the end: the last slope, 2 ms a token
    assert CPU.draft_time(0) == 0.0 and FLAT.target_time(500) == 0.010
    pinned = CostTable.from_config({"target_ms": {"1": 10, "4": 16}, "draft_ms": {"1": 3}, "step_ms": 1})
    assert pinned.target_time(4) == pytest.approx(0.016) and pinned.draft_time(50) == pytest.approx(0.003)
    assert pinned.step == pytest.approx(0.001) and "target ms by tokens {1: 10.00, 4: 16.00}" in pinned.describe()


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1 and expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 3) == 1


def test_a_bad_or_dear_draft_drafts_nothing():
    # pass rate 0: every draft costs and gains nothing
    assert choose([Candidate(leaves=1, width=2, depth=3, rate=0.0)], FLAT) == [0]
    # pass rate 0.9 but a draft pass as dear as the target's and the target's time linear in tokens: never pays
    dear = CostTable.from_times({1: 0.01, 64: 0.64}, {1: 0.01, 64: 0.64})
    assert choose([Candidate(leaves=1, width=1, depth=3, rate=0.9)], dear) == [0]
    # a batch of bad drafts, beam requests included
    cands = [Candidate(leaves=1, width=2, depth=3, rate=0.01), Candidate(leaves=4, width=4, depth=3, rate=0.02,
                                                                        catch_up=4)]
    assert choose(cands, CPU) == [0, 0]


def test_a_good_draft_on_flat_passes_drafts_the_full_depth():
    assert choose([Candidate(leaves=1, width=2, depth=3, rate=0.9)], FLAT) == [3]
    cands = [Candidate(leaves=1, width=2, depth=3, rate=0.95)] * 8 + [Candidate(leaves=4, width=4, depth=3, rate=0.9,
                                                                                catch_up=4)]
    assert choose(cands, FLAT) == [3] * 9


def test_mixed_batch_drafts_only_the_request_that_pays():
    cands = [Candidate(leaves=1, width=1, depth=3, rate=0.95), Candidate(leaves=1, width=1, depth=3, rate=0.0)]
    assert choose(cands, FLAT) == [3, 0]


@pytest.mark.parametrize("table", [FLAT, CPU], ids=["flat", "cpu"])
@pytest.mark.parametrize("rate", [0.0, 0.2, 0.4, 0.6, 0.8, 0.95])
@pytest.mark.parametrize(("leaves", "width"), [(1, 1), (1, 2), (4, 4)])
def test_batch_of_one_is_the_argmax_over_depths(table, rate, leaves, width):
    c = Candidate(leaves=leaves, width=width, depth=3, rate=rate, catch_up=leaves)
    rates = [rate_of(table, [c], [d]) for d in range(4)]
    got = choose([c], table)[0]
    assert rates[got] == pytest.approx(max(rates), rel=1e-12)
    assert got == 0 or rates[got] > rates[0]  # it drafts only where drafting is strictly faster


@pytest.mark.parametrize("table", [FLAT, CPU], ids=["flat", "cpu"])
def test_a_batch_is_at_least_as_good_as_all_or_nothing(table):
    rates = [0.0, 0.3, 0.5, 0.7, 0.9]
    for combo in itertools.combinations_with_replacement(rates, 3):
        cands = [Candidate(leaves=1, width=2, depth=3, rate=a) for a in combo]
        got = choose(cands, table)
        best = rate_of(table, cands, got)
        assert best >= rate_of(table, cands, [0] * 3) * (1 - 1e-12)
        assert best >= rate_of(table, cands, [3] * 3) * (1 - 1e-12)
        # a request's depth never falls below that of one with a lower rate (the increments' order)
        for (a, d), (b, e) in itertools.combinations(zip(combo, got), 2):  # combo is sorted: a <= b
            assert d <= e or a == b


def test_pinned_requests_keep_their_depth():
    cands = [Candidate(leaves=4, width=4, depth=2, rate=0.0, catch_up=4, pinned=True),
             Candidate(leaves=1, width=2, depth=3, rate=0.0)]
    assert choose(cands, CPU) == [2, 0]


def test_acceptance_estimate_from_earlier_forests():
    acc = Acceptance()
    assert acc.rate() == pytest.approx(PRIOR_RATE)
    acc.observe(passed=3, depth=3)  # 3 layers tried, 3 passed
    assert acc.rate() == pytest.approx((PRIOR_RATE * 2 + 3) / 5)
    acc.observe(passed=0, depth=3)  # layer 1 failed: one layer tried
    assert acc.rate() == pytest.approx((PRIOR_RATE * 2 + 3) / 6)
    acc.observe(passed=1, depth=1)  # a one-layer forest that passed
    assert acc.rate() == pytest.approx((PRIOR_RATE * 2 + 4) / 7)
    for _ in range(100):  # evidence beyond MEMORY layers is scaled down: the estimate follows recent forests
        acc.observe(passed=0, depth=3)
    assert acc.tried == MEMORY and acc.rate() < 0.08  # the floor: the prior alone over MEMORY failed layers, 0.067


def test_a_switched_off_request_tries_again_after_waiting_longer_each_time():
    acc = Acceptance(passed=0.0, tried=MEMORY)  # a draft that never passed
    tries = []
    for step in range(200):
        a = acc.planning_rate()
        d = choose([Candidate(leaves=1, width=2, depth=3, rate=a)], FLAT)[0]
        acc.chose(d)
        if d:
            tries.append(step)
            acc.observe(passed=0, depth=d)  # the try fails
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(tries) >= 5 and gaps == sorted(gaps) and max(gaps) == MAX_WAIT + 1
    acc.idle = acc.wait  # the next try passes a layer: back to trying after one idle step
    acc.chose(3)
    acc.observe(passed=2, depth=3)
    assert acc.wait == 1


def test_the_probe_table_is_made_non_decreasing():
    from vllm_dsbd.engine.load_probe import monotone

    # a size slowed by noise (1: 179 ms, 2: 225 ms) takes the least time of the larger sizes
    got = monotone({1: 0.179, 2: 0.225, 4: 0.191, 8: 0.197, 16: 0.295, 32: 0.653, 64: 0.780, 128: 0.687})
    assert got == {1: 0.179, 2: 0.191, 4: 0.191, 8: 0.197, 16: 0.295, 32: 0.653, 64: 0.687, 128: 0.687}
