"""The cost model's online correction (``engine/step_clock.py``): measured step surpluses enter the table as ``step``
and ``draft_step``, and a drafting step's host cost the start-up table did not see switches drafting off where it
does not pay (the batch-1 CPU case of results/cost-model-2026-11-26), while drafting that pays stays on."""
import pytest

from vllm_dsbd.engine import cost, step_clock
from vllm_dsbd.engine.step_clock import StepClock

# one decode request: target 38.5 ms flat up to 4 tokens (the CPU table of 2026-11-26), draft passes 8.5 ms
TABLE = cost.CostTable.from_times({1: 0.0385, 4: 0.0385, 8: 0.0494, 16: 0.0656}, {1: 0.0085, 16: 0.016})


def _one(rate):
    return [cost.Candidate(leaves=1, width=2, depth=3, rate=rate, catch_up=1)]


def test_draft_step_is_the_drafting_surplus_over_the_bare_one():
    c = StepClock()
    for _ in range(step_clock.MIN_STEPS - 1):
        c.observe(0.050, 0.040, drafted=True)
    assert c.corrected(TABLE) is TABLE  # too few drafting steps yet
    c.observe(0.050, 0.040, drafted=True)
    t = c.corrected(TABLE)  # no bare step measured yet: the bare surplus counts as 0
    assert t.draft_step == pytest.approx(0.010) and t.step == 0.0
    for _ in range(step_clock.MIN_STEPS):
        c.observe(0.030, 0.040, drafted=False)  # bare steps 10 ms under the table: drafting's extra is 20 ms
    t = c.corrected(TABLE)
    assert t.step == 0.0 and t.draft_step == pytest.approx(0.020)
    d = StepClock()
    for _ in range(5):
        d.observe(0.046, 0.040, drafted=False)
        d.observe(0.056, 0.040, drafted=True)
    t = d.corrected(TABLE)  # every step 6 ms over the table, drafting ones 10 ms more: only the 10 ms enter
    assert t.step == 0.0 and t.draft_step == pytest.approx(0.010)
    e = StepClock()
    for _ in range(5):
        e.observe(0.060, 0.040, drafted=False)
        e.observe(0.050, 0.040, drafted=True)
    assert e.corrected(TABLE) is TABLE  # drafting steps no dearer than bare ones: nothing to add


def test_moving_average_follows_the_newest_steps():
    c = StepClock()
    for _ in range(50):
        c.observe(0.100, 0.040, drafted=True)
    for _ in range(100):
        c.observe(0.045, 0.040, drafted=True)
    assert c.drafting == pytest.approx(0.005, abs=1e-4)


def test_host_cost_of_drafting_switches_it_off_at_batch_one():
    rate = 0.45  # about what the distilled draft passes per layer at W = 2 (1.45 tokens per forest)
    assert cost.choose(_one(rate), TABLE)[0] >= 1  # by the start-up table drafting pays
    c = StepClock()
    for _ in range(step_clock.MIN_STEPS):  # measured: a drafting step costs 30 ms more than its passes
        c.observe(0.030 + 0.050, 0.050, drafted=True)
        c.observe(0.0385, 0.0385, drafted=False)
    corrected = c.corrected(TABLE)
    assert corrected.draft_step == pytest.approx(0.030)
    assert cost.choose(_one(rate), corrected) == [0]
    # a draft that passes nearly every layer still pays for the same host cost
    assert cost.choose(_one(0.95), corrected)[0] >= 1
    # and the predicted draft seconds of a chosen shape include the drafting step's cost
    shapes = cost.choose_shapes(_one(0.95), corrected)
    assert cost.draft_seconds(_one(0.95), shapes, corrected) == pytest.approx(
        cost.draft_seconds(_one(0.95), shapes, TABLE) + 0.030)


def test_start_planned_finish_measure_one_step(monkeypatch):
    now = iter([10.0, 10.090])
    monkeypatch.setattr(step_clock.time, "perf_counter", lambda: next(now))
    c = StepClock()
    for _ in range(step_clock.WARMUP):  # the first decode steps are not measured
        c.start(4)
        c.finish(TABLE)
    assert c.n_drafting == c.n_bare == 0
    c.start(4)
    c.planned(0.017, True)
    c.finish(TABLE)
    assert c.n_drafting == 1 and c.drafting == pytest.approx(0.090 - 0.0385 - 0.017)
    c.start(None)  # a step with a prefill: not measured
    c.finish(TABLE)
    assert c.n_drafting == 1 and c.n_bare == 0
