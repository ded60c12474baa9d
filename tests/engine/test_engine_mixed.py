"""A draft model or an EAGLE-3 head mixed with the draft-free sources (``"sources": ["model", "recycle", "lookup"]``,
``engine/mixing.py``), real vLLM 0.26.0 on CPU.

* With the random public-format head of ``test_engine_eagle3.py`` (draft vocabulary 300 of 400 ids) and with the tiny
  draft model: plain greedy decoding (widths 1, 2, 4) equals plain vLLM and a T = 0 beam request equals vLLM's own
  ``LLM.beam_search``, with forests drafted; the head engine drafts tokens outside the head's vocabulary, which only
  the sources can propose (so the mixed rows are what the draft steps ran on).
* The law at T = 0.9 of a plain request's first 2 tokens (W = 4), drafted by the agreeing bigram head mixed with the
  sources, equals plain vLLM's (two-sample chi-square, p = 1e-6, 800 requests each, as ``test_engine_eagle3.py``); the
  with-replacement rule planted into the verification is rejected by the same statistic.
* The user's engine (cost model ``"auto"``, load-aware budget) with the head mixed in starts and decodes greedily as
  plain vLLM, with forests drafted once its target is made dearer (``slow_target``: on these tiny models no forest
  pays by the table, a step's forest work included).

Shapes are pinned elsewhere (cost model off, ``dsbd_llm``'s default; ``verify_budget`` null): the equality and law
tests need forests in every step, which the cost model would mostly switch off on these tiny models.
"""
from __future__ import annotations


import pytest

from engine_utils import (dsbd_llm, metric, peaky_pair, runner_of, slow_target,  # the CPU engine environment first
                          tiny_pair)
import vllm  # noqa: E402,F401  (a broken vLLM must fail the suite, never skip it)

import chisq  # noqa: E402
from planted import planted_core_layer  # noqa: E402
from test_engine_eagle3 import LAW_N, PLANTED, SLOW_TARGET, WIDTH, _beams, _greedy, _law_sample  # noqa: E402
from test_engine_eagle3 import head, plain  # noqa: E402,F401  (fixtures)
from vllm_dsbd.testing.heads import bigram_target, draft_ids, head_folder  # noqa: E402

pytestmark = pytest.mark.slow

MIXED = ["model", "recycle", "lookup"]


def _spec(model, depth=3, **kw):
    return {"method": "dsbd", "model": str(model), "num_speculative_tokens": depth, "width": WIDTH,
            "verify_budget": None, "sources": MIXED, **kw}


class MixedRows:
    """Inside the block, counts the rows ``engine.mixing.mix`` mixed with the sources' candidates (behaviour unchanged)."""

    def __enter__(self):
        from vllm_dsbd.engine import mixing

        self.rows, self._mod, self._real = 0, mixing, mixing.mix

        def spy(logits, props):
            self.rows += sum(1 for p in props if p)
            return self._real(logits, props)

        mixing.mix = spy
        return self

    def __exit__(self, *exc):
        self._mod.mix = self._real


def _drafted(llm, fn):
    """``fn()``'s result and the set of tokens the engine drafted (plain and beam forest nodes) meanwhile."""
    runner, drafted = runner_of(llm), set()
    propose = runner.propose_draft_token_ids

    def spy(*args, **kwargs):
        out = propose(*args, **kwargs)
        drafted.update(t for row in out for t in row)
        return out

    runner.propose_draft_token_ids = spy
    try:
        return fn(), drafted
    finally:
        del runner.propose_draft_token_ids


@pytest.fixture(scope="module")
def mixed_runs(head, plain):  # after plain: one engine at a time
    out = {}
    for name, model in (("head", head), ("draft", tiny_pair()[1])):
        with dsbd_llm(tiny_pair()[0], max_num_seqs=4, speculative_config=_spec(model)) as llm:
            assert runner_of(llm)._dsbd_mixed and runner_of(llm)._dsbd_recycle
            with MixedRows() as mixed:
                (greedy, beams), drafted = _drafted(llm, lambda: (_greedy(llm, [1, 2, WIDTH]), _beams(llm)))
            out[name] = dict(greedy=greedy, beams=beams, drafted=drafted, mixed=mixed.rows,
                             nodes=metric(llm, "vllm:dsbd_draft_nodes"),
                             beam_nodes=metric(llm, "vllm:dsbd_beam_draft_nodes"),
                             passed=metric(llm, "vllm:spec_decode_num_accepted_tokens"))
    return out


@pytest.mark.parametrize("name", ["head", "draft"])
def test_mixed_greedy_and_beam_search_equal_vllm(mixed_runs, plain, name):
    run = mixed_runs[name]
    assert run["greedy"] == plain[0] * 3  # widths 1, 2, 4
    assert run["beams"] == plain[1]
    print(f"{name} mixed: forest nodes {run['nodes']}, beam forest nodes {run['beam_nodes']}, passed {run['passed']}, "
          f"rows mixed {run['mixed']}")
    assert run["nodes"] > 0 and run["beam_nodes"] > 0 and run["mixed"] > 0


def test_mixed_head_drafts_the_sources_candidates(mixed_runs, head):
    outside = mixed_runs["head"]["drafted"] - set(draft_ids(head))
    print(f"drafted outside the head's vocabulary: {len(outside)} tokens")
    assert outside  # q = 0 there for the head alone: only the sources' part of the mixture proposes them


@pytest.fixture(scope="module")
def law(mixed_runs, tmp_path_factory):  # after mixed_runs: one engine at a time
    """``test_engine_eagle3.py``'s law setting (the silenced peaky target, the bigram head x 3 on 200 of 300 ids) with
    the head mixed with the sources."""
    root = tmp_path_factory.mktemp("bigram")
    target = bigram_target(peaky_pair()[0], root / "target")
    agreeing = head_folder(target, root / "head", 200, seed=1, aux_layers=[1, 2, 3], bigram=3.0)
    with dsbd_llm(target, max_num_seqs=4) as llm:
        out = {"plain": _law_sample(llm, None)}
    with dsbd_llm(target, speculative_config=_spec(agreeing, depth=2)) as llm:
        for name in ("exact", "planted"):
            with planted_core_layer(PLANTED if name == "planted" else None):
                before = [metric(llm, f"vllm:spec_decode_num_{k}") or 0 for k in ("draft_tokens", "accepted_tokens")]
                with MixedRows() as mixed:
                    out[name], drafted = _drafted(llm, lambda: _law_sample(llm, 70_000))
                out[name + "_mixed"] = mixed.rows
                after = [metric(llm, f"vllm:spec_decode_num_{k}") or 0 for k in ("draft_tokens", "accepted_tokens")]
                out[name + "_counters"] = tuple(int(a - b) for a, b in zip(after, before))
                out[name + "_outside"] = len(drafted - set(draft_ids(agreeing)))
    return out


def test_mixed_law_equals_plain_vllm_and_planted_rule_is_rejected(law):
    nodes, passed = law["exact_counters"]
    print(f"mixed forests: {nodes} nodes, {passed} layers passed, {law['exact_mixed']} rows mixed, "
          f"{law['exact_outside']} tokens outside the head's")
    assert nodes > 0 and passed > 0 and law["exact_mixed"] > 0 and law["exact_outside"] > 0
    stat, df, thr = chisq.two_sample(law["exact"], law["plain"])
    chisq.report("first 2 tokens, head + sources W=4 vs plain vLLM", stat, df, thr, n=LAW_N, two_sample=True)
    assert df >= 3 and stat < thr
    assert chisq.mde_tv(LAW_N, df, two_sample=True) <= 0.27  # the same law as the head test (df 24: 0.239)
    bad, _, bad_thr = chisq.two_sample(law["planted"], law["plain"])
    chisq.report(f"  {PLANTED} rule planted (must differ)", bad, df, bad_thr)
    assert bad > bad_thr


def test_default_engine_mixed_serves(head, plain, law):  # after law: one engine at a time
    with dsbd_llm(tiny_pair()[0], max_num_seqs=4,
                  speculative_config={"method": "dsbd", "model": str(head), "sources": MIXED,
                                      "cost_model": "auto"}) as llm:
        assert runner_of(llm)._dsbd_mixed and runner_of(llm).dsbd_cost is not None
        slow_target(llm, SLOW_TARGET)  # forests pay by the table on these tiny models only with a dearer target
        assert _greedy(llm, [None]) == plain[0]
        # non-vacuous: forests were drafted (with none the equality above is plain vLLM's own decoding)
        assert (metric(llm, "vllm:spec_decode_num_draft_tokens") or 0) > 0
