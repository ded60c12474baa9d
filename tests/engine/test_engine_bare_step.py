"""A step that drafts nothing is vLLM's own step (``engine/bare.py``; issue "On vLLM's fast path", item 2), real vLLM
0.26.0 on CPU.

* **Operations and reads** (``vllm_dsbd.testing.step_ops``: aten operations dispatched and host reads of tensor values
  per engine step, outside the target's forward): on the tiny random Llama target, 4 greedy requests of 12 tokens,
  the steps that verify nothing and propose nothing of three DSBD engines, ``"sources": []``, the user's engine
  (draft-free sources) and the draft model's, the last two with a pinned cost table under which no forest ever pays
  (so every step's drafting machinery runs and decides depth 0), dispatch at most plain vLLM's operations + 5
  (``MAX_EXTRA_OPS``: the recycle source's ``log_softmax`` and ``topk`` of the roots' rows, which it keeps on the
  device) and read exactly as often as plain vLLM's; the tokens equal plain vLLM's. Power: the same engines with the
  fast path off (``runner.dsbd_vllm_sampler = False``: DSBD's verification of a depth-0 step, what every step ran
  before) exceed the bound, so the count tells the two apart.
* **Law**: unseeded T = 0.7, top-k 4 requests of 4 tokens on the peaky tiny pair's draft-model engine (depth 2, cost
  model off, 2 requests at a time) mix bare steps (vLLM's sampler: prefills and the last tokens, which no forest
  reaches) with forests verified by DSBD within the same requests (both counted); the law of their first 3 tokens
  equals the exact law by enumeration of the target's rows (``beam_oracle.plain_sampling_law``), and a planted fast
  path that loses the request's temperature (vLLM's sampler then draws at T = 1) is rejected by the same
  statistic.
"""
from __future__ import annotations

import statistics
from collections import Counter

import pytest

from engine_utils import dsbd_llm, peaky_pair, runner_of, tiny_pair  # the CPU engine environment first
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

import chisq  # noqa: E402
from beam_oracle import hf_next_probs, plain_sampling_law  # noqa: E402
from vllm_dsbd.testing.step_ops import count_steps  # noqa: E402

MAX_EXTRA_OPS = 5
B, TOKENS = 4, 12
# a table under which verifying more than one token per request never pays: the cost model drafts depth 0
NEVER_PAYS = {"target_ms": {1: 1.0, 2: 1000.0}, "draft_ms": {1: 1.0}}


def _prompts():
    return [{"prompt_token_ids": [(7 * i + j) % 390 + 5 for j in range(8)]} for i in range(B)]


def _bare_counts(llm, fast: bool = True):
    """(median ops, median reads, bare steps, tokens) of a greedy batch (after a warm-up batch)."""
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, detokenize=False)
    runner = runner_of(llm)
    if hasattr(runner, "dsbd_vllm_sampler"):
        runner.dsbd_vllm_sampler = fast
    llm.generate(_prompts(), sp, use_tqdm=False)
    with count_steps(llm) as steps:
        outs = llm.generate(_prompts(), sp, use_tqdm=False)
    bare = [s for s in steps if s.bare and s.reqs == B]
    assert len(bare) >= TOKENS // 2, [(s.drafts, s.proposed, s.prefill) for s in steps]
    return (statistics.median(s.ops for s in bare), statistics.median(s.reads for s in bare), len(bare),
            [list(o.outputs[0].token_ids) for o in outs])


def test_bare_step_dispatches_what_plain_vllm_does():
    target, draft = tiny_pair()
    with dsbd_llm(target) as llm:
        ops0, reads0, n0, tokens0 = _bare_counts(llm)
    print(f"plain vLLM: {ops0} ops, {reads0} reads per bare step ({n0} steps)")
    engines = {"sources []": {"method": "dsbd", "sources": []},
               "user's engine": {"method": "dsbd", "cost_model": NEVER_PAYS},
               "draft model": {"method": "dsbd", "model": str(draft), "num_speculative_tokens": 3,
                               "cost_model": NEVER_PAYS}}
    for name, spec in engines.items():
        with dsbd_llm(target, speculative_config=spec) as llm:
            ops, reads, n, tokens = _bare_counts(llm)
            slow_ops, slow_reads, _, slow_tokens = _bare_counts(llm, fast=False)
            bare_steps = runner_of(llm).dsbd_stats.bare_steps
        print(f"{name}: {ops} ops, {reads} reads per bare step ({n} steps); fast path off: {slow_ops} ops, "
              f"{slow_reads} reads")
        assert tokens == tokens0 and slow_tokens == tokens0, name
        assert bare_steps >= n, (name, bare_steps)  # the fast path ran (vLLM's sampler)
        assert ops <= ops0 + MAX_EXTRA_OPS and reads == reads0, (name, ops, reads, ops0, reads0)
        # power: DSBD's own depth-0 step is told apart by the same count
        assert slow_ops > ops0 + MAX_EXTRA_OPS or slow_reads > reads0, (name, slow_ops, slow_reads)


PROMPT = [11, 12, 13, 14, 15, 16]
LAW_N, LAW_TOKENS, MAX_TOKENS, TEMP, TOP_K = 2400, 3, 4, 0.7, 4


def _law(llm, planted: bool = False) -> tuple[Counter, int, int]:
    runner = runner_of(llm)
    stats = runner.dsbd_stats
    bare0, forests0 = stats.bare_steps, stats.forest_iterations
    if planted:  # the fast path loses the request's temperature: vLLM's sampler divides rows already multiplied
        real = runner._bare_sample

        def lost_temperature(logits, plan):
            logits.mul_(TEMP)
            return real(logits, plan)
        runner._bare_sample = lost_temperature
    try:
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * LAW_N,
                            vllm.SamplingParams(temperature=TEMP, top_k=TOP_K, max_tokens=MAX_TOKENS,
                                                ignore_eos=True, detokenize=False), use_tqdm=False)
    finally:
        if planted:
            del runner._bare_sample
    return (Counter(tuple(o.outputs[0].token_ids[:LAW_TOKENS]) for o in outs), stats.bare_steps - bare0,
            stats.forest_iterations - forests0)


@pytest.mark.slow
def test_bare_steps_keep_the_law():
    target, draft = peaky_pair()
    law = plain_sampling_law(hf_next_probs(target), PROMPT, LAW_TOKENS, temperature=TEMP, min_mass=0.0, top_k=TOP_K)
    with dsbd_llm(target, speculative_config={"method": "dsbd", "model": str(draft), "width": 2,
                                              "num_speculative_tokens": 2}, max_num_seqs=2) as llm:
        counts, bare_steps, forests = _law(llm)
        planted, _, _ = _law(llm, planted=True)
    exact = chisq.goodness_of_fit(counts, law, LAW_N)
    wrong = chisq.goodness_of_fit(planted, law, LAW_N)
    chisq.report_power("bare steps mixed with forests, first 3 tokens", exact, wrong, "temperature lost", LAW_N)
    print(f"bare steps {bare_steps}, forests verified {forests}")
    assert bare_steps >= 100 and forests >= 100, (bare_steps, forests)  # both kinds of step, in the same requests
    assert exact[1] >= 3 and exact[0] < exact[2], exact
    assert wrong[0] > wrong[2], wrong
    assert chisq.mde_tv(LAW_N, exact[1]) < 0.15
