"""The cost model's floor (``cost.choose_shapes(..., floor)``, the engine's ``cost.request_floors``: ``cost.FLOOR``,
the request with the most tokens left ``cost.LAST_FLOOR``): no request of a step is slowed by the others' forests
below its floor of its tokens per second in the minimal step (no forest but the pinned ones). An offline batch's time
is its slowest request's: where a code request's deep forests made a chat request's step dearer than its own forest
gained, the batch ended later than plain vLLM's (results/forest-attention-cpu-2026-12-06, "the tail").

Checked on batches of every combination of rates, with and without N' options and a pinned request: the choice keeps
the floor (the step written out pass by pass, ``test_cost.step_time``), is at least as fast as every uniform depth
that keeps it, and equals the floorless choice wherever that one keeps the floor. Planted: the floorless choice
breaks the floor on some of these batches (so the check can fail). With floors by the tokens left, the batch's
projected end stays within 1 / LAST_FLOOR of plain vLLM's; planted: the uniform floor's does not on some batches.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from test_cost import CPU, FLAT, step_time
from vllm_dsbd.engine import cost
from vllm_dsbd.engine.cost import (FLOOR, LAST_FLOOR, Candidate, CostTable, choose_shapes, expected_tokens,
                                   request_floors)

RATES = (0.0, 0.3, 0.6, 0.9)


def _expect(c: Candidate, shape) -> float:
    return expected_tokens(dict(((c.width, c.rate),) + c.options)[shape[0]], shape[1])


def _seconds(table, cands, shapes) -> float:
    return step_time(table, cands, [d for _, d in shapes], [w for w, _ in shapes])


def _minimal(cands):
    return [(c.width, c.depth if c.pinned else 0) for c in cands]


def keeps_floor(table, cands, shapes, floor=FLOOR) -> bool:
    """Every request's expected tokens per second under ``shapes`` at least ``floor`` (one per request, or one for
    all) of its rate in the minimal step (a pinned request's own forest counted there)."""
    t, ref = _seconds(table, cands, shapes), _seconds(table, cands, _minimal(cands))
    base = [_expect(c, s) for c, s in zip(cands, _minimal(cands))]
    floors = floor if isinstance(floor, list) else [floor] * len(cands)
    return all(_expect(c, s) / t >= f * b / ref * (1 - 1e-9) for c, s, b, f in zip(cands, shapes, base, floors))


def _rate(table, cands, shapes) -> float:
    return sum(_expect(c, s) for c, s in zip(cands, shapes)) / _seconds(table, cands, shapes)


def _batches():
    """Batches of 1-3 plain requests (width 2, depth 3) at every combination of RATES, the same with N' options
    (width 4, options N' = 1, 2 at lower rates), and a pinned beam request beside two plain ones."""
    out = []
    for n in (1, 2, 3):
        for combo in itertools.combinations_with_replacement(RATES, n):
            out.append([Candidate(leaves=1, width=2, depth=3, rate=a) for a in combo])
            out.append([Candidate(leaves=1, width=4, depth=3, rate=a, options=((1, a * 0.9), (2, a * 0.95)))
                        for a in combo])
    for a, b in itertools.combinations_with_replacement(RATES, 2):
        out.append([Candidate(leaves=4, width=4, depth=2, rate=0.5, catch_up=4, pinned=True),
                    Candidate(leaves=1, width=2, depth=3, rate=a), Candidate(leaves=1, width=2, depth=3, rate=b)])
    return out


@pytest.mark.parametrize("table", [FLAT, CPU], ids=["flat", "cpu"])
def test_a_floor_keeps_every_request_at_its_pace(table):
    broken = 0
    for cands in _batches():
        got = choose_shapes(cands, table, floor=FLOOR)
        assert keeps_floor(table, cands, got), (cands, got)
        free = choose_shapes(cands, table)
        binds = not keeps_floor(table, cands, free)
        if not binds:
            assert got == free, (cands, got, free)  # the floor changes only choices that break it
        broken += binds
        # at least as fast as the minimal step and every full forest that keeps the floor, and where the floor binds
        # every first layer that keeps it (the ends of the two orders of increments the rule scans)
        for d in (0, 1, 3) if binds else (0, 3):
            uni = [(c.width, c.depth if c.pinned else min(d, c.depth)) for c in cands]
            if keeps_floor(table, cands, uni):
                assert _rate(table, cands, got) >= _rate(table, cands, uni) * (1 - 1e-9), (cands, got, uni)
    # planted: without the floor some of these batches' choices slow a request below it (the check can fail)
    assert broken > 0 if table is CPU else broken >= 0


def test_a_code_request_does_not_slow_a_chat_request_beside_it():
    """The README job's tail in two requests: a code request that passes most layers beside a chat request that
    passes none (CPU table: a node costs). Without the floor the code request drafts while the chat request, which
    gains nothing, pays its step; with it, the chat request keeps its pace."""
    cands = [Candidate(leaves=1, width=1, depth=3, rate=0.95), Candidate(leaves=1, width=1, depth=3, rate=0.0)]
    free = choose_shapes(cands, CPU)
    assert free[0][1] > 0 and not keeps_floor(CPU, cands, free)
    got = choose_shapes(cands, CPU, floor=FLOOR)
    assert keeps_floor(CPU, cands, got)
    assert _expect(cands[1], got[1]) / _seconds(CPU, cands, got) >= FLOOR / _seconds(CPU, cands, _minimal(cands))


def test_a_floor_of_zero_is_the_floorless_choice():
    for cands in _batches():
        assert choose_shapes(cands, CPU, floor=0.0) == choose_shapes(cands, CPU)


# --- floors by the tokens left (cost.request_floors): the request with the most left keeps LAST_FLOOR of its pace

def test_request_floors():
    assert request_floors([48, 48, 48]) == [LAST_FLOOR] * 3
    assert request_floors([10, 48]) == [FLOOR, LAST_FLOOR]
    assert request_floors([97, 100]) == [pytest.approx(LAST_FLOOR * 0.97), LAST_FLOOR]
    assert request_floors([0, -3]) == [FLOOR, FLOOR] and request_floors([]) == []


def _end(table, cands, shapes, left) -> float:
    """The batch's projected end if every later step were this one: the most ``R_i T / E_i``."""
    t = _seconds(table, cands, shapes)
    return max(r * t / _expect(c, s) for c, s, r in zip(cands, shapes, left))


def _lefts(n):
    """Tokens left for a batch of ``n``: all alike, the first with the most, the last with the most, spread."""
    return [[48] * n, [48] + [12] * (n - 1), [12] * (n - 1) + [48], [48 - 15 * k for k in range(n)]]


# the README job's shape on a CPU: a step of 8 requests ~40 ms, a forest node ~2-4% of it, a cheap draft
JOB = CostTable.from_times({1: 0.040, 2: 0.0415, 4: 0.044, 16: 0.060}, {1: 0.0005, 16: 0.001})


@pytest.mark.parametrize("table", [FLAT, CPU, JOB], ids=["flat", "cpu", "job"])
def test_floors_by_tokens_left_keep_the_batch_end(table):
    """Every request keeps its floor, and where no request is pinned (plain vLLM's step is the minimal one) the
    batch's projected end is within 1 / LAST_FLOOR of the minimal step's. Planted: the uniform FLOOR's choices end
    later than that on some batches where a node costs less than 5% of the step (JOB)."""
    late = 0
    for cands in _batches():
        for left in _lefts(len(cands)):
            floors = request_floors(left)
            got = choose_shapes(cands, table, floor=floors)
            assert keeps_floor(table, cands, got, floors), (cands, left, got)
            uniform = choose_shapes(cands, table, floor=FLOOR)
            if any(c.pinned for c in cands):
                continue
            end = _end(table, cands, _minimal(cands), left) / LAST_FLOOR
            assert _end(table, cands, got, left) <= end * (1 + 1e-9), (cands, left, got)
            late += _end(table, cands, uniform, left) > end * (1 + 1e-9)
    assert late > 0 if table is JOB else late >= 0  # (job: 51 of 272)


def test_the_readme_jobs_code_request_waits_for_the_chat_request_with_as_much_left():
    """A code request that passes most layers beside a chat request that passes none, with as many tokens left: a
    forest that costs the chat request more than 1% of its pace is not drafted (the uniform floor drafts it); with
    the chat request nearly done, the code request drafts."""
    cands = [Candidate(leaves=1, width=1, depth=3, rate=0.95), Candidate(leaves=1, width=1, depth=3, rate=0.0)]
    uniform = choose_shapes(cands, JOB, floor=FLOOR)
    assert uniform[0][1] > 0  # the old rule: the chat request slowed by up to 5%
    assert choose_shapes(cands, JOB, floor=request_floors([48, 48])) == [(1, 0), (1, 0)]
    assert choose_shapes(cands, JOB, floor=request_floors([48, 4]))[0][1] > 0


def _lefts_and_floors(n):
    for left in _lefts(n):
        yield request_floors(left)
    yield [FLOOR] * n


@pytest.mark.parametrize("table", [FLAT, CPU, JOB], ids=["flat", "cpu", "job"])
def test_the_floors_bound_only_skips_steps_without_a_forest(monkeypatch, table):
    """``floors_exclude`` (the O(R) bound ``choose_shapes`` returns the minimal step on): wherever it holds, the full
    search, run with the bound off, finds no forest that keeps every floor either. It fires on some batches. Planted:
    a bound that asks only that the cheapest forest breaks one request's floor (not that every request must draft and
    one cannot pay) would skip forests the full search takes."""
    fired = wrong = 0
    for cands in _batches():
        for floors in _lefts_and_floors(len(cands)):
            scale = [1.0 / f for f in floors]
            full = _full_search(monkeypatch, cands, table, floors)
            if cost.floors_exclude(cands, table, scale):
                fired += 1
                assert full == _minimal(cands), (cands, floors, full)
            wrong += _planted_bound(cands, table, scale) and full != _minimal(cands)
    assert (fired > 0 and wrong > 0) if table is not FLAT else fired == wrong == 0  # (cpu: 304, 25; job: 36, 164)


def _full_search(monkeypatch, cands, table, floors):
    with monkeypatch.context() as m:
        m.setattr(cost, "floors_exclude", lambda *a: False)
        return choose_shapes(cands, table, floor=floors)


def _planted_bound(cands, table, scale) -> bool:
    """Wrong: the cheapest forest breaks the floor of the request with the highest floor, so none drafts."""
    if any(c.pinned for c in cands):
        return False
    leaves = sum(c.leaves for c in cands)
    ref = table.step + table.target_time(leaves)
    one = table.step + table.target_time(leaves + 1) + table.draft_step + table.node
    return min(scale) * ref < one


def _one_round_bound(cands, table, scale) -> bool:
    """``floors_exclude`` before its fixed point (2026-12-07): every request at its smallest forest, each held to its
    best forest's tokens alone."""
    leaves = sum(c.leaves for c in cands)
    ref = table.step + table.target_time(leaves)
    if any(cost._keeps_floor(x, ref, table.step + table.target_time(leaves + 1) + table.draft_step + table.node)
           for x in scale):
        return False
    nodes = sum(min([c.width] + [w for w, _ in c.options]) for c in cands)
    every = (table.step + table.target_time(leaves + nodes) + table.draft_step + table.node * nodes
             + table.draft_time(sum(c.catch_up for c in cands)))
    return any(not cost._keeps_floor(expected_tokens(max([c.rate] + [r for _, r in c.options]), c.depth) * x, ref,
                                     every) for c, x in zip(cands, scale))


# two steps of the README job (8 requests: 4 code edits, 4 chats; width 2, depth 3, N' = 1 beside it), as the engine
# saw them on 2026-12-07: its corrected table (ms) and each request's (rate at N = 2, rate at N' = 1) and floor
JOB_TARGET_MS = {1: 27.11, 2: 27.11, 4: 27.11, 8: 32.29, 16: 41.98, 32: 64.47, 64: 104.81, 128: 192.65, 256: 374.55}
JOB_STEPS = [
    (5.07, 0.616,
     [(1.0, .927), (1.0, .911), (.8186, .65), (.8186, .65), (.4, .24), (.4, .24), (.44, .44), (.7333, .24)],
     [0.95, 0.95, 0.95, 0.95, 0.99, 0.99, 0.966, 0.966]),
    (5.07, 1.278, [(1.0, .8)] * 4 + [(.6828, .4)] * 4, [0.95] * 4 + [0.99] * 4),
]


@pytest.mark.parametrize("step", range(len(JOB_STEPS)))
def test_the_floors_bound_rules_out_the_readme_jobs_steps(monkeypatch, step):
    """The fixed point of ``floors_exclude`` returns the README job's steps at once where the full search (bound off)
    finds no forest either (without floors it drafts the code requests); the bound's first round alone (as it was
    before) does not fire on them."""
    draft_step, node, rates, floors = JOB_STEPS[step]
    table = dataclasses.replace(CostTable.from_times({n: t / 1e3 for n, t in JOB_TARGET_MS.items()}, {1: 0.0},
                                                     9.88e-3), draft_step=draft_step / 1e3, node=node / 1e3)
    cands = [Candidate(1, 2, 3, a, options=((1, b),)) for a, b in rates]
    scale = [1.0 / f for f in floors]
    assert cost.floors_exclude(cands, table, scale)
    assert _full_search(monkeypatch, cands, table, floors) == _minimal(cands)
    assert any(d for _, d in choose_shapes(cands, table))  # without floors forests pay: the floors rule them out
    assert not _one_round_bound(cands, table, scale)
