"""Beam sampling (T = 1) with forests drafted by an EAGLE-3 head mixed with the draft-free sources
(``engine/mixing.py``) is still exactly target beam sampling of width W.

``test_engine_eagle3_beam_law.py``'s setting (the silenced peaky target, LM head x 0.3; the bigram head x 1.5 on 200
of its 300 ids; W = 2, 3 steps, depth 2, top-k 3, EOS ignored; oracle ``beam_oracle.beam_sampling_law``) with
``"sources": ["model", "recycle", "lookup"]``, the prompt led by the tokens the beams draw most (so that the prompt's
recycled rows and lookup have candidates at the beams: the target's law depends on the last token only, so the oracle's
law is the same): 8,500 requests (minimum detectable effect TV 0.05, asserted). The counters must show forest nodes
and layers passed and rows mixed with the sources' candidates; the dropped-residual rule planted into the
verification must be rejected by the same test on 4,000 requests. Measured at 300 requests: 272 of 600 draft rows
mixed, 177 layers passed against 109 with the head alone.
"""
from __future__ import annotations

import pytest

from engine_utils import runner_of  # the CPU engine environment first
import vllm  # noqa: E402,F401  (a broken vLLM must fail the suite, never skip it)

from chisq import goodness_of_fit, mde_tv, report  # noqa: E402
from test_engine_eagle3_beam_law import (  # noqa: E402
    DEPTH, N, N_PLANTED, PLANTED, STEPS, TOP_K, WIDTH, head_law_runs)
from test_engine_eagle3_beam_law import PROMPT as HEAD_PROMPT  # noqa: E402
from test_engine_mixed import MixedRows, _drafted  # noqa: E402
from vllm_dsbd.testing.heads import draft_ids  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = [239, 5, 47, 71, 170] + HEAD_PROMPT  # the beams' most drawn tokens first (module docstring)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def on_exact(llm, run, head):
        assert runner_of(llm)._dsbd_mixed
        with MixedRows() as mixed:
            exact, drafted = _drafted(llm, run)
        return exact, (mixed.rows, len(drafted - set(draft_ids(head))))

    return head_law_runs(tmp_path_factory.mktemp("bigram"), PROMPT, ["model", "recycle", "lookup"], on_exact)


def test_mixed_forests_ran(runs):
    (_, c), _, _, (mixed, outside) = runs
    print("counters:", c, f"rows mixed {mixed}, drafted outside the head's vocabulary: {outside}")
    assert c["beam_steps"] == N * STEPS
    assert c["beam_draft_nodes"] > 0 and c["beam_layers_passed"] > 0 and mixed > 0
    assert c["beam_target_passes"] < N * STEPS


def test_beam_set_law_with_mixed_forests_is_target_beam_sampling(runs):
    (exact, _), _, law, _ = runs
    assert sum(exact.values()) == N and len(exact) > 10
    stat, df, thr = goodness_of_fit(exact, law, N)
    print(report(f"DSBD head + sources T=1, W={WIDTH}, {STEPS} steps, depth {DEPTH}, top-k {TOP_K}", stat, df, thr,
                 n=N))
    assert stat < thr
    assert mde_tv(N, df) <= 0.05


def test_planted_rule_is_rejected_with_mixed_forests(runs):
    _, (planted, c), law, _ = runs
    assert c["beam_layers_passed"] > 0
    stat, df, thr = goodness_of_fit(planted, law, N_PLANTED)
    print(report(f"planted {PLANTED} rule (head + sources)", stat, df, thr, n=N_PLANTED))
    assert stat > thr
