"""One try a step (``shapes.MAX_TRIES``): requests due a try (switched off, planned again at an optimistic rate) wait
for the engine's exploration budget (``cost.Exploration``), and in an open step one of them tries, the likeliest to
pay, the others at their estimates. Before, the tries due went together: in the README job 8 requests trying in one
step cost several bare steps (results/sure-floors-2026-12-07) for one probe step's worth of budget.

Checked on the runner's choice (``ShapePlanMixin._choose_depths``, no step clock) with four requests due a try: the
model is shown one try, the request whose try rate is highest, and it spends the budget; planted: with
``MAX_TRIES`` lifted, all four are tries in the one step.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_dsbd.engine import cost, load, shapes
from vllm_dsbd.engine.cost import Acceptance


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
