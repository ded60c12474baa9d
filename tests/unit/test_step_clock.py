"""The cost model's online correction (``engine/step_clock.py``): measured window surpluses, classed by whether the
window verified and drafted forests, enter the table as ``draft_step`` (a drafting step's extra) and ``step`` (every
step's surplus); a forest is charged to both windows that hold
its costs; medians ignore a slow first window and expire; and a drafting step's host cost the start-up table did not
see switches drafting off where it does not pay (the batch-1 CPU case of results/cost-model-2026-11-26), while drafting
that pays stays on; and a bare step's own surplus, charged to ``step``, switches drafting on where it pays (the H100
case of results/gpu/2026-11-27, run 3)."""
import dataclasses

import pytest

from vllm_dsbd.engine import cost, step_clock
from vllm_dsbd.engine.step_clock import StepClock

# one decode request: target 38.5 ms flat up to 4 tokens (the CPU table of 2026-11-26), draft passes 8.5 ms
TABLE = cost.CostTable.from_times({1: 0.0385, 4: 0.0385, 8: 0.0494, 16: 0.0656}, {1: 0.0085, 16: 0.016})


def _one(rate):
    return [cost.Candidate(leaves=1, width=2, depth=3, rate=rate, catch_up=1)]


N, D, V, B = (False, False), (True, False), (False, True), (True, True)  # (drafted, verified) of a window


def _observe(c, seconds, predicted, kind, n=1):
    for _ in range(n):
        c.observe(seconds, predicted, *kind)


def test_draft_step_is_the_drafting_surplus_over_the_bare_one():
    c = StepClock()
    _observe(c, 0.050, 0.040, B, step_clock.MIN_STEPS - 1)
    assert c.corrected(TABLE) is TABLE  # too few drafting windows yet
    _observe(c, 0.050, 0.040, B)
    t = c.corrected(TABLE)  # no bare window measured yet: the bare surplus counts as 0
    assert t.draft_step == pytest.approx(0.010) and t.step == 0.0
    _observe(c, 0.030, 0.040, N, step_clock.MIN_STEPS)  # bare windows 10 ms under the table: drafting's extra is 20 ms
    t = c.corrected(TABLE)
    assert t.step == 0.0 and t.draft_step == pytest.approx(0.020)  # a surplus below 0 is not charged to every step
    d = StepClock()
    for _ in range(5):
        _observe(d, 0.046, 0.040, N)
        _observe(d, 0.056, 0.040, B)
    t = d.corrected(TABLE)  # every window 6 ms over the table, drafting ones 10 ms more: 6 ms to every step, 10 to drafting
    assert t.step == pytest.approx(0.006) and t.draft_step == pytest.approx(0.010)
    e = StepClock()
    for _ in range(5):
        _observe(e, 0.060, 0.040, N)
        _observe(e, 0.050, 0.040, B)
    t = e.corrected(TABLE)  # drafting windows no dearer than bare ones: nothing added to drafting, 20 ms to every step
    assert t.draft_step == 0.0 and t.step == pytest.approx(0.020)


def test_a_forest_is_charged_to_both_windows_that_hold_it():
    """A forest planned now now and then (a try): its drafting lands in this window (7 ms), its verification in the
    next (5 ms). Classed by what they hold, the two windows add up to the 12 ms a drafting step costs; classed by the
    plan alone (the old clock) the verification window counted as bare and the extra came out 7 - 5 = 2 ms."""
    c = StepClock()
    for _ in range(step_clock.MIN_STEPS + 2):
        _observe(c, 0.040, 0.040, N, 4)
        _observe(c, 0.047, 0.040, D)
        _observe(c, 0.045, 0.040, V)
    assert c.extra() == pytest.approx(0.012)
    _observe(c, 0.052, 0.040, B, 3 * step_clock.MIN_STEPS)  # drafting every step: the same 12 ms
    assert c.extra() == pytest.approx(0.012)
    # every window 9 ms over the table, no window without forests measured: the bare surplus from the other kinds
    d = StepClock()
    _observe(d, 0.049 + 0.012, 0.040, B, 20)
    _observe(d, 0.049 + 0.007, 0.040, D, step_clock.MIN_STEPS)
    _observe(d, 0.049 + 0.005, 0.040, V, step_clock.MIN_STEPS)
    assert d.extra() == pytest.approx(0.012)
    e = StepClock()
    _observe(e, 0.049 + 0.012, 0.040, B, 20)  # drafting in every window: the 9 ms stay in (errs to drafting less)
    assert e.extra() == pytest.approx(0.021)


def test_the_start_and_planned_calls_class_each_window():
    c = StepClock(warmup=0, forest_warmup=0)
    for drafted in (False, True, True, False, False):
        c.start(4)
        c.planned(0.0, drafted)
        c.finish(TABLE)
    # neither, drafted only, verified only, both
    assert [len(q) for q in c.surplus_of(step_clock.PLAIN)] == [2, 1, 1, 1]


def test_medians_ignore_a_slow_first_window_and_old_ones_expire():
    c = StepClock()
    _observe(c, 0.240, 0.040, B)  # the first drafting window, slowed by one-time costs
    _observe(c, 0.045, 0.040, B, step_clock.MIN_STEPS)
    _observe(c, 0.040, 0.040, N, step_clock.MIN_STEPS)
    assert c.extra() == pytest.approx(0.005)  # a moving average that starts at its first sample kept ~0.81 of 200 ms
    _observe(c, 0.040, 0.040, N, step_clock.HORIZON)  # drafting switched off: its windows expire, the extra is 0
    assert c.extra() == 0.0 and c.summary()["n_both"] == 0


def test_the_window_follows_the_newest_steps():
    c = StepClock()
    _observe(c, 0.100, 0.040, B, 50)
    _observe(c, 0.045, 0.040, B, step_clock.WINDOW)
    assert c.extra() == pytest.approx(0.005)


def test_host_cost_of_drafting_switches_it_off_at_batch_one():
    rate = 0.45  # about what the distilled draft passes per layer at W = 2 (1.45 tokens per forest)
    assert cost.choose(_one(rate), TABLE)[0] >= 1  # by the start-up table drafting pays
    c = StepClock()
    for _ in range(step_clock.MIN_STEPS):  # measured: a drafting step costs 30 ms more than its passes
        _observe(c, 0.030 + 0.050, 0.050, B)
        _observe(c, 0.0385, 0.0385, N)
    corrected = c.corrected(TABLE)
    assert corrected.draft_step == pytest.approx(0.030)
    assert cost.choose(_one(rate), corrected) == [0]
    # a draft that passes nearly every layer still pays for the same host cost
    assert cost.choose(_one(0.95), corrected)[0] >= 1
    # and the predicted draft seconds of a chosen shape include the drafting step's cost
    shapes = cost.choose_shapes(_one(0.95), corrected)
    assert cost.draft_seconds(_one(0.95), shapes, corrected) == pytest.approx(
        cost.draft_seconds(_one(0.95), shapes, TABLE) + 0.030)


def _seeded_corrections(corrected):
    """The tables ``corrected`` (``StepClock.corrected`` or a planted variant) gives from a table seeded by the start-up
    probe (40 ms a drafting step, 2 ms a node): before forests are measured, after windows measured at 5 ms a drafting
    step and 1 ms a node, and after more measured at 60 ms a drafting step."""
    seeded = dataclasses.replace(TABLE, draft_step=0.040, node=0.002)
    c, out = StepClock(), []
    _observe(c, 0.0385, 0.0385, N, step_clock.MIN_STEPS)
    out.append(corrected(c, seeded))
    for n in (4, 6, 8) * 2:  # a window's node 0.5 ms: it counts in two windows (drafted, verified), so 1 ms a node
        c.observe(0.0385 + 0.005 + 0.0005 * n, 0.0385, True, True, nodes=n)
    out.append(corrected(c, seeded))
    for n in (4, 6, 8) * step_clock.WINDOW:
        c.observe(0.0385 + 0.060 + 0.0005 * n, 0.0385, True, True, nodes=n)
    out.append(corrected(c, seeded))
    return out


def test_the_start_up_probe_prices_forests_until_they_are_measured():
    """A table seeded by the start-up probe (``forest_probe.py``) prices the first forests; once forests are measured,
    their measured extra replaces the probe's, downwards as well as upwards. The surpluses are over the passes alone,
    so adding them to the probe's (the planted variant) counts the forests' work twice and keeps declining forests
    that the measurement says pay."""
    probe, cheap, dear = _seeded_corrections(StepClock.corrected)
    assert (probe.draft_step, probe.node) == (0.040, 0.002)  # forests not measured: the probe's prices
    assert cost.choose(_one(0.6), probe) == [0]  # which decline a forest passing 60% of its layers
    assert cheap.draft_step == pytest.approx(0.005) and cheap.node == pytest.approx(0.001)
    assert cost.choose(_one(0.6), cheap)[0] >= 1  # the measured prices draft it
    assert dear.draft_step == pytest.approx(0.060) and dear.node == pytest.approx(0.001)

    def added(clock, table):  # the planted variant: the measured extra added to the probe's
        got = StepClock.corrected(clock, dataclasses.replace(table, draft_step=0.0, node=0.0))
        return dataclasses.replace(got, draft_step=table.draft_step + got.draft_step, node=table.node + got.node)

    _, cheap, _ = _seeded_corrections(added)
    assert cheap.draft_step == pytest.approx(0.045) and cost.choose(_one(0.6), cheap) == [0]


def test_start_planned_finish_measure_one_step(monkeypatch):
    now = iter([10.0, 10.090])
    monkeypatch.setattr(step_clock.time, "perf_counter", lambda: next(now))
    c = StepClock(forest_warmup=0)
    for _ in range(step_clock.WARMUP):  # the first decode steps are not measured
        c.start(4)
        c.finish(TABLE)
    assert c.steps == 0
    c.start(4)
    c.planned(0.017, True)
    c.finish(TABLE)
    assert c.steps == 1 and c.median(step_clock.DRAFTED) == (pytest.approx(0.090 - 0.0385 - 0.017), 1)
    c.start(None)  # a step with a prefill: not measured
    c.finish(TABLE)
    assert c.steps == 1


def test_a_bare_steps_surplus_switches_drafting_on_where_it_pays():
    """The H100 default-config run (results/gpu/2026-11-27 run 3): target 1.44 ms flat, draft 1.08 ms; bare steps
    12.1 ms over the table, drafting-only windows 21.3 ms, verifying-only windows 18.1 ms. A bare step costs 13.5 ms, a
    step drafting depth 2 at width 4 13.5 + 15.2 + 2 x 1.08 = 30.9 ms: drafting pays where a forest emits more than
    30.9 / 13.5 = 2.28 tokens (a rate above ~0.87 at depth 2). With the bare surplus charged nowhere (the old
    correction) a bare step looked like 1.44 ms and drafting never paid (it would need 13 tokens per pass)."""
    table = cost.CostTable.from_times({1: 0.00144, 1024: 0.00144}, {1: 0.00108, 1024: 0.00108})
    c = StepClock()
    _observe(c, 0.0121 + 0.00144, 0.00144, N, 32)
    _observe(c, 0.0213 + 0.00144, 0.00144, D, 3)
    _observe(c, 0.0181 + 0.00144, 0.00144, V, 3)
    t = c.corrected(table)
    assert t.step == pytest.approx(0.0121) and t.draft_step == pytest.approx(0.0152)
    one = [cost.Candidate(leaves=1, width=4, depth=2, rate=0.95, catch_up=1)]
    assert cost.choose(one, t) == [2]
    assert cost.choose(one, dataclasses.replace(t, step=0.0)) == [0]  # the surplus charged nowhere: never drafts
    assert cost.choose([dataclasses.replace(one[0], rate=0.5)], t) == [0]  # 1.75 tokens for 2.28x the time
    # the step's surplus is what the summary reports beside the drafting extra
    assert c.summary()["step"] == pytest.approx(0.0121)


def _window(c, seconds, tokens, reqs, drafted=False, verified=False, kind=step_clock.PLAIN, monkeypatch=None,
            queued=False):
    """One measured window through start / planned / emitted / finish, ``seconds`` long (the clock's time patched);
    ``queued``: requests wait in its step."""
    now = [100.0]
    monkeypatch.setattr(step_clock.time, "perf_counter", lambda: now[0])
    c._next_verified = verified
    c.start(reqs, reqs, queued)
    c.planned(0.0, drafted, 2 if drafted else 0)
    for k in kind if isinstance(kind, tuple) else (kind,):  # a tuple: a window of both kinds
        c.emitted(tokens, k)
    now[0] += seconds
    c.finish(TABLE)


def test_forests_lose_compares_tokens_per_second_at_the_same_batch_size(monkeypatch):
    """At batch 8 forests emit 12 tokens in 30 ms (400/s) against bare steps' 8 in 10 ms (800/s): they lose there,
    and only there (batch 2 unmeasured, batch 9-15 shares batch 8's bucket); with too few windows of either regime it
    says nothing; faster forests do not lose; beam windows and mixed ones do not count for plain requests; old windows
    expire."""
    c = StepClock(warmup=0, forest_warmup=0)
    for _ in range(step_clock.MIN_REGIME):
        _window(c, 0.010, 8, 8, monkeypatch=monkeypatch)
    assert not c.forests_lose(8)  # no forest window yet
    for _ in range(step_clock.MIN_REGIME - 1):
        _window(c, 0.030, 12, 8, drafted=True, verified=True, monkeypatch=monkeypatch)
    assert not c.forests_lose(8)
    _window(c, 0.030, 12, 8, drafted=True, verified=True, monkeypatch=monkeypatch)
    assert c.forests_lose(8) and c.forests_lose(12) and not c.forests_lose(2) and not c.forests_lose(16)
    fast = StepClock(warmup=0, forest_warmup=0)
    for _ in range(step_clock.MIN_REGIME):
        _window(fast, 0.010, 8, 8, monkeypatch=monkeypatch)
        _window(fast, 0.012, 16, 8, drafted=True, verified=True, monkeypatch=monkeypatch)
        _window(fast, 0.030, 1, 8, drafted=True, kind=step_clock.BEAM, monkeypatch=monkeypatch)  # beam requests'
        _window(fast, 0.030, 1, 8, drafted=True, kind=(step_clock.PLAIN, step_clock.BEAM),
                monkeypatch=monkeypatch)  # both kinds: not recorded
    assert not fast.forests_lose(8) and fast.verdict(8, step_clock.BEAM) is None  # no bare beam window
    for _ in range(step_clock.HORIZON):  # bare windows at batch 1 only: batch 8's samples expire
        _window(c, 0.010, 1, 1, monkeypatch=monkeypatch)
    assert not c.forests_lose(8)


def test_forests_under_a_queue_have_their_own_verdict(monkeypatch):
    """Whether forests pay is measured apart for steps with requests waiting: under a queue a step holds the queue's
    prefills and, the KV cache full, preemptions' recomputes, and forests that pay in a batch's drain at the same size
    lost there (batch 128 on 2 CPU cores: results/kv-pressure-2026-12-08). At 100 requests, without a queue forests
    emit 200 tokens in 350 ms against bare steps' 100 in 300 ms (they pay); under a queue 110 in 600 ms against 100 in
    400 ms (they lose). Planted: one verdict for both states (the clock before 2026-12-08) says they pay under the
    queue too, and so the engine drafted there."""

    def measured(c):
        for _ in range(step_clock.MIN_REGIME):
            _window(c, 0.300, 100, 100, monkeypatch=monkeypatch)
            _window(c, 0.350, 200, 100, drafted=True, verified=True, monkeypatch=monkeypatch)
            _window(c, 0.400, 100, 100, monkeypatch=monkeypatch, queued=True)
            _window(c, 0.600, 110, 100, drafted=True, verified=True, monkeypatch=monkeypatch, queued=True)
        return c

    c = measured(StepClock(warmup=0, forest_warmup=0))
    c.start(None, 110, queued=True)  # a step (not measured) with requests waiting
    assert c.forests_lose(110) and not c.forests_pay(110)
    c.start(None, 110, queued=False)
    assert c.forests_pay(110) and not c.forests_lose(110)
    planted = StepClock(warmup=0, forest_warmup=0)
    monkeypatch.setattr(planted, "_bucket_of", lambda reqs, kind: (kind, step_clock._bucket(reqs)))
    measured(planted).start(None, 110, queued=True)
    assert not planted.forests_lose(110)


def _veto_loop(monkeypatch, steps, no_bare_probe=False, no_warmup_veto=False, waiting=0):
    """The runner's loop around ``shapes._choose_depths`` (the real method, on a stand-in runner) for 8 plain requests
    (width 2, depth 3, passing 80% of layers) whose forests lose: a window with forests takes 30 ms and emits the
    verified forests' tokens, a bare one 10 ms for 8 tokens, and the table says forests are free (as the start-up table
    does before the clock measures them; its correction left out here, so that only the windows' measured tokens per
    second can stop the forests: a correction fitted wrong, as on the README's main job). ``no_bare_probe``: the planted
    variant whose bare probes never start; ``no_warmup_veto``: the one whose warm-up drafts. Returns each step's planned
    forest nodes and the stand-in runner."""
    import random
    from types import SimpleNamespace

    from vllm_dsbd.engine import load
    from vllm_dsbd.engine.shapes import ShapePlanMixin

    free = cost.CostTable.from_times({1: 0.010, 64: 0.010}, {1: 0.0})
    now = [0.0]
    monkeypatch.setattr(step_clock.time, "perf_counter", lambda: now[0])
    clock = StepClock()
    monkeypatch.setattr(clock, "corrected", lambda table: table)  # the table stays wrong: forests look free
    if no_bare_probe:
        monkeypatch.setattr(clock, "needs_bare", lambda reqs, kind: False)
    if no_warmup_veto:
        monkeypatch.setattr(clock, "warming", lambda: False)
    r = ShapePlanMixin()  # the runner's state that _choose_depths reads, nothing else
    vars(r).update(dsbd_explore=cost.Exploration(), dsbd_pass_rates=cost.PassRates(), dsbd_cost=free,
                   _dsbd_cost_base=free, _dsbd_cost_passes=free, _dsbd_clock=clock, _dsbd_bare_probe=0,
                   _dsbd_probe_kind="plain", _dsbd_waiting=waiting, dsbd_context_len=1024,
                   input_batch=SimpleNamespace(num_tokens_no_spec=[16] * 8, num_prompt_tokens=[8] * 8),
                   dsbd_stats=SimpleNamespace(vetoed_steps=0, record_nodes=lambda nodes: None))
    states = [SimpleNamespace(beam=None, acceptance=cost.Acceptance(), max_tokens=48) for _ in range(8)]
    shapes = [load.Shape(leaves=1, width=2, depth=3)] * 8
    rng, planned, pending = random.Random(0), [], [0] * 8
    for _ in range(steps):
        clock.start(8 + sum(pending), 8, waiting > 0)  # as the runner starts it
        emitted = 0
        for st, d in zip(states, pending):
            k = 0
            while k < d and rng.random() < 0.8:
                k += 1
            if d:
                st.acceptance.observe(k, d)
            emitted += k + 1
        levels = r._choose_depths([load.Level(2, 3)] * 8, shapes, states, [False] * 8)
        pending = [lv.depth for lv in levels]
        planned.append(sum(lv.width * lv.depth for lv in levels))
        clock.emitted(emitted, step_clock.PLAIN)
        now[0] += 0.030 if clock._drafted or clock._verified else 0.010
        r.dsbd_cost = clock.finish(r._dsbd_cost_base)
    return planned, r


def test_forests_that_lose_stop_within_a_short_run(monkeypatch):
    """Forests that lose at a batch size are measured to lose within the warm-up, ``MIN_REGIME`` windows and one bare
    probe (``BARE_PROBE`` steps, outside the exploration budget), about 20 steps: a short run (the README's main job
    makes ~45 steps at batch 8) reaches the verdict; from then on no forest runs while none waits (under a queue, as
    probes within the budget: the next test). With
    bare probes never starting (the planted variant; before 2026-12-06 they waited for the budget too) the forests run
    on: the table says they are free."""
    steps = 200
    planned, r = _veto_loop(monkeypatch, steps)
    first = next(t for t, n in enumerate(planned) if t > step_clock.WARMUP and n == 0)
    verdict = step_clock.WARMUP + step_clock.MIN_REGIME + step_clock.BARE_PROBE + 2
    assert first <= step_clock.WARMUP + step_clock.MIN_REGIME + 2, planned
    late = [t for t in range(verdict, steps) if planned[t]]
    assert len(late) <= cost.PROBE_SHARE * steps + 3, (late, planned)
    assert r.dsbd_stats.vetoed_steps >= steps - verdict - len(late)
    planted, _ = _veto_loop(monkeypatch, steps, no_bare_probe=True)
    assert sum(1 for t in range(verdict, steps) if planted[t]) > steps // 2


def test_forests_measured_to_lose_run_as_probes_only_under_a_queue(monkeypatch):
    """Once forests are measured to lose at a batch size, while no request waits (the floors promise every request
    its pace) none runs there, the exploration budget open or not, until the verdict's windows expire (``HORIZON``);
    under a queue they run as the budget's probes, about ``PROBE_SHARE`` of the steps (the rule before 2026-12-07
    everywhere, which in the README job drafted the 8 new requests of every call at the pool's rate), and such a step
    drafts its probes' forests alone: one try's (2 nodes a depth, 3 depths), where before 2026-12-08 every request's
    forest ran in it (8 forests, 48 nodes; 113 forests at batch 128 on CPU, results/kv-pressure-2026-12-08)."""
    steps = 200
    verdict = step_clock.WARMUP + step_clock.MIN_REGIME + step_clock.BARE_PROBE + 2
    quiet, _ = _veto_loop(monkeypatch, steps)
    queued, _ = _veto_loop(monkeypatch, steps, waiting=1)
    assert not any(quiet[verdict:]), quiet
    late = [t for t in range(verdict, steps) if queued[t]]
    assert 0 < len(late) <= cost.PROBE_SHARE * steps + 3, (late, queued)
    assert all(queued[t] == 2 * 3 for t in late), queued


def test_the_warm_up_drafts_no_forest_and_the_first_forests_are_not_measured(monkeypatch):
    """The engine's first ``WARMUP`` decode steps are not measured, so forests there would cost what the table does not
    know: none is drafted (the last warm-up step plans the first forests); the first ``FOREST_WARMUP`` windows with
    forests are not measured either (their one-time costs), the next are. Planted: without the warm-up's veto the
    table (forests free) drafts from the first step."""
    planned, _ = _veto_loop(monkeypatch, 20)
    assert planned[: step_clock.WARMUP - 1] == [0] * (step_clock.WARMUP - 1) and planned[step_clock.WARMUP - 1] > 0
    planted, _ = _veto_loop(monkeypatch, 20, no_warmup_veto=True)
    assert all(planted[: step_clock.WARMUP - 1]), planted
    for forest_warmup, measured in ((step_clock.FOREST_WARMUP, [1, 0, 1, 1]), (0, [1, 1, 1, 2])):
        c = StepClock(warmup=0, forest_warmup=forest_warmup)
        for drafted in (False, True, True, True, False):  # neither, drafted, both, both, verified
            c.start(4)
            c.planned(0.0, drafted)
            c.finish(TABLE)
        got = [len(q) for q in c.surplus_of(step_clock.PLAIN)]
        assert got == measured, (forest_warmup, got)


def test_a_bare_probe_waits_for_its_gap():
    """``needs_bare`` asks for a bare probe once forest windows are measured at a bucket and bare ones are not, then
    not again for ``PROBE_GAP`` measured steps at that bucket (its bare windows may not be recorded: a step with a
    prefill is not measured), while another bucket is probed at once."""
    c = StepClock(warmup=0, forest_warmup=0)
    for _ in range(step_clock.MIN_REGIME):
        c.observe(0.03, 0.0, True, True)
        c.regimes.setdefault(("plain", 8, False), (step_clock.deque(maxlen=32), step_clock.deque(maxlen=32)))[1].append(
            (c.steps, 0.03, 12))
    assert c.needs_bare(8) and c.needs_bare(15) and not c.needs_bare(4)
    assert c.bare_probe(8) == step_clock.BARE_PROBE and not c.needs_bare(8)
    for _ in range(step_clock.PROBE_GAP - 1):
        c.observe(0.03, 0.0, True, True)
    assert not c.needs_bare(8)
    c.observe(0.03, 0.0, True, True)
    c.regimes[("plain", 8, False)][1].extend([(c.steps, 0.03, 12)] * step_clock.MIN_REGIME)
    assert c.needs_bare(8)


def test_a_bare_probe_runs_in_batches_of_its_kind_only():
    """The clock keeps plain requests' windows and beam requests' apart and records no mixed one, so a bare probe
    begins and spends its steps only in batches of the kind it probes (``shapes._measured_veto``): elsewhere it would
    take forests and measure nothing (a probe begun at the end of a plain call once took 3 beam steps of the next,
    test_engine_cost). Its steps wait for the next batch of its kind; a mixed batch begins none."""
    from types import SimpleNamespace

    from vllm_dsbd.engine.shapes import ShapePlanMixin

    plain, beam = step_clock.PLAIN, step_clock.BEAM
    c = StepClock(warmup=0, forest_warmup=0)
    for _ in range(step_clock.MIN_REGIME):
        c.observe(0.03, 0.0, True, True)
        c.regimes.setdefault((plain, 4, False), (step_clock.deque(maxlen=32), step_clock.deque(maxlen=32)))[1].append(
            (c.steps, 0.03, 12))
    r = ShapePlanMixin()
    vars(r).update(_dsbd_bare_probe=0, _dsbd_probe_kind=plain, dsbd_stats=SimpleNamespace(vetoed_steps=0))
    cands = [SimpleNamespace(pinned=False)] * 4
    shapes, bare = [(2, 3)] * 4, [(2, 0)] * 4
    assert c.needs_bare(4) and not c.needs_bare(4, beam)
    for kind in (beam, None):  # beam requests' windows unmeasured at 4; a mixed batch
        assert r._measured_veto(c, cands, shapes, 4, False, False, kind) == (shapes, False)
    assert r._dsbd_bare_probe == 0 and r.dsbd_stats.vetoed_steps == 0 and c.needs_bare(4)
    assert r._measured_veto(c, cands, shapes, 4, False, False, plain) == (bare, False)
    assert r._dsbd_bare_probe == step_clock.BARE_PROBE - 1 and r.dsbd_stats.vetoed_steps == 1
    for kind in (beam, None):
        assert r._measured_veto(c, cands, shapes, 4, False, False, kind) == (shapes, False)
    assert r._dsbd_bare_probe == step_clock.BARE_PROBE - 1 and r.dsbd_stats.vetoed_steps == 1
    for _ in range(step_clock.BARE_PROBE - 1):  # the probe's other steps, in the next plain batches
        assert r._measured_veto(c, cands, shapes, 4, False, False, plain) == (bare, False)
    assert r._dsbd_bare_probe == 0 and r.dsbd_stats.vetoed_steps == step_clock.BARE_PROBE
    # beam requests' forest windows at 4, no bare one: a beam batch probes, and its steps wait out plain batches
    c.regimes[(beam, 4, False)] = (step_clock.deque(maxlen=32),
                                   step_clock.deque([(c.steps, 0.03, 6)] * step_clock.MIN_REGIME))
    assert c.needs_bare(4, beam) and not c.needs_bare(4)  # plain: probed within PROBE_GAP
    assert r._measured_veto(c, cands, shapes, 4, False, False, beam) == (bare, False)
    assert r._dsbd_probe_kind == beam and r._measured_veto(c, cands, shapes, 4, False, False, plain) == (shapes, False)
    assert r._dsbd_bare_probe == step_clock.BARE_PROBE - 1


def test_beam_windows_have_their_own_verdict(monkeypatch):
    """A beam request's window counts its beam steps, apart from plain requests' tokens: at batch 4 beam forests that
    make 6 beam steps in 30 ms (200/s) lose against bare beam steps' 4 in 10 ms (400/s) while plain forests (16 tokens
    in 12 ms) pay against plain bare steps; each kind's verdict is its own. Planted: one regime for both kinds (the
    kind dropped) mixes them, and its verdict says the beam forests pay."""
    plain, beam = step_clock.PLAIN, step_clock.BEAM

    def run(clock, kind_of):
        for _ in range(step_clock.MIN_REGIME):
            _window(clock, 0.010, 4, 4, kind=kind_of(beam), monkeypatch=monkeypatch)
            _window(clock, 0.030, 6, 4, drafted=True, verified=True, kind=kind_of(beam), monkeypatch=monkeypatch)
            _window(clock, 0.010, 4, 4, kind=kind_of(plain), monkeypatch=monkeypatch)
            _window(clock, 0.012, 16, 4, drafted=True, verified=True, kind=kind_of(plain), monkeypatch=monkeypatch)
        return clock.verdict(4, beam), clock.verdict(4, plain)

    assert run(StepClock(warmup=0, forest_warmup=0), lambda k: k) == (False, True)
    assert run(StepClock(warmup=0, forest_warmup=0), lambda k: plain) == (None, True)  # planted: one regime


def test_prompt_rows_are_recycled_where_forests_of_the_requests_kind_pay(monkeypatch):
    """A request's prompt rows are recycled (``StepClock.recycles_prompt``) where forests of its own kind are measured
    to pay at the batch size: at batch 4 plain forests pay and beam forests lose, so a plain request's are taken and a
    beam request's are not; unmeasured (batch 2), neither. Planted: the plain verdict for every request (the rule
    until 2026-12-07) takes the beam request's too."""
    plain, beam = step_clock.PLAIN, step_clock.BEAM
    c = StepClock(warmup=0, forest_warmup=0)
    for _ in range(step_clock.MIN_REGIME):
        _window(c, 0.010, 4, 4, kind=beam, monkeypatch=monkeypatch)
        _window(c, 0.030, 6, 4, drafted=True, verified=True, kind=beam, monkeypatch=monkeypatch)
        _window(c, 0.010, 4, 4, kind=plain, monkeypatch=monkeypatch)
        _window(c, 0.012, 16, 4, drafted=True, verified=True, kind=plain, monkeypatch=monkeypatch)
    assert [c.recycles_prompt(4, b) for b in (False, True)] == [True, False]
    assert [c.recycles_prompt(2, b) for b in (False, True)] == [False, False]
    assert c.forests_pay(4)  # planted: the plain verdict for both kinds takes the beam request's rows too


def test_beam_windows_have_their_own_correction(monkeypatch):
    """Beam requests' windows correct the table for beam batches alone: after plain windows whose forests cost
    nothing over the table (host drafting, cheap nodes) and beam windows whose forests cost 20 ms more than bare beam
    windows, a beam batch's table charges a drafting step that 20 ms while the plain one charges nothing, and a beam
    kind with no windows of its own keeps the table's start-up prices. Planted: the windows kept together (the rule
    until 2026-12-07), the beam table takes the mixture's price, well under the beam forests' cost."""
    plain, beam = step_clock.PLAIN, step_clock.BEAM

    def run(kind_of):
        c = StepClock(warmup=0, forest_warmup=0)
        probe = dataclasses.replace(TABLE, draft_step=0.005, node=0.0005)  # the start-up probe's prices
        assert c.corrected(probe, beam) is probe
        for _ in range(3 * step_clock.MIN_STEPS):
            _window(c, TABLE.target_time(4), 4, 4, kind=kind_of(plain), monkeypatch=monkeypatch)
            _window(c, TABLE.target_time(4), 8, 4, drafted=True, verified=True, kind=kind_of(plain),
                    monkeypatch=monkeypatch)
        for _ in range(step_clock.MIN_STEPS):
            _window(c, TABLE.target_time(4), 4, 4, kind=kind_of(beam), monkeypatch=monkeypatch)
            _window(c, TABLE.target_time(4) + 0.020, 6, 4, drafted=True, verified=True, kind=kind_of(beam),
                    monkeypatch=monkeypatch)
        return c.corrected(probe, plain), c.corrected(probe, beam)

    def price(t):  # what the model charges a forest of the windows' 2 nodes
        return t.draft_step + 2 * t.node

    p, b = run(lambda k: k)
    assert price(p) == pytest.approx(0.0, abs=1e-9)  # a plain forest: nothing over the table
    assert price(b) == pytest.approx(0.020)  # a beam forest: the 20 ms its windows measured
    _, mixed = run(lambda k: plain)  # planted: one correction for both kinds
    assert price(mixed) < 0.5 * price(b)


def test_a_step_with_a_prefill_is_not_measured():
    """The runner starts the clock at ``measured_tokens`` of vLLM's own scheduler output: a decode step at its
    scheduled tokens; a step with a new request's prefill, or a resumed (preempted) request's recompute (measured
    until 2026-12-08), not at all."""
    from vllm.v1.core.sched.output import SchedulerOutput

    so = SchedulerOutput.make_empty()
    so.num_scheduled_tokens, so.total_num_scheduled_tokens = {"a": 3, "b": 1}, 4
    so.scheduled_cached_reqs.req_ids = ["a", "b"]
    assert step_clock.measured_tokens(so) == 4
    so.scheduled_cached_reqs.resumed_req_ids = {"b"}
    so.num_scheduled_tokens["b"], so.total_num_scheduled_tokens = 300, 303
    assert step_clock.measured_tokens(so) is None
    so.scheduled_cached_reqs.resumed_req_ids = set()
    so.scheduled_new_reqs = [object()]  # a new request's prefill (its data not read)
    assert step_clock.measured_tokens(so) is None
