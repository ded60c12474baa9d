"""Load-aware speculation's budget rule (``vllm_dsbd.engine.load``): pure functions, no engine."""
from __future__ import annotations

import pytest

from vllm_dsbd.engine.load import Level, Shape, auto_budget, knee, levels, plan, probe_sizes

PLAIN = Shape(leaves=1, width=2, depth=3)  # a plain request of an engine with width 2, depth 3: 1 + 6 tokens


def test_levels_go_deepest_first_then_widest():
    assert levels(2, 3) == [Level(2, 3), Level(1, 3), Level(2, 2), Level(1, 2), Level(2, 1), Level(1, 1),
                            Level(0, 0)]
    assert levels(1, 1) == [Level(1, 1), Level(0, 0)]


@pytest.mark.parametrize(("n", "expected"), [
    (1, [Level(2, 3)]),  # 7 tokens
    (2, [Level(2, 3)] * 2),  # 14 <= 16
    (3, [Level(2, 3)] + [Level(1, 3)] * 2),  # (2, 3) needs 21; (1, 3) 12, then one request one level up: 15
    (4, [Level(1, 3)] * 4),  # 16 exactly
    (5, [Level(1, 2)] * 5),  # (1, 3) needs 20; (2, 2) 25; (1, 2) 15, one more at (2, 2) needs 17
    (8, [Level(1, 1)] * 8),  # (1, 2) 24, (2, 1) 24, (1, 1) 16
    (12, [Level(1, 1)] * 4 + [Level(0, 0)] * 8),  # (1, 1) needs 24: none drafts (12), then 4 requests one level up
    (16, [Level(0, 0)] * 16),  # 16 roots fill the budget: depth 0
    (40, [Level(0, 0)] * 40),  # over the budget even without drafts: depth 0
])
def test_plan_by_batch_size(n, expected):
    got = plan([PLAIN] * n, 16)
    assert got == expected
    assert sum(lv.tokens(PLAIN) for lv in got) <= 16 or n > 16


def test_depth_never_grows_with_the_batch():
    depths = [max(lv.depth for lv in plan([PLAIN] * n, 64)) for n in range(1, 80)]
    assert depths == sorted(depths, reverse=True) and depths[0] == 3 and depths[-1] == 0
    nodes = [sum(lv.nodes(PLAIN) for lv in plan([PLAIN] * n, 64)) / n for n in range(1, 80)]
    assert nodes == sorted(nodes, reverse=True)


def test_pinned_budget_none_is_the_full_shape_whatever_the_batch():
    shapes = [PLAIN, Shape(1, 1, 3), Shape(4, 4, 3)]
    assert plan(shapes * 50, None) == [Level(4, 3)] * 150
    # each request's own width and depth still cap its forest
    assert [Level(4, 3).nodes(s) for s in shapes] == [6, 3, 12]


def test_mixed_shapes_and_beam_leaves():
    beam = Shape(leaves=4, width=4, depth=3)  # a beam request: 4 leaves, up to 4 nodes per depth
    narrow = Shape(leaves=1, width=1, depth=3)  # a plain request capped at width 1 (extra_args dsbd_width)
    # full: 16 + 4 = 20 tokens; budget 12: (4, 3)..(1, 3) need 20, 17, 14, 11 (beam 4 + 3, narrow 1 + 3) -> 11 fits
    got = plan([beam, narrow], 12)
    # then one level up: the beam request would need 3 more (14 > 12); the narrow one none (its width is 1 anyway)
    assert got == [Level(1, 3), Level(2, 3)]
    assert [lv.tokens(s) for lv, s in zip(got, [beam, narrow])] == [7, 4]
    # a beam request that pinned its depth is counted at its full shape and never cut
    pinned = Shape(leaves=2, width=2, depth=2, pinned=True)
    got = plan([pinned, PLAIN, PLAIN], 12)  # pinned: 6 tokens; two plain requests share 6: (1, 2) each (3 + 3)
    assert got[1:] == [Level(1, 2)] * 2 and Level(0, 0).nodes(pinned) == 4


def test_a_request_without_a_forest_counts_its_root():
    idle = Shape(leaves=1, width=0, depth=0)
    assert plan([idle] * 3 + [PLAIN], 10) == [Level(2, 3)] * 4  # 3 roots + 7 = 10
    assert plan([], 10) == []


def test_plan_is_a_function_of_the_shapes_and_budget_only():
    shapes = [PLAIN, Shape(4, 4, 3), Shape(1, 1, 3)] * 7
    assert all(plan(shapes, b) == plan(list(shapes), b) for b in (1, 17, 40, 100, 1000))


def test_probe_sizes():
    assert probe_sizes(8192) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert probe_sizes(300) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert probe_sizes(1) == [1]


def test_knee_rule():
    t = {1: 1.0, 2: 1.0, 4: 1.1, 8: 1.25, 16: 1.3, 32: 1.2, 64: 3.0}
    assert knee(t) == 8  # 16 is over 1.25 x; 32 under it again does not count
    assert knee(t, ratio=1.5) == 32
    assert knee({1: 2.0, 2: 2.6}) == 1
    assert knee({1: 1.0, 4: 1.0}) == 4
    with pytest.raises(ValueError, match="must hold 1 token"):
        knee({2: 1.0})


def test_auto_budget_is_at_least_one_full_step():
    assert auto_budget(4, 8) == 8 and auto_budget(256, 8) == 256
