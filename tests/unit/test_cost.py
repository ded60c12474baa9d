"""The cost model's choice rule and acceptance estimate (``vllm_dsbd.engine.cost``): pure functions, no engine.

At batch 1 the rule must be ``argmax_d E(d) / cost(d)`` (checked against a brute force over every depth); in a batch it
must never do worse than drafting nothing or drafting everything (checked against both), draft nothing where the draft
is bad or dear, and everything where the pass rate is high and passes are flat. For T = 0 beam requests it also
chooses N (nodes per depth): at batch 1 the argmax over every (N, depth) (brute force), a smaller N where the larger
does not pay, the larger where it does, the larger on ties, never outside [W, the request's N]; the rate at each N
is read from the subforests of verified forests (checked against drafting the smaller forests for real).
"""
from __future__ import annotations

import itertools

import pytest

from vllm_dsbd.engine import cost as cost_mod
from vllm_dsbd.testing.cost_reference import FsumStep
from vllm_dsbd.engine.cost import (MAX_WAIT, MEMORY, POOL_MEMORY, PRIOR_RATE, Acceptance, Candidate, CostTable,
                                   PassRates, Subforest, choose, choose_shapes, expected_tokens, passed_by_width,
                                   upper_rate, width_grid)

FLAT = CostTable.from_times({1: 0.010, 1024: 0.010}, {1: 0.001, 1024: 0.001})  # flat passes, a cheap draft
CPU = CostTable.from_times({1: 0.010, 2: 0.012, 4: 0.016, 8: 0.024, 16: 0.040},  # a CPU: time grows with tokens
                           {1: 0.003, 2: 0.0035, 4: 0.0045, 8: 0.0065})


def step_time(table: CostTable, cands, depths, widths=None) -> float:
    """The model's step time, written out pass by pass (the oracle the rule's incremental sums must agree with);
    ``widths``: each request's nodes per depth (default its ``width``)."""
    widths = widths or [c.width for c in cands]
    tokens = sum(c.leaves + w * d for c, w, d in zip(cands, widths, depths))
    t = table.step + table.target_time(tokens)
    t += table.draft_time(sum(c.catch_up for c, d in zip(cands, depths) if d >= 1))  # pass 0: catch-up
    for k in range(1, max(depths, default=0)):  # pass k: the depth-k nodes of requests drafting deeper
        t += table.draft_time(sum(w for w, d in zip(widths, depths) if d > k))
    return t


def rate_of(table, cands, depths) -> float:
    return sum(expected_tokens(c.rate, d) for c, d in zip(cands, depths)) / step_time(table, cands, depths)


def shapes_rate(table, cands, shapes) -> float:
    """Expected tokens per second of (nodes per depth, depth) shapes (a candidate's rate at N from its options)."""
    rates = [dict(((c.width, c.rate),) + c.options) for c in cands]
    exp = sum(expected_tokens(r[w], d) for r, (w, d) in zip(rates, shapes))
    return exp / step_time(table, cands, [d for _, d in shapes], [w for w, _ in shapes])


def all_shapes(c):
    return [(c.width, 0)] + [(w, d) for w in sorted(dict(((c.width, c.rate),) + c.options)) for d in
                             range(1, c.depth + 1)]


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
    assert len(tries) <= 0.1 * 200  # a useless draft is switched off
    acc.idle = acc.wait  # the next try passes a layer: back to trying after one idle step
    acc.chose(3)
    acc.observe(passed=2, depth=3)
    assert acc.wait == 1


def test_the_probe_table_is_made_non_decreasing():
    from vllm_dsbd.engine.load_probe import monotone

    # a size slowed by noise (1: 179 ms, 2: 225 ms) takes the least time of the larger sizes
    got = monotone({1: 0.179, 2: 0.225, 4: 0.191, 8: 0.197, 16: 0.295, 32: 0.653, 64: 0.780, 128: 0.687})
    assert got == {1: 0.179, 2: 0.191, 4: 0.191, 8: 0.197, 16: 0.295, 32: 0.653, 64: 0.687, 128: 0.687}


# ------------------------------------------------------------------------------------------------------------------
# N, the nodes per depth of a T = 0 beam request's forest

def test_width_grid():
    assert width_grid(4, 16) == [4, 6, 8, 11, 16] and width_grid(2, 4) == [2, 3, 4] and width_grid(4, 4) == [4]
    assert width_grid(4, 5) == [4, 5] and width_grid(2, 8) == [2, 3, 4, 6, 8]


def _beam_forest(draft, target, live, width, nodes, depth, vocab):
    """A T = 0 beam forest drawn for real: the draft's ``nodes`` best children per depth (by ``draft(path)``, a
    cumulative score) of the depth before (the live beams first), and the target's beam search of ``width`` beams over
    the same paths. Returns (layers, parents, ranked paths per depth, target beams per layer as paths)."""
    layers, parents, paths, by_depth = [], [], [], []
    prev = [(p, -1) for p in live]
    for d in range(1, depth + 1):
        kids = sorted(((p + (t,), c) for p, c in prev for t in range(vocab)), key=lambda x: -draft(x[0]))[:nodes]
        at = len(paths)
        for j, (p, c) in enumerate(kids):
            layers.append(d)
            parents.append(c)
            paths.append(p)
        by_depth.append([p for p, _ in kids])
        prev = [(p, at + j) for j, (p, _) in enumerate(kids)]
    beams, cur = [], list(live)
    for _ in range(depth + 1):
        cur = sorted((p + (t,) for p in cur for t in range(vocab)), key=lambda x: -target(x))[:width]
        beams.append(cur)
    return layers, parents, paths, by_depth, beams


def _passed(by_depth, beams) -> int:
    """Layers a forest passes: while the target's new beams are all among its nodes of that depth."""
    n = 0
    for nodes, tgt in zip(by_depth, beams):
        if not set(tgt) <= set(nodes):
            break
        n += 1
    return n


@pytest.mark.parametrize("seed", range(40))
def test_subforest_counts_match_drafting_the_smaller_forest(seed):
    """``passed_by_width`` against the smaller forests drafted for real (random draft and target scores that agree in
    part): exact at depth 1, never above deeper, exact at the forest's own N."""
    import random

    rng = random.Random(seed)
    vocab, W, N, G = 5, 2, 8, rng.choice([2, 3])
    noise = rng.choice([0.3, 1.0, 3.0])
    base: dict = {}

    def score(path, salt):  # cumulative: each token adds a shared value and a model's own noise
        tot = 0.0
        for k in range(1, len(path) + 1):
            key = path[:k]
            base.setdefault(key, rng.gauss(0, 1))
            tot += base[key] + noise * random.Random(hash((key, salt))).gauss(0, 1)
        return tot

    live = [(0,), (1,)]
    layers, parents, paths, by_depth, beams = _beam_forest(lambda p: score(p, 1), lambda p: score(p, 2), live, W, N,
                                                           G, vocab)
    index = {p: c for c, p in enumerate(paths)}
    passed = _passed(by_depth, beams)
    trace = [[index[p] for p in beams[d]] for d in range(passed)]
    widths = width_grid(W, N)
    got = passed_by_width(layers, parents, trace, widths)
    for w in widths:
        *_, by_w, beams_w = _beam_forest(lambda p: score(p, 1), lambda p: score(p, 2), live, W, w, G, vocab)
        true = _passed(by_w, beams_w)
        assert got[w] <= true and min(got[w], 1) == min(true, 1), (w, got, true)
    assert got[N] == passed


def test_acceptance_per_width_from_subforests():
    acc = Acceptance()
    # no forest verified yet: every N' of the grid, at the prior
    c = acc.candidate(4, 16, 3, low=4)
    assert (c.width, c.rate, c.options) == (16, PRIOR_RATE, tuple((w, PRIOR_RATE) for w in (11, 8, 6, 4)))
    # a 2-deep forest of N = 8, W = 2: layer 1 needs the 3 best depth-1 nodes (beams 0 and 2), layer 2 passes with them
    sub = Subforest(width=2, nodes=8, layers=(1,) * 8 + (2,) * 8, parents=(-1,) * 8 + (0, 2, 1, 0, 2, 3, 4, 5),
                    beams=((0, 2), (8, 9)))
    assert passed_by_width(sub.layers, sub.parents, sub.beams, [2, 3, 4, 6]) == {2: 0, 3: 2, 4: 2, 6: 2}
    acc.observe(2, 2, sub)
    assert acc.by_width == {2: [0.0, 1.0], 3: [2.0, 2.0], 4: [2.0, 2.0], 6: [2.0, 2.0], 8: [2.0, 2.0]}
    assert acc.width_rate(2) == pytest.approx(PRIOR_RATE * 2 / 3) and acc.width_rate(8) == pytest.approx(0.8)
    c = acc.candidate(2, 8, 2, low=2)
    assert c.width == 8 and c.rate == pytest.approx(0.8)
    assert dict(c.options) == pytest.approx({2: 0.4, 3: 0.8, 4: 0.8, 6: 0.8})
    # capped below the request's N (a budget level): the options stop there
    c = acc.candidate(2, 4, 2, low=2)
    assert c.width == 4 and dict(c.options) == pytest.approx({2: 0.4, 3: 0.8})
    # the estimate is monotone in N: a width whose own count is lower takes the best below it; one without a count
    # (above every forest drafted so far) is at the prior, or better (a T = 0 beam request's tries draft the full N)
    acc.by_width[6] = [0.0, 4.0]
    assert acc.width_rate(6) == pytest.approx(0.8) and acc.width_rate(11) == pytest.approx(0.8)
    acc.by_width = {2: [0.0, 4.0]}
    assert acc.width_rate(3) == pytest.approx(PRIOR_RATE) and acc.width_rate(2) == pytest.approx(0.2)
    # plain requests and T > 0 beams (no ``low``) and N = W: no options
    assert acc.candidate(2, 8, 2).options == () and acc.candidate(2, 2, 2, low=2).options == ()
    # after ``wait`` idle steps, a try: the full N only (its forest informs every smaller N), at an optimistic rate
    # (N = 8 has no count of its own: the request's overall one, 2 layers passed of 2), or the engine-wide one
    acc.idle = acc.wait
    c = acc.candidate(2, 8, 2, low=2)
    assert c.options == () and c.width == 8 and c.rate == pytest.approx(acc.try_rate(2.0, 2.0)) and c.rate > 0.9
    acc.by_width[8] = [0.0, MEMORY]
    assert acc.candidate(2, 8, 2, low=2, pool=0.7).rate == pytest.approx(0.7)


SLOPE = CostTable.from_times({1: 0.010, 4: 0.010, 64: 0.016}, {1: 0.001, 64: 0.002})  # 0.1 ms a target token


def test_a_smaller_n_where_the_larger_does_not_pay():
    # W = 4 leaves; N = 16 passes a layer 50%, N = 8 45%, N = 4 10%: N = 8 and depth 1, 122 tokens/s, against N = 16's
    # best (depth 1, 119) and no draft (100)
    c = Candidate(leaves=4, width=16, depth=3, rate=0.5, catch_up=4, options=((4, 0.1), (8, 0.45)))
    got = choose_shapes([c], SLOPE)
    assert got == [(8, 1)] and shapes_rate(SLOPE, [c], got) == pytest.approx(122.387, rel=1e-4)
    assert shapes_rate(SLOPE, [c], [(16, choose([Candidate(4, 16, 3, 0.5, 4)], SLOPE)[0])]) == pytest.approx(
        118.599, rel=1e-4)
    # N = 16 at a rate the histogram does not back any more (30%): drafting does not pay at 16, it does at 8
    c = Candidate(leaves=4, width=16, depth=3, rate=0.3, catch_up=4, options=((4, 0.1), (8, 0.3)))
    assert choose([Candidate(4, 16, 3, 0.3, 4)], SLOPE) == [1] and choose_shapes([c], SLOPE) == [(8, 1)]


def test_a_larger_n_where_it_pays():
    # flat passes: extra nodes cost nothing; N = 16 passes far more often
    c = Candidate(leaves=4, width=16, depth=3, rate=0.9, catch_up=4, options=((4, 0.05), (8, 0.3)))
    assert choose_shapes([c], FLAT) == [(16, 3)]
    # target time growing with tokens, and only N = 16 passes layers: N = 16, where drafting pays at all
    c2 = Candidate(leaves=4, width=16, depth=3, rate=0.9, catch_up=4, options=((4, 0.0), (8, 0.05)))
    assert choose_shapes([c2], SLOPE) == [(16, 3)]
    assert choose_shapes([c2], CPU) == [(16, 0)]  # 2 ms a target token: no forest pays


def test_ties_keep_the_larger_n_and_depth_zero_reports_the_full_width():
    c = Candidate(leaves=4, width=16, depth=3, rate=0.7, catch_up=4, options=((4, 0.7), (8, 0.7)))
    assert choose_shapes([c], FLAT) == [(16, 3)]  # flat passes, equal rates: every N as fast
    bad = Candidate(leaves=4, width=16, depth=3, rate=0.0, catch_up=4, options=((4, 0.0), (8, 0.0)))
    assert choose_shapes([bad], CPU) == [(16, 0)]


@pytest.mark.parametrize("table", [FLAT, CPU, SLOPE], ids=["flat", "cpu", "slope"])
@pytest.mark.parametrize("rates", [(0.0, 0.1, 0.3), (0.2, 0.5, 0.6), (0.5, 0.5, 0.5), (0.05, 0.1, 0.9),
                                   (0.6, 0.8, 0.95)])
def test_batch_of_one_is_the_argmax_over_n_and_depth(table, rates):
    c = Candidate(leaves=4, width=16, depth=3, rate=rates[2], catch_up=4, options=((4, rates[0]), (8, rates[1])))
    got = choose_shapes([c], table)
    rs = {s: shapes_rate(table, [c], [s]) for s in all_shapes(c)}
    assert rs[got[0]] == pytest.approx(max(rs.values()), rel=1e-12)
    assert got[0][0] in (4, 8, 16) and 0 <= got[0][1] <= 3


@pytest.mark.parametrize("table", [FLAT, CPU, SLOPE], ids=["flat", "cpu", "slope"])
def test_a_batch_with_n_choices_is_at_least_as_good_as_the_full_n_and_a_best_response(table):
    import random

    rng = random.Random(3)
    for _ in range(30):
        cands = []
        for _ in range(rng.randrange(1, 5)):
            r = sorted(rng.random() for _ in range(3))
            cands.append(Candidate(leaves=4, width=16, depth=3, rate=r[2], catch_up=4,
                                   options=((4, r[0]), (8, r[1]))))
        cands.append(Candidate(leaves=1, width=2, depth=3, rate=rng.random()))  # a plain request: width 2 only
        got = choose_shapes(cands, table)
        full = [(c.width, d) for c, d in zip(cands, choose([Candidate(c.leaves, c.width, c.depth, c.rate,
                                                                      c.catch_up) for c in cands], table))]
        best = shapes_rate(table, cands, got)
        assert best >= shapes_rate(table, cands, full) * (1 - 1e-12)
        assert best >= shapes_rate(table, cands, [(c.width, 0) for c in cands]) * (1 - 1e-12)
        assert got[-1][0] == 2  # the plain request keeps its width
        for i, c in enumerate(cands[:-1]):  # no single request's other shape is faster (up to the rule's margin)
            assert c.width >= got[i][0] >= 4
            for s in all_shapes(c):
                trial = got[:i] + [s] + got[i + 1:]
                assert shapes_rate(table, cands, trial) <= best * (1 + 1e-9)


def test_pinned_beam_requests_keep_their_shape():
    c = Candidate(leaves=4, width=16, depth=2, rate=0.0, catch_up=4, pinned=True, options=((4, 0.9),))
    assert choose_shapes([c], CPU) == [(16, 2)]


def test_a_batch_drafts_a_smaller_n_together_where_no_lone_request_pays():
    # 4 beam requests (W = 2, N = 8), every N' at the prior; draft passes of 2 ms whatever their tokens, the target
    # 0.2 ms a token: at N = 8 nothing pays, nor does one request's forest alone (the draft passes are shared); all
    # four at N' = 2, depth 1 do (427 expected beam steps a second against 351)
    table = CostTable.from_times({1: 0.010, 256: 0.010 + 255 * 0.0002}, {1: 0.002, 256: 0.002})
    cands = [Candidate(leaves=2, width=8, depth=3, rate=PRIOR_RATE, catch_up=2,
                       options=tuple((w, PRIOR_RATE) for w in (6, 4, 3, 2)))] * 4
    assert choose([Candidate(2, 8, 3, PRIOR_RATE, 2)] * 4, table) == [0] * 4
    none = [(8, 0)] * 4
    assert all(shapes_rate(table, cands, [x] + none[1:]) <= shapes_rate(table, cands, none) for x in
               all_shapes(cands[0]))
    got = choose_shapes(cands, table)
    assert got == [(2, 1)] * 4
    assert shapes_rate(table, cands, got) == pytest.approx(426.7, rel=1e-3)
    assert shapes_rate(table, cands, none) == pytest.approx(350.9, rel=1e-3)


# a dear draft: depth 1 pays only where a layer passes with probability above 0.75 (above the prior's 0.6)
DEAR = CostTable.from_times({1: 0.010, 256: 0.010}, {1: 0.0075, 256: 0.0075})


def _drafted(table, p, steps=300, seed=0, acc=None, pool=None):
    """The share of ``steps`` a request whose layers pass with probability ``p`` drafts (width 2, depth 3)."""
    import random

    rng, acc, n = random.Random(seed), acc or Acceptance(), 0
    for _ in range(steps):
        d = choose([acc.candidate(1, 2, 3, pool=pool)], table)[0]
        acc.chose(d)
        if d:
            n += 1
            k = 0
            while k < d and rng.random() < p:
                k += 1
            acc.observe(k, d)
    return n / steps


def test_a_draft_passing_more_than_the_prior_is_found():
    """At the prior's 0.6 the dear draft does not pay: a new request drafts nothing at first. Its try plans at the
    upper confidence bound (0.95 with no evidence), so a draft passing 95% of layers is measured and then drafted in
    every step; one passing 30% is tried now and then and stays off."""
    assert choose([Candidate(1, 2, 3, PRIOR_RATE)], DEAR) == [0]
    assert upper_rate(0.0, 0.0) > 0.9 and upper_rate(0.0, MEMORY) < 0.15
    assert _drafted(DEAR, 0.95) > 0.95
    assert _drafted(DEAR, 0.3) < 0.1
    # on the flat table and the one of test_engine_cost's engines (where 30% pays) a draft that never passes stays off
    assert _drafted(FLAT, 0.0) < 0.1 and _drafted(CostTable.from_times({1: 0.01}, {1: 0.004}), 0.0) < 0.1
    assert _drafted(FLAT, 0.3) > 0.95


def test_a_try_trusts_old_evidence_less_the_longer_it_waited():
    acc = Acceptance(passed=0.0, tried=MEMORY)
    acc.idle = acc.wait = 1
    early = acc.planning_rate()
    acc.idle = 64
    late = acc.planning_rate()
    assert acc.rate() < early < late < upper_rate(0.0, 0.0)
    # a request whose draft failed long ago is measured again: after 64 idle steps its try pays on the dear table
    acc = Acceptance(passed=0.0, tried=MEMORY, idle=MAX_WAIT, wait=MAX_WAIT)
    assert choose([acc.candidate(1, 2, 3)], DEAR) == [0]
    acc.idle = 2 * MAX_WAIT
    assert choose([acc.candidate(1, 2, 3)], DEAR)[0] >= 1
    # not on the estimate: a request that is not trying keeps its measured rate
    acc.idle = 0
    assert acc.planning_rate() == pytest.approx(acc.rate())


def test_the_engine_wide_rate_is_a_try_floor():
    pool = PassRates()
    assert pool.rate("model", 2) is None
    for _ in range(20):
        pool.observe("model", 2, passed=3, depth=3)
    pool.observe("model", 4, passed=0, depth=3)
    assert pool.rate("model", 2) > 0.9 and pool.rate("model", 4) == pool.rate("model", 2)  # monotone in N
    assert pool.rate("model", 1) is None and pool.rate("other", 2) is None
    assert sum(pt[1] for pt in pool.counts.values()) <= 2 * POOL_MEMORY
    # a request whose own forests failed tries again at the engine-wide rate
    acc = Acceptance(passed=0.0, tried=MEMORY, idle=1, wait=1)
    assert acc.planning_rate(pool.rate("model", 2)) == pytest.approx(pool.rate("model", 2))
    assert choose([acc.candidate(1, 2, 3, pool=pool.rate("model", 2))], DEAR)[0] >= 1
    assert choose([acc.candidate(1, 2, 3)], DEAR) == [0]


def test_a_plain_request_chooses_its_width_from_one_up():
    """``low = 1``: a plain request's N' from 1 to its width, each at the count of the forests it verified at that N'
    (a width without one at the nearest larger one's: a smaller forest passes at most as often)."""
    acc = Acceptance()
    for _ in range(8):
        acc.observe(passed=3, depth=3, nodes=4)
    c = acc.candidate(1, 4, 3, low=1)
    assert c.width == 4 and dict(c.options) == pytest.approx({w: acc.width_rate(4) for w in (1, 2, 3)})
    # flat target passes, the draft's passes cost by tokens: the smaller width at the same rate is faster
    slope_draft = CostTable.from_times({1: 0.010, 64: 0.010}, {1: 0.001, 64: 0.008})
    assert choose_shapes([c], slope_draft)[0][0] < 4
    acc.observe(passed=0, depth=3, nodes=1)
    acc.observe(passed=0, depth=3, nodes=1)
    assert acc.width_rate(1) < acc.width_rate(2) == acc.width_rate(4)
    # a width above every one drafted: the upper bound of the largest one's count (its forests tell nothing wider)
    acc = Acceptance()
    acc.observe(passed=2, depth=3, nodes=1)
    up = upper_rate(*acc.by_width[1])
    assert acc.width_rate(2) == pytest.approx(up) and up > acc.width_rate(1)



def random_batch(rng, n: int) -> list[Candidate]:
    """``n`` candidates as the runner makes them: plain requests of width 1..4 with options from 1 up (a rate per
    N', larger N' at least as high), T = 0 beam requests of W = 2..4 and N up to 16, some pinned, some at a try's rate,
    catch-ups of 1 to 40 tokens."""
    out = []
    for _ in range(n):
        beam = rng.random() < 0.3
        low = rng.randint(2, 4) if beam else 1
        width = rng.choice([low, low + 1, 2 * low, 4 * low]) if beam else rng.randint(1, 4)
        grid = width_grid(low, width)
        rates = sorted(rng.random() for _ in grid)
        opts = tuple(zip(grid[:-1], rates[:-1]))[::-1]
        out.append(Candidate(leaves=low if beam else 1, width=width, depth=rng.randint(1, 4), rate=rates[-1],
                             catch_up=rng.choice([1, low, rng.randint(1, 40)]), pinned=rng.random() < 0.05,
                             options=opts, probe=rng.random() < 0.1))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_running_sums_choose_the_shapes_of_the_full_sums(seed, monkeypatch):
    """``choose_shapes`` with ``_Step``'s running sums chooses, on random batches of 1..96 requests and random tables
    (step, drafting-step and per-node costs included), exactly the shapes it chose with the full sums (the sum of
    expected tokens is exact either way: the same floats, so the same comparisons)."""
    import random

    rng = random.Random(seed)
    for trial in range(12):
        n = rng.choice([1, 2, 3, 8, 24, 96])
        t = sorted(rng.uniform(0.005, 0.05) for _ in range(4))
        dr = sorted(rng.uniform(0.0005, 0.01) for _ in range(3))
        table = cost_mod.CostTable(target=tuple(zip((1, 16, 128, 1024), t)), draft=tuple(zip((1, 64, 512), dr)),
                                   step=rng.choice([0.0, 0.002]), draft_step=rng.choice([0.0, 0.001]),
                                   node=rng.choice([0.0, 2.5e-4]))
        cands = random_batch(rng, n)
        new = choose_shapes(cands, table)
        with monkeypatch.context() as m:
            m.setattr(cost_mod, "_Step", FsumStep)
            old = choose_shapes(cands, table)
        assert new == old, (seed, trial)
        step, ref = cost_mod._Step(cands, list(new), table), FsumStep(cands, list(new), table)
        for i in rng.sample(range(n), min(n, 5)):  # changes in any order: the same ratio, bit for bit
            s = rng.choice(all_shapes(cands[i]))
            step.set(i, s)
            ref.set(i, s)
            assert step.ratio() == ref.ratio()


def _random_table(rng) -> CostTable:
    """A table of target passes 5-50 ms, draft passes 0.5-10 ms, and a drafting step and per-node cost from none to
    what a GPU's forest work costs beside a small target (so that some batches pay for forests and some cannot)."""
    t = sorted(rng.uniform(0.005, 0.05) for _ in range(4))
    dr = sorted(rng.uniform(0.0005, 0.01) for _ in range(3))
    return CostTable(target=tuple(zip((1, 16, 128, 1024), t)), draft=tuple(zip((1, 64, 512), dr)),
                     step=rng.choice([0.0, 0.002]), draft_step=rng.choice([0.0, 0.001, 0.03, 0.2]),
                     node=rng.choice([0.0, 2.5e-4, 0.004]))


@pytest.mark.parametrize("seed", range(3))
def test_none_can_pay_only_where_the_model_chooses_no_forest(seed, monkeypatch):
    """``none_can_pay`` (the bound ``choose_shapes`` returns at once on) holds only where the full choice, every
    request's every shape tried, drafts no forest: on random batches of 1..96 requests (plain and beam, options,
    probes; no pinned one, which drafts whatever the model says) and random tables. It is not vacuous (it holds on many
    of them), and a planted bound that prices every layer at the widest N's nodes (a smaller N' costs fewer) claims
    batches whose full choice drafts."""
    import dataclasses
    import random

    def full(cands, table):
        with monkeypatch.context() as m:
            m.setattr(cost_mod, "none_can_pay", lambda cands, table: False)
            return choose_shapes(cands, table)

    def planted(cands, table):  # every layer priced at the widest N's nodes, though a smaller N' costs fewer
        return cost_mod.none_can_pay(cands, dataclasses.replace(table, node=table.node * max(c.width for c in cands)))

    rng = random.Random(seed)
    held = 0
    for trial in range(60):
        n = rng.choice([1, 2, 3, 8, 24, 96])
        table = _random_table(rng)
        cands = [dataclasses.replace(c, pinned=False) for c in random_batch(rng, n)]
        shapes = full(cands, table)
        if cost_mod.none_can_pay(cands, table):
            held += 1
            assert all(d == 0 for _, d in shapes), (seed, trial)
            assert choose_shapes(cands, table) == shapes
    assert held >= 10, held
    # 5 ms target passes, 2 ms a node: one request of N = 4 passing 95% of its layers at every N'. At N' = 1 depth 3
    # pays (3.71 tokens in 12.5 ms against 1 in 5 ms); priced at N = 4's nodes no layer would
    table = CostTable(target=((1, 0.005), (1024, 0.005)), draft=((1, 0.0005), (1024, 0.0005)), node=0.002)
    one = [Candidate(leaves=1, width=4, depth=3, rate=0.95, options=((2, 0.95), (1, 0.95)))]
    assert full(one, table) == choose_shapes(one, table) == [(1, 3)]
    assert not cost_mod.none_can_pay(one, table) and planted(one, table)
    assert not cost_mod.none_can_pay([Candidate(1, 2, 3, 0.9, pinned=True)], _random_table(rng))  # pinned: drafts


def test_the_draft_catch_up_is_priced_as_it_runs():
    """``shapes._catch_ups`` (the runner's pass-0 tokens of each request, with a draft model): a plain request that
    drafted last step catches up its emitted tokens, one idle for 30 steps its 31, a new one 1 (its prompt's catch-up,
    the draft's prefill, is paid once whatever the choice and not priced), a beam request its nodes without draft K/V
    below the trie, at least its W leaves; no cost model or no draft model: None (every candidate's leaves)."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_dsbd.engine.beams.trie import BeamRequest
    from vllm_dsbd.engine.shapes import ShapePlanMixin
    from vllm_dsbd.engine.state import RequestState
    from vllm_dsbd.requests import BeamParams

    def plain(draft_len):
        return RequestState(req_id="p", seed=0, width=2, temperature=0.0, top_k=0, top_p=1.0, eos=-1, max_tokens=None,
                            draft_len=draft_len)

    beam = BeamRequest(BeamParams(width=2, max_tokens=8), 30, 0.0, 0)
    beam.tokens, beam.parents, beam.depths, beam.has_draft = [5, 6, 7, 8, 9], [-1, -1, 0, 1, 2], [1, 1, 2, 2, 3], \
        [True, True, True, False, False]
    states = {"drafted": plain(10), "new": plain(0), "idle": plain(50),
              "beam": RequestState(req_id="b", seed=0, width=2, temperature=0.0, top_k=0, top_p=1.0, eos=-1,
                                   max_tokens=None, draft_len=30, beam=beam)}
    runner = ShapePlanMixin()
    runner.dsbd_cfg, runner.dsbd_cost, runner.dsbd_requests = SimpleNamespace(draft=True), FLAT, states
    runner.input_batch = SimpleNamespace(req_ids=list(states), num_tokens_no_spec=np.array([10, 100, 80, 35]),
                                         num_prompt_tokens=np.array([5, 100, 20, 30]))
    results = [SimpleNamespace(tokens=[1, 2, 3]), SimpleNamespace(tokens=[4]), SimpleNamespace(tokens=[4]), None]
    assert runner._catch_ups(results) == [3, 1, 31, 2]
    beam.has_draft = [True, False, False, False, False]  # nodes 1.. without draft K/V: 4 tokens
    assert runner._catch_ups(results)[3] == 4
    runner.dsbd_cfg = SimpleNamespace(draft=False)
    assert runner._catch_ups(results) is None
