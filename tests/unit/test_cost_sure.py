"""Floors judged at what a request's own evidence makes sure, and one try a step (``cost.Candidate.sure``,
``acceptance.lower_rate``, ``shapes.MAX_TRIES``).

A floor promises a request that the others' forests do not slow it below its share of its pace. The expected tokens it
is judged at were its planning rate: the pool's for a new request, an estimate drawn to the prior over few layers for
the others, both above what the README job's chats passed (34 extra tokens expected, 22 accepted in one call:
results/sure-floors-2026-12-07). Now the floor is judged at the lower confidence bound of the request's own evidence,
and a probe (a try, a forest at the prior) at its planning rate, but only one request tries a step: a batch of 8
trying together cost 3.3-3.6 bare steps there.

Checked: the bound's values; the candidate's ``sure``; on batches of every combination of rates (``test_cost_floor``),
every request keeps its floor at its sure rate, and planted, the choice judged at the planning rates breaks it on some;
the runner's choice with every request due a try drafts one try, the likeliest to pay, and planted, with
``MAX_TRIES`` lifted, several in one step.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from test_cost import CPU, step_time
from test_cost_floor import JOB, _batches, _lefts_and_floors, _minimal
from vllm_dsbd.engine import cost, load, shapes
from vllm_dsbd.engine.acceptance import PRIOR_RATE, lower_rate, upper_rate
from vllm_dsbd.engine.cost import Acceptance, choose_shapes, expected_tokens


def test_the_lower_bound_mirrors_the_upper_one():
    """``lower_rate`` is ``upper_rate`` mirrored about the estimate: 0.25 with no evidence (the prior's 0.6 less one
    standard deviation over its 2 layers), closing on the rate as layers are tried."""
    assert lower_rate(0, 0) == pytest.approx(PRIOR_RATE - (PRIOR_RATE * (1 - PRIOR_RATE) / 2) ** 0.5)
    for passed, tried in [(0, 0), (1, 3), (3, 3), (30, 40), (300, 400)]:
        a = (PRIOR_RATE * 2 + passed) / (2 + tried)
        assert lower_rate(passed, tried) <= a <= upper_rate(passed, tried)
        if upper_rate(passed, tried) < 1.0:  # (the upper bound stops at 1)
            assert lower_rate(passed, tried) == pytest.approx(2 * a - upper_rate(passed, tried))
    assert lower_rate(300, 400) - lower_rate(3, 4) > 0.1
    assert lower_rate(0, 50) < 0.01 and lower_rate(1, 1) >= 0.0


def test_a_candidates_floor_is_judged_at_its_own_evidence():
    """A request with evidence: ``sure`` is its evidence's lower bound; a new one planning at the pool's rate: the
    prior's bound, whatever the pool says; a probe (a try, a forest at the prior): none (its planning rate)."""
    a = Acceptance()
    a.observe(1, 3)
    a.idle, a.wait = 0, 1
    c = a.candidate(1, 2, 3, pool=0.9)
    assert not c.probe and c.sure == pytest.approx(lower_rate(a.passed, a.tried)) and c.sure < c.rate
    assert Acceptance().candidate(1, 2, 3, pool=0.9, explore=False).sure == pytest.approx(lower_rate(0, 0))
    assert Acceptance().candidate(1, 2, 3, pool=0.9, explore=False).rate == 0.9
    assert Acceptance().candidate(1, 2, 3).probe and Acceptance().candidate(1, 2, 3).sure is None  # at the prior
    a.idle = a.wait
    tr = a.candidate(1, 2, 3, pool=0.9, explore=True)
    assert tr.probe and tr.sure is None


def _sure_keeps(table, cands, shapes_, floors) -> bool:
    """Every request's expected tokens per second at its sure rate at least its floor of its rate in the minimal
    step (a pinned request: at its own forest's rate on both sides)."""
    t, ref = step_time(table, cands, [d for _, d in shapes_], [w for w, _ in shapes_]), step_time(
        table, cands, [d for _, d in _minimal(cands)], [w for w, _ in _minimal(cands)])
    for c, s, f in zip(cands, shapes_, floors):
        r = dict(((c.width, c.rate),) + c.options)[s[0]]
        if c.pinned:
            ok = expected_tokens(r, s[1]) / t >= f * expected_tokens(r, s[1]) / ref * (1 - 1e-9)
        else:
            ok = (expected_tokens(c.sure_rate(r), s[1]) if s[1] else 1.0) / t >= f / ref * (1 - 1e-9)
        if not ok:
            return False
    return True


@pytest.mark.parametrize("table", [CPU, JOB], ids=["cpu", "job"])
def test_floors_hold_at_the_sure_rates(table):
    """On every batch (each request sure of half its rate), every floor holds at the sure rates; planted: the same
    choice judged at the planning rates (``sure`` None) breaks one on some batches."""
    broken = held = 0
    for cands in _batches():
        sure = [c if c.pinned else dataclasses.replace(c, sure=0.5 * c.rate) for c in cands]
        for floors in _lefts_and_floors(len(cands)):
            got = choose_shapes(sure, table, floor=floors)
            assert _sure_keeps(table, sure, got, floors), (sure, floors, got)
            held += any(d for c, (_, d) in zip(sure, got) if not c.pinned)
            broken += not _sure_keeps(table, sure, choose_shapes(cands, table, floor=floors), floors)
    assert held > 0 and broken > 0, (held, broken)  # forests still chosen where sure enough; planted wrong on some


def _runner(table):
    """The runner's state that ``_choose_depths`` reads (no step clock), 4 plain requests."""
    r = shapes.ShapePlanMixin()
    vars(r).update(dsbd_explore=cost.Exploration(), dsbd_pass_rates=cost.PassRates(), dsbd_cost=table,
                   _dsbd_cost_base=table, _dsbd_cost_passes=table, _dsbd_clock=None, _dsbd_bare_probe=0,
                   _dsbd_probe_kind="plain", _dsbd_waiting=0, dsbd_context_len=1024,
                   input_batch=SimpleNamespace(num_tokens_no_spec=[16] * 4, num_prompt_tokens=[8] * 4),
                   dsbd_stats=SimpleNamespace(vetoed_steps=0, record_nodes=lambda nodes: None))
    return r


@pytest.mark.parametrize("planted", [False, True])
def test_one_request_tries_a_step(monkeypatch, planted):
    """Four requests switched off (their forests passed 0, 2, 1 and 0 layers, idle since) are all due a try with the
    budget open: the model is shown one try, the request whose try rate is highest, the others at their estimates;
    where forests are free it drafts, and its try spends the budget. Planted: ``MAX_TRIES`` lifted, all four are
    tries in the one step."""
    if planted:
        monkeypatch.setattr(shapes, "MAX_TRIES", 8)
    seen = []
    choose = cost.choose_shapes
    monkeypatch.setattr(cost, "choose_shapes", lambda cands, *a, **k: seen.append(cands) or choose(cands, *a, **k))
    r = _runner(cost.CostTable.from_times({1: 0.010, 64: 0.0101}, {1: 0.0}))
    states = []
    for passed in (0, 2, 1, 0):
        a = Acceptance()
        a.observe(passed, 3)
        a.idle, a.wait = 4, 1
        states.append(SimpleNamespace(beam=None, acceptance=a, max_tokens=48))
    levels = r._choose_depths([load.Level(2, 3)] * 4, [load.Shape(leaves=1, width=2, depth=3)] * 4, states,
                              [False] * 4)
    probes = [k for k, c in enumerate(seen[0]) if c.probe]
    if planted:
        assert probes == [0, 1, 2, 3]
        return
    assert probes == [1] and levels[1].depth > 0
    assert all(c.rate == pytest.approx(states[k].acceptance.width_rate(2)) for k, c in enumerate(seen[0]) if k != 1)
    assert r.dsbd_explore.probes == 1 and states[1].acceptance.trying
