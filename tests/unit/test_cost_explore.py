"""The cost model's probes and its measured per-node cost (``engine/cost.py``, ``engine/step_clock.py``): tries and
forests at the prior spend an engine-wide exploration budget (``cost.Exploration``), so a useless source drafts in at
most about ``PROBE_SHARE`` of the steps however many requests come and go (without the budget: several times that,
the planted variant), while a source that pays is found, at once and when it starts paying late; a new request plans
at its source's engine-wide rate; and a forest node's cost beyond the start-up table, measured by the step clock,
switches off the beam forests it makes unprofitable (the CPU case of results/sources-wall-2026-11-27) and not those
that pay."""
import random

import pytest

from vllm_dsbd.engine import cost
from vllm_dsbd.engine.cost import (MAX_WAIT, PROBE_SHARE, Acceptance, Candidate, CostTable, Exploration, PassRates,
                                   choose, choose_shapes)
from vllm_dsbd.engine.step_clock import MIN_STEPS, StepClock

# depth 1 of a width-2 forest pays only where a layer passes with probability above 0.75 (above the prior's 0.6)
DEAR = CostTable.from_times({1: 0.010, 256: 0.010}, {1: 0.0075, 256: 0.0075})
# draft-free (no draft pass), 0.6 ms per target token: in a batch of 8 a width-2 layer pays above a rate of ~0.68
SLOPED = CostTable.from_times({1: 0.010, 257: 0.010 + 256 * 0.0006}, {1: 0.0})


def _engine(p, steps=600, reqs=8, life=16, budget=True, seed=0):
    """An engine loop as the runner's (``shapes._choose_depths``): ``reqs`` plain requests (width 2, depth 3) on SLOPED,
    each replaced by a new one after ``life`` steps (staggered; 16: sources_wall.py's beam requests), whose layers pass
    with probability ``p(step)``. ``budget`` False: the planted variant, every try as soon as it is due. Returns the
    steps in which any drafted."""
    rng, pool, ex = random.Random(seed), PassRates(), Exploration()
    accs, ages, drafted = [Acceptance() for _ in range(reqs)], [i * life // reqs for i in range(reqs)], []
    for t in range(steps):
        explore = ex.open() if budget else True
        tries = [explore and a.idle >= a.wait for a in accs]
        cands = [a.candidate(1, 2, 3, pool=pool.rate("s", 2), explore=explore) for a in accs]
        shapes = choose_shapes(cands, SLOPED)
        ex.step(any(c.probe and d > 0 for c, (_, d) in zip(cands, shapes)))
        if any(d for _, d in shapes):
            drafted.append(t)
        for i, (a, tr, (w, d)) in enumerate(zip(accs, tries, shapes)):
            a.chose(d, tr)
            if d:
                k = 0
                while k < d and rng.random() < p(t):
                    k += 1
                a.observe(k, d)
                pool.observe("s", w, k, d)
            ages[i] += 1
            if ages[i] >= life:
                accs[i], ages[i] = Acceptance(), 0
    return drafted


def test_a_useless_source_is_switched_off_within_the_budget():
    steps = 600
    got = _engine(lambda t: 0.0, steps)
    # the first forests at the prior, then at most one probe step per 1 / PROBE_SHARE steps
    assert len(got) <= PROBE_SHARE * steps + 3, got
    assert max(got) >= steps // 2  # still probing: a source that starts paying can be found
    planted = _engine(lambda t: 0.0, steps, budget=False)  # every request's tries as soon as due: 1, 2, 4, ... steps
    assert len(planted) > 2 * (PROBE_SHARE * steps + 3), len(planted)


def test_a_source_that_pays_is_found():
    got = _engine(lambda t: 0.95)
    assert len(got) >= 0.9 * 600  # drafting at once: the prior's probe, then new requests at the engine-wide rate
    # useless for 300 steps, then passing 95%: found within a budget period and the longest wait
    late = _engine(lambda t: 0.0 if t < 300 else 0.95)
    after = 300 + round(1 / PROBE_SHARE) + MAX_WAIT + 8
    assert sum(1 for t in late if t >= after) >= 0.9 * (600 - after), late
    assert sum(1 for t in late if t < 300) <= PROBE_SHARE * 300 + 3


def test_exploration_spends_a_share_of_steps():
    ex = Exploration()
    probes = 0
    for _ in range(1000):
        if ex.open():
            probes += 1
            ex.step(True)
        else:
            ex.step(False)
    assert probes == ex.probes and probes <= PROBE_SHARE * 1000 + 1 and probes >= PROBE_SHARE * 1000 - 1


def test_a_new_request_plans_at_the_engine_wide_rate():
    fresh = Acceptance()
    assert choose([fresh.candidate(1, 2, 3)], DEAR) == [0]  # the prior does not pay on DEAR
    assert choose([fresh.candidate(1, 2, 3, pool=0.97)], DEAR)[0] >= 1  # the source pays for the other requests
    c = fresh.candidate(1, 2, 3, pool=0.2)
    assert c.rate == pytest.approx(0.2) and not c.probe
    # a forest at the prior is a probe (no engine-wide rate yet); a try is one only while the budget is open
    assert fresh.candidate(1, 2, 3).probe
    off = Acceptance(passed=0.0, tried=16.0, idle=4, wait=2)
    assert off.candidate(1, 2, 3, explore=True).probe
    closed = off.candidate(1, 2, 3, explore=False)
    assert not closed.probe and closed.rate == pytest.approx(off.rate())
    # a beam request's N' options at the engine-wide rate too
    b = Acceptance().candidate(4, 16, 3, low=4, pool=0.5)
    assert b.rate == 0.5 and dict(b.options) == {11: 0.5, 8: 0.5, 6: 0.5, 4: 0.5}


def _window(c, nodes, surplus, n=1):
    for _ in range(n):
        c.observe(0.040 + surplus, 0.040, True, True, nodes)


def test_the_clock_fits_a_fixed_and_a_per_node_cost():
    c = StepClock()
    for _ in range(MIN_STEPS):  # bare windows 1 ms over the table
        c.observe(0.041, 0.040, False, False)
    assert c.node_cost() is None
    for nodes in (16, 32, 48, 16, 32, 48):  # 3 ms per window plus 1 ms per node in it, over the bare windows' 1
        _window(c, nodes, 0.001 + 0.003 + 0.001 * nodes)
    _window(c, 32, 1.0)  # one slow outlier
    fixed, node = c.node_cost()
    assert fixed == pytest.approx(0.003) and node == pytest.approx(0.002)  # a node is in two windows
    t = c.corrected(DEAR)
    assert t.draft_step == pytest.approx(0.003) and t.node == pytest.approx(0.002) and t.step == pytest.approx(0.001)
    d = StepClock()
    _window(d, 24, 0.012, MIN_STEPS)  # every window the same nodes: all of it per node
    assert d.node_cost() == (0.0, pytest.approx(2 * 0.012 / 24))


# SmolLM2-135M's start-up table on these cores (target ms by tokens, results/sources-wall-2026-11-27); no draft model
SMOL = CostTable.from_times({1: 0.0455, 4: 0.0455, 8: 0.0563, 16: 0.0761, 32: 0.1158, 64: 0.195}, {1: 0.0})


def test_a_measured_node_cost_switches_off_beam_forests_that_do_not_pay():
    """One beam request (W = 4, N' from 4 to 16, depth 3) at a pass rate of 0.45: the start-up table alone makes a
    forest pay; with an extra 2.5 ms per node measured by the clock (what the dummy passes leave out: forest
    attention's recompute, the drafter's and verifier's work per node) none does; at 0.9 forests still pay."""

    def beam(rate):
        return [Candidate(4, 16, 3, rate, 4, options=tuple((w, rate) for w in (11, 8, 6, 4)))]

    assert any(d for _, d in choose_shapes(beam(0.45), SMOL))
    measured = CostTable(SMOL.target, SMOL.draft, node=0.0025)
    assert not any(d for _, d in choose_shapes(beam(0.45), measured))
    assert any(d for _, d in choose_shapes(beam(0.9), measured))
    # the node cost enters the time the model predicts for the chosen shapes
    assert cost.draft_seconds(beam(0.9), [(4, 2)], measured) == pytest.approx(8 * 0.0025)
