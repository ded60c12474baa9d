"""The cost model's pass rates count a layer it asked for and the drafter did not build as failed
(``ShapePlanMixin._observe(..., asked)``): the draft-free sources find no candidate for every layer, and the model
plans (and pays a step's forest work for) the layers it asks, so its expected tokens must be what an *asked* layer
yields, not what a built one does.

The claim is statistical: a drafter that builds each next layer with probability ``c`` and whose built layers pass
with probability ``q`` yields ``1 + a + ... + a^D`` tokens per asked depth-D forest with ``a = c q``. Simulated
forests go through the real ``_observe`` into the engine-wide ``PassRates`` (evidence kept whole for the test); the
estimate's expected tokens must equal the simulated mean, and the planted variant (only the built layers counted, the
rule until 2026-12-07) must miss it. A request's ``Acceptance`` counts are checked exactly on a few forests. The
metrics keep counting the built layers.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.engine import acceptance, cost
from vllm_dsbd.engine.metrics import DSBDStats
from vllm_dsbd.engine.shapes import ShapePlanMixin

DEPTH, NODES = 3, 1


def _forest(rng: random.Random, c: float, q: float) -> tuple[int, int]:
    """(layers built, layers passed) of one asked forest of DEPTH layers: each next layer built with probability c
    where the one before passed, each built layer passing with probability q."""
    built = passed = 0
    for _ in range(DEPTH):
        if rng.random() >= c:
            break
        built += 1
        if rng.random() >= q:
            break
        passed += 1
    return built, passed


def _runner():
    return SimpleNamespace(dsbd_pass_rates=cost.PassRates(), dsbd_stats=DSBDStats(DSBDConfig(), prometheus=False))


def _feed(runner, st, forests, count_unbuilt: bool) -> None:
    for built, passed in forests:
        asked = DEPTH if count_unbuilt and built < DEPTH else 0
        if built == 0 and not count_unbuilt:
            continue  # the old rule: a forest the drafter did not build was never observed
        ShapePlanMixin._observe(runner, st, "plain", passed, built, NODES, asked=asked)


@pytest.mark.parametrize("c,q", [(0.5, 0.9), (0.8, 0.6), (0.3, 1.0)])
def test_an_asked_layer_the_drafter_did_not_build_counts_as_failed(monkeypatch, c, q):
    monkeypatch.setattr(acceptance, "POOL_MEMORY", float("inf"))  # the engine-wide count over every forest
    rng = random.Random(1234)
    forests = [_forest(rng, c, q) for _ in range(30000)]
    mean = sum(1 + p for _, p in forests) / len(forests)  # tokens per asked forest (its passes and the root's)
    want = cost.expected_tokens(c * q, DEPTH)
    assert abs(mean - want) < 0.03, (mean, want)  # the simulation is the law it claims to be
    new, old = _runner(), _runner()
    st_new, st_old = SimpleNamespace(acceptance=acceptance.Acceptance()), SimpleNamespace(
        acceptance=acceptance.Acceptance())
    _feed(new, st_new, forests, True)
    _feed(old, st_old, forests, False)
    got = new.dsbd_pass_rates.rate((cost.DRAFT, "plain"), NODES)
    assert abs(cost.expected_tokens(got, DEPTH) - mean) < 0.03, (got, c * q)
    # planted: counting the built layers only overstates what an asked forest yields
    bad = old.dsbd_pass_rates.rate((cost.DRAFT, "plain"), NODES)
    assert cost.expected_tokens(bad, DEPTH) - mean > 0.15, (bad, c * q)
    # the metrics count what was built, under either rule
    built_tried = sum(min(p + 1, b) for b, p in forests if b)
    assert new.dsbd_stats.pass_rates[cost.DRAFT, "plain", NODES] == [sum(p for _, p in forests), built_tried]


def test_a_forest_built_whole_is_counted_as_before():
    runner, st = _runner(), SimpleNamespace(acceptance=acceptance.Acceptance())
    ShapePlanMixin._observe(runner, st, "plain", 2, 3, NODES)  # asked 0: as drafted
    ShapePlanMixin._observe(runner, st, "plain", 2, 3, NODES, asked=2)  # asked less than built: the built depth
    assert (st.acceptance.passed, st.acceptance.tried) == (4, 6)
    ShapePlanMixin._observe(runner, st, "plain", 2, 2, NODES, asked=3)  # both built layers passed, the third unbuilt
    assert (st.acceptance.passed, st.acceptance.tried) == (6, 9)
    ShapePlanMixin._observe(runner, st, "plain", 0, 0, NODES, asked=3)  # nothing built: the first layer failed
    assert (st.acceptance.passed, st.acceptance.tried) == (6, 10)
    assert runner.dsbd_stats.pass_rates[cost.DRAFT, "plain", NODES] == [6, 8]  # built layers: 3 + 3 + 2
