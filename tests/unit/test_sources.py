"""The draft-free sources of one request (``vllm_dsbd.core.sources.SourceIndex``): what recycle and lookup propose
after a context, merged and bounded. Pure Python, no vLLM."""
from __future__ import annotations

import math

import pytest

from vllm_dsbd.core.sources import (LOOKUP_KEY_BYTES, LOOKUP_LOGP, MAX_FOLLOWERS, RECYCLE_K, ROW_KEY_BYTES,
                                    SourceIndex)


def test_lookup_proposes_the_continuations_of_the_longest_suffix_newest_first():
    src = SourceIndex(recycle=False)
    src.index_text([1, 2, 3, 4, 9, 2, 3, 5, 1, 2])
    # (1, 2) was followed by 3 (twice); (2,) by 3 twice too, but the longer match wins
    assert src.propose([7, 1, 2]) == {3: pytest.approx(LOOKUP_LOGP[2])}
    # (2, 3) was followed by 4, then (newer) by 5: newest first, one nat less for the older
    assert src.propose([8, 2, 3]) == {5: pytest.approx(LOOKUP_LOGP[2]), 4: pytest.approx(LOOKUP_LOGP[2] - 1)}
    assert src.propose([6, 9, 2, 3]) == {5: pytest.approx(LOOKUP_LOGP[3])}  # (9, 2, 3) -> 5 only
    assert src.propose([42]) == {}  # never seen: nothing (its own last transition is no continuation)


def test_index_text_goes_on_where_it_stopped_and_restarts_on_a_shorter_text():
    src = SourceIndex(recycle=False)
    src.index_text([1, 2, 3])
    src.index_text([1, 2, 3, 1, 2, 4])
    assert src.indexed == 6 and set(src.propose([1, 2])) == {3, 4}
    src.index_text([5, 6])  # shorter: a new text (re-laid out), indexed from its start
    assert src.indexed == 2 and 6 in src.propose([5])


def test_recycle_keys_rows_by_the_last_two_tokens_with_the_last_one_as_fallback():
    src = SourceIndex(lookup=False)
    src.add_row([4, 5], [10, 11], [-0.1, -2.0])
    src.add_row([6, 5], [12], [-0.3])  # same last token, another pair: the fallback key now points here
    assert src.propose([9, 4, 5]) == {10: -0.1, 11: -2.0}
    assert src.propose([9, 7, 5]) == {12: -0.3}
    assert src.propose([5, 4]) == {}


def test_sources_merge_by_token_keeping_the_larger_estimate():
    src = SourceIndex()
    src.index_text([1, 2, 3, 1, 2])
    src.add_row([1, 2], [3, 8], [-3.0, -0.2])
    got = src.propose([1, 2])
    assert got == {3: pytest.approx(LOOKUP_LOGP[2]), 8: -0.2}
    only = SourceIndex(recycle=False, lookup=False)
    only.index_text([1, 2, 3, 1, 2])
    only.add_row([1, 2], [3], [-1.0])
    assert only.propose([1, 2]) == {}


def _filled(budget: int, seed: int) -> tuple[SourceIndex, int]:
    """An index of ``budget`` bytes filled far past it (large token ids, full rows, lookup keys of up to
    MAX_FOLLOWERS continuations), and the bytes it holds (tracemalloc)."""
    import random
    import tracemalloc

    rnd = random.Random(seed)
    big = [rnd.randrange(1000, 1 << 17) for _ in range(4000)]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        src = SourceIndex(max_bytes=budget)
        for _ in range(6 * src.max_rows):
            src.add_row([rnd.choice(big), rnd.choice(big)], rnd.sample(big, RECYCLE_K),
                        [-rnd.random() for _ in range(RECYCLE_K)])
        # short keys over 40 tokens (many continuations each), long ones mostly new
        src.index_text([rnd.choice(big[:40]) for _ in range(2 * src.max_keys)])
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return src, used


def test_structures_stay_bounded_in_bytes():
    """Filled far past it, an index holds at most its byte bound (tracemalloc: keys, rows, continuations), and most of
    it (the bound is not far above what it holds); the followers of a key stay at most MAX_FOLLOWERS, newest first."""
    for budget in (64 << 10, 1 << 20):
        src, used = _filled(budget, budget)
        print(f"\n{budget} B bound: {used} B held, {len(src._rows)} recycle keys, {len(src._next)} lookup keys")
        assert used <= budget
        assert used >= budget // 4
        assert len(src._rows) <= src.max_rows and len(src._next) <= src.max_keys
    many = SourceIndex(recycle=False)
    many.index_text([t for k in range(50) for t in (7, k + 100)])
    assert len(many.propose([7])) == MAX_FOLLOWERS and max(many.propose([7]).values()) == pytest.approx(
        math.log(0.25))
    assert many.propose([7]) == {149 - r: pytest.approx(math.log(0.25) - r) for r in range(MAX_FOLLOWERS)}


def test_eviction_goes_by_last_write():
    """A recycled row written again, or a lookup key seen again, counts as new: it outlives keys written once after
    its first write (eviction by first insertion dropped it)."""
    src = SourceIndex(max_bytes=2 * 32 * max(ROW_KEY_BYTES, LOOKUP_KEY_BYTES))  # 32 keys each
    for k in range(200):
        if k % 4 == 0:  # 8 recycle keys and 4 lookup keys written since the last time: within any bound's quarter
            src.add_row([1, 2], [5], [-1.0])
            src.add_transitions([3, 4, 9], 0)
        src.add_row([1000 + k, 2000 + k], [6], [-1.0])
        src.add_transitions([3000 + k, 4000 + k], 0)
        assert src.propose([1, 2]) == {5: -1.0}, k
        assert src.propose([3, 4]) == {9: pytest.approx(LOOKUP_LOGP[2])}, k
    assert src.propose([1000, 2000]) == {} and src.propose([3000]) == {}  # written once, long ago


def test_beam_forests_at_t1_draw_the_cost_models_n():
    """A T > 0 beam forest of the draft-free sources draws ``job.width`` nodes per depth (the cost model's N' < N)
    and is booked with it: N' = 2 of N = 6 at depth 2 with room for 4 nodes gives 2 nodes per depth (drawing N = 6
    filled the 4 at depth 1, a wide and shallow forest booked under N')."""
    from types import SimpleNamespace

    import torch

    from vllm_dsbd.config import DSBDConfig
    from vllm_dsbd.engine import reads
    from vllm_dsbd.engine.beams.drafter import BeamDraftJob
    from vllm_dsbd.engine.beams.step import step_one
    from vllm_dsbd.engine.beams.trie import BeamRequest
    from vllm_dsbd.engine.source_drafter import SourceDrafter
    from vllm_dsbd.engine.state import RequestState
    from vllm_dsbd.requests import BeamParams

    V, P = 50, 6
    prompt = [1, 2, 3, 4, 5, 6]
    # the drafter's view of a runner: its device and vocabulary
    runner = SimpleNamespace(device="cpu", model_config=SimpleNamespace(get_vocab_size=lambda: V))
    cfg = DSBDConfig(draft=False, width=2, verify_budget=None, sources=("recycle",))
    drafter = SourceDrafter(runner, cfg)
    beam = BeamRequest(BeamParams(width=2, max_tokens=8, ignore_eos=True), P, temperature=0.0, seed=3, nodes=6)
    row = torch.full((1, V), -30.0)
    row[0, 3], row[0, 5] = 10.0, 9.5
    assert beam.partial(row) is None
    step_one(beam, None)  # the first step: live beams "3" and "5"; then beam sampling (T = 1) drafts
    beam.temperature = 1.0
    st = RequestState(req_id="b", seed=3, width=2, temperature=1.0, top_k=0, top_p=1.0, eos=-1, max_tokens=8,
                      beam=beam)
    src = SourceIndex(recycle=True, lookup=False)
    for a in range(V):  # every context has 8 candidates
        for b in range(V):
            src.add_row([a, b], list(range(10, 18)), [-2.0] * 8)
    st.sources = src
    job = BeamDraftJob(st, 0, prompt, 0, depth=2, max_nodes=4, nodes=2)
    reads.run(drafter.propose_beam_forests([job]))
    f = beam.forest
    assert f is not None and f.nodes == 2
    assert f.layers == [1, 1, 2, 2]
