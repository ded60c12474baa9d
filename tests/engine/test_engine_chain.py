"""An engine of width 1 (every forest a chain: ``sampler.verify``'s chain fast path, ``core/chain.py``) emits exactly
the tokens it emits with the fast path switched off, real vLLM 0.26.0 on CPU. The other engine tests run engines of
width >= 2 (per-request widths of 1 there still take the general path), so this is the fast path's engine check;
``test_verify_chain.py`` compares the two paths step by step on synthetic steps.

One engine (tiny random Llama pair, depth 3, pinned speculation), one batch mixing T = 1 with seeds, T = 0.8 with
top-k / top-p, greedy requests and requests that may stop at EOS, generated twice: fast path on, then
``sampler.verify(..., chain_fast_path=False)`` for every step. Outputs are compared token for token, and the fast path
must have answered every verification step of the first run. A width-1 forest is a chain, which the layers' own
causal attention already computes right (``attention.drop_chain_queries``): no pass of either run recomputes forest
attention, and the drafts are still accepted (vLLM's spec-decode counters). A third run drafts with the general depth
loop instead of the width-1 chain drafter (``DSBDDrafter._draft_chains``, one host copy for all depths): the same
tokens and the same accepted-draft count.
"""
from __future__ import annotations

import functools

import pytest

from engine_utils import (  # sets the CPU engine environment before vllm is imported
    eos_pair_engine, metric, runner_of, shutdown)
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm_dsbd.engine import attention, sampler  # noqa: E402

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh

DEPTH, MAX_TOKENS, EOS = 3, 24, 166
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [7], [250, 3, 77, 12, 9], [42, 43]]


def _params():
    out = []
    for i, _ in enumerate(PROMPTS):
        out.append(vllm.SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=i % 2 == 0))
        out.append(vllm.SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=200 + i, max_tokens=MAX_TOKENS,
                                       ignore_eos=True))
        out.append(vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=i % 2 == 1))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # EOS = a token this random model draws often (166 repeats in its greedy outputs), so that drafts end at EOS
    llm = eos_pair_engine(tmp_path_factory.mktemp("eos") / "target", EOS, width=1, depth=DEPTH,
                          max_num_seqs=len(PROMPTS) * 3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in range(3)]
    core, verify, recompute = sampler.verify_chains, sampler.verify, attention.recompute_forest_outputs
    calls = {"called": 0, "answered": 0, "recomputed": 0}

    def count_recompute(*args):
        calls["recomputed"] += 1
        return recompute(*args)

    def spy(*args):
        out = core(*args)
        calls["called"] += 1
        calls["answered"] += out is not None
        return out

    try:
        sampler.verify_chains = spy
        attention.recompute_forest_outputs = count_recompute
        fast = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, _params(), use_tqdm=False)]
        fast_calls = dict(calls)
        sampler.verify = functools.partial(verify, chain_fast_path=False)
        general = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, _params(), use_tqdm=False)]
        general_calls = calls["called"] - fast_calls["called"]
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
        sampler.verify = verify
        drafter = runner_of(llm).drafter
        drafter.chain_drafting = False
        loop = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, _params(), use_tqdm=False)]
        loop_accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens") - accepted
    finally:
        sampler.verify_chains, sampler.verify, attention.recompute_forest_outputs = core, verify, recompute
        shutdown(llm)
    return fast, general, fast_calls, general_calls, calls["recomputed"], accepted, loop, loop_accepted


def test_width_one_engine_same_tokens_with_and_without_the_fast_path(runs):
    fast, general, fast_calls, general_calls, *_ = runs
    assert fast == general
    assert all(len(t) > 0 for t in fast)
    assert len({tuple(t) for t in fast}) > len(PROMPTS)  # the seeds and settings give different samples


def test_the_fast_path_ran(runs):
    _, _, fast_calls, general_calls, *_ = runs
    assert fast_calls["called"] >= MAX_TOKENS // (DEPTH + 1) and fast_calls["answered"] == fast_calls["called"]
    assert general_calls == 0


def test_chains_keep_the_layers_causal_attention(runs):
    *_, recomputed, accepted, _, _ = runs
    assert recomputed == 0
    assert accepted >= 2 * len(PROMPTS)  # the drafts the causal attention verified were accepted


def test_chain_drafter_drafts_what_the_depth_loop_drafts(runs):
    fast, *_, accepted, loop, loop_accepted = runs
    assert loop == fast
    assert any(t[-1] == EOS and len(t) < MAX_TOKENS for t in fast)  # EOS ended some requests (and drafted chains)
    assert loop_accepted * 2 == accepted  # the first two runs drafted the same as this one, each
