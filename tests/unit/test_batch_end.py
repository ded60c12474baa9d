"""The batch's end in the cost model (``batch_end.End``, ``cost.choose_shapes(..., left=)``, ``cost.end_excludes``):
while none waits, an offline batch ends with its last request, so a step moves its end by the drop of the most tokens
left over the requests, an order statistic of their gains. With six requests tied at ``max_tokens`` (the README
job), the end moves past one token only where all six pass; the floors alone (``request_floors``) priced it at each
one's own expected gain and drafted where the end did not move.

Checked: ``End.tokens`` against the law written out (every joint outcome of the requests' gains enumerated, each
rate at ``End.hope``'s bound of its evidence); ``End.bound`` above it for every shape; the choice with ``left`` keeps
the end at ``LAST_FLOOR`` of the minimal step's pace and every floor, on batches of every combination of rates,
evidence and tokens left; ``end_excludes`` fires only where the full search (bound off) finds no forest. Planted: the
floors alone break the end on some of these batches, and take forests in the README job's first step of a call
(rates from the engine-wide pool's 256 layers), where the end rules them out; a batch of one and code edits that pass
most layers keep their forests, and so do four tied requests after one forest that passed every layer (a self-draft:
judged at the estimate instead of its bound, they would not). On a probe's step the probe drafts and the others only
where their forests pay for the end beside it (planted: the whole step exempt drafts all eight).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from test_cost import CPU, FLAT, step_time
from test_cost_floor import JOB, JOB_TARGET_MS, _batches, _expect, _minimal, keeps_floor
from vllm_dsbd.engine import cost
from vllm_dsbd.engine.acceptance import MEMORY, POOL_MEMORY, PRIOR_WEIGHT, Acceptance, PassRates
from vllm_dsbd.engine.batch_end import End
from vllm_dsbd.engine.cost import LAST_FLOOR, Candidate, CostTable, choose_shapes, request_floors


def _law(a: float, d: int) -> list[tuple[int, float]]:
    """(tokens, probability) of one step of a request at per-layer rate ``a`` with a forest of ``d`` layers."""
    return [(k + 1, a ** k * (1.0 - a)) for k in range(d)] + [(d + 1, a ** d)]


def end_oracle(left, rates, depths) -> float:
    """``R_max - E[max_i (R_i - X_i)]``, every joint outcome enumerated."""
    most, total = max(left), 0.0
    for outcome in itertools.product(*[_law(a, d) for a, d in zip(rates, depths)]):
        p = 1.0
        for _, q in outcome:
            p *= q
        total += p * (most - max(r - x for r, (x, _) in zip(left, outcome)))
    return total


def _hope(a: float, tried: float) -> float:
    return min(1.0, a + math.sqrt(a * (1 - a) / (PRIOR_WEIGHT + tried)))


def test_end_tokens_is_the_order_statistic():
    checked = 0
    for left in [(8, 8), (8, 7), (8, 8, 8), (8, 7, 6), (8, 6, 8), (5, 8, 8, 7)]:
        for tried in (0.0, 30.0):
            end = End(left, [tried] * len(left))
            for rates in itertools.product((0.0, 0.4, 0.9), repeat=len(left)):
                hoped = [_hope(a, tried) for a in rates]
                for depths in itertools.product(range(4), repeat=len(left)):
                    want = end_oracle(left, hoped, depths)
                    assert end.tokens(rates, depths) == pytest.approx(want, abs=1e-12), (left, rates, depths)
                    assert end.bound([[a] for a in rates], [3] * len(left)) >= want - 1e-12
                    checked += 1
    assert checked > 2000
    # one request: its own expected tokens; six tied at 0.6 and depth 2: barely past one token (with evidence)
    assert End([48], [1e12]).tokens([0.6], [3]) == pytest.approx(cost.expected_tokens(0.6, 3))
    assert End([48] * 6, [1e12] * 6).tokens([0.6] * 6, [2] * 6) == pytest.approx(1 + 0.6 ** 6 + 0.6 ** 12)
    # no evidence: the bound, 0.6 + sqrt(0.24 / 2)
    assert End([48], [0.0]).tokens([0.6], [1]) == pytest.approx(1.6 + math.sqrt(0.12))


def _end_pace(table, cands, shapes, left) -> float:
    """The batch's end's tokens per second under ``shapes`` (each rate at its evidence's bound), over the minimal
    step's (one token)."""
    rates = [_hope(dict(((c.width, c.rate),) + c.options)[w], c.tried) for c, (w, _) in zip(cands, shapes)]
    t, ref = (step_time(table, cands, [d for _, d in s], [w for w, _ in s]) for s in (shapes, _minimal(cands)))
    return end_oracle(left, rates, [d for _, d in shapes]) / t * ref


def _lefts(n):
    return [[48] * n, [48] + [47] * (n - 1), [48] + [30] * (n - 1)][: 1 if n == 1 else 3]


def _full_search(monkeypatch, cands, table, floors, left):
    with monkeypatch.context() as m:
        m.setattr(cost, "end_excludes", lambda *a: False)
        return choose_shapes(cands, table, floor=floors, left=left)


@pytest.mark.parametrize("table", [FLAT, CPU, JOB], ids=["flat", "cpu", "job"])
def test_the_choice_keeps_the_batch_end(monkeypatch, table):
    """With ``left``, every choice keeps the end at LAST_FLOOR of the minimal step's pace and every floor; where
    ``end_excludes`` fires, the full search finds no forest. Planted: the floors alone break the end on some batches
    of every table (a draft pass costs on each)."""
    late = fired = 0
    for cands, tried in itertools.product(_batches(), (0.0, 16.0, 256.0)):
        if any(c.pinned for c in cands):
            continue
        cands = [dataclasses.replace(c, tried=tried) for c in cands]
        for left in _lefts(len(cands)):
            floors = request_floors(left)
            got = choose_shapes(cands, table, floor=floors, left=left)
            assert keeps_floor(table, cands, got, floors), (cands, left, got)
            assert _end_pace(table, cands, got, left) >= LAST_FLOOR * (1 - 1e-9), (cands, left, got)
            if cost.end_excludes(cands, table, End(left, [tried] * len(cands))):
                fired += 1
                assert _full_search(monkeypatch, cands, table, floors, left) == _minimal(cands), (cands, left)
            floors_only = choose_shapes(cands, table, floor=floors)
            late += _end_pace(table, cands, floors_only, left) < LAST_FLOOR * (1 - 1e-9)
    assert late > 0 and (fired > 0 or table is FLAT), (late, fired)  # (flat: 20, 0; cpu: 1, 333; job: 22, 268)


def _job_table(draft_step_ms: float, node_ms: float) -> CostTable:
    return dataclasses.replace(CostTable.from_times({n: t / 1e3 for n, t in JOB_TARGET_MS.items()}, {1: 0.0},
                                                    9.88e-3), draft_step=draft_step_ms / 1e3, node=node_ms / 1e3)


def test_the_readme_jobs_first_step_drafts_nothing():
    """The README job's first decode step of a call (its corrected table; eight requests at the source's engine-wide
    rate 0.63, width 2 and N' = 1, as results/sure-floors-2026-12-07/choices_trace.txt saw them, all with 48 tokens
    left): the floors alone take forests; the batch's end rules them out (by the bound). With one request left
    behind by 8 tokens, it drafts alone (its gain is the end's)."""
    table = _job_table(5.07, 0.616)
    cands = [Candidate(1, 2, 3, 0.63, options=((1, 0.5),), tried=256.0)] * 8
    left = [48] * 8
    assert any(d for _, d in choose_shapes(cands, table, floor=request_floors(left)))  # planted: the floors alone
    assert cost.end_excludes(cands, table, End(left, [256.0] * 8))
    assert choose_shapes(cands, table, floor=request_floors(left), left=left) == _minimal(cands)
    ahead = [48] + [40] * 7
    got = choose_shapes(cands, table, floor=request_floors(ahead), left=ahead)
    assert got[0][1] > 0, got


def test_a_batch_of_one_and_code_edits_keep_their_forests():
    """Alone, the end is the request's own gain: the same choice as the floors alone. Four code edits tied at 48
    left that pass 0.95 of layers still draft (the end moves ~0.81 tokens a layer)."""
    for a in (0.3, 0.6, 0.9):
        for table in (CPU, JOB):
            one = [Candidate(1, 2, 3, a, options=((1, a * 0.9),))]
            assert choose_shapes(one, table, floor=[LAST_FLOOR], left=[48]) == choose_shapes(one, table,
                                                                                           floor=[LAST_FLOOR])
    table = _job_table(5.07, 0.616)
    code = [Candidate(1, 2, 3, 0.95, options=((1, 0.9),), tried=16.0)] * 4
    got = choose_shapes(code, table, floor=request_floors([48] * 4), left=[48] * 4)
    assert all(d > 0 for _, d in got), got
    assert _end_pace(table, code, got, [48] * 4) >= LAST_FLOOR
    assert sum(_expect(c, s) for c, s in zip(code, got)) > 4 * 1.5


def test_tied_requests_whose_first_forest_passed_keep_drafting():
    """Four tied requests, each after one forest of 3 layers that passed them all (estimate (1.2 + 3) / 5 = 0.84 on
    5 layers of evidence): at their bound they draft; planted: judged at the estimate (evidence taken as certain),
    the end rules their forests out, and they would never learn their rate."""
    table = _job_table(5.07, 0.616)
    a = (0.6 * PRIOR_WEIGHT + 3) / (PRIOR_WEIGHT + 3)
    cands = [Candidate(1, 2, 3, a, tried=3.0)] * 4
    left, floors = [48] * 4, request_floors([48] * 4)
    assert all(d > 0 for _, d in choose_shapes(cands, table, floor=floors, left=left))
    sure = [dataclasses.replace(c, tried=1e12) for c in cands]
    assert choose_shapes(sure, table, floor=floors, left=left) == _minimal(cands)


def test_a_candidate_carries_the_evidence_behind_its_rate():
    """``Candidate.tried``: a fresh request planning at the engine-wide rate carries that rate's layers
    (``PassRates.estimate``), one with forests of its own its own layers (decayed past ``MEMORY``)."""
    pool = PassRates()
    for _ in range(100):
        pool.observe("src", 2, 2, 3)  # 3 layers tried a forest, 2 passed: 300 tried, decayed to POOL_MEMORY
    rate, tried = pool.estimate("src", 2)
    assert rate == pool.rate("src", 2) and tried == POOL_MEMORY and pool.estimate("other", 2) is None
    fresh = Acceptance()
    c = fresh.candidate(1, 2, 3, pool=rate, pool_tried=tried)
    assert (c.rate, c.tried, c.probe) == (rate, POOL_MEMORY, False)
    own = Acceptance()
    own.observe(3, 3)
    assert own.candidate(1, 2, 3, pool=rate, pool_tried=tried).tried == 3.0
    for _ in range(10):
        own.observe(3, 3)
    assert own.candidate(1, 2, 3, low=1, pool=rate, pool_tried=tried).tried == MEMORY


def test_on_a_probes_step_the_others_draft_only_where_the_end_pays(monkeypatch):
    """The README job's probe steps (results/batch-end-2026-12-07: one request tries at 0.95, seven tied beside it
    at the engine-wide rate 0.65 on 71 layers): the probe drafts, the others do not (their forests do not move the
    end beside the probe's alone). Planted: with the whole step exempt (the rule of 321bf40), all eight draft. Three
    code edits (0.95 on 16 layers) beside a probe: their forests pay for the end, and stay."""
    table = _job_table(5.07, 0.616)
    probe = Candidate(1, 2, 3, 0.95, options=((1, 0.95),), probe=True)
    cands = [probe] + [Candidate(1, 2, 3, 0.65, options=((1, 0.5),), tried=71.0)] * 7
    left, floors = [32] * 8, request_floors([32] * 8)
    got = choose_shapes(cands, table, floor=floors, left=left)
    assert got[0][1] > 0 and not any(d for _, d in got[1:]), got
    with monkeypatch.context() as m:
        m.setattr(cost, "_probes_alone", lambda cands, table, shapes, left, scale: shapes)
        assert all(d > 0 for _, d in choose_shapes(cands, table, floor=floors, left=left))
    code = [probe] + [Candidate(1, 2, 3, 0.95, options=((1, 0.9),), tried=16.0)] * 3
    got = choose_shapes(code, table, floor=request_floors([48] * 4), left=[48] * 4)
    assert all(d > 0 for _, d in got), got
