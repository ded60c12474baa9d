"""The DSBD runner never lets a pass with forest attention replay a full CUDA graph, and a pass whose forests are all
chains has no forest attention at all, real vLLM 0.26.0 on CPU (``runner._determine_batch_execution_and_padding``,
``engine/graphs.py``, setting ``full_cuda_graphs``).

vLLM's runner picks each pass's CUDA-graph mode through ``cudagraph_dispatcher.dispatch`` after the DSBD runner has
planned the pass (and built its forest batch). The CPU platform has no graphs, so every dispatch answers NONE; what
this checks is what the DSBD runner asks: FULL excluded (``invalid_modes={FULL}``, vLLM's own exclusion for cascade
attention) exactly when the pass has a forest batch. One engine of width 2 (tiny random Llama pair, depth 3, pinned
speculation) serves width-1 requests (chains: no forest batch in any pass, drafts still accepted), then width-2
requests (forests: a forest batch, and FULL excluded, in their decode passes). Width-1 requests of a wider engine
are drafted by the chain drafter too (``DSBDDrafter._draft_chains``, one host copy for all depths): seeded T = 1
requests give the tokens of the general depth loop.
"""
from __future__ import annotations

import pytest

from engine_utils import (  # sets the CPU engine environment before vllm is imported
    dsbd_llm, metric, runner_of, tiny_pair)
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)
from vllm.config.compilation import CUDAGraphMode  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [42, 43]]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def runs():
    target, draft = tiny_pair()
    with dsbd_llm(target, max_num_seqs=len(PROMPTS),
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": 3,
                                      "width": 2, "verify_budget": None}) as llm:
        runner = runner_of(llm)
        dispatcher = runner.cudagraph_dispatcher
        dispatch = dispatcher.dispatch
        calls: list[tuple[bool, object]] = []  # (the pass has a forest batch, invalid_modes asked)

        def spy(*args, **kwargs):
            calls.append((runner._dsbd_forest is not None, kwargs.get("invalid_modes")))
            return dispatch(*args, **kwargs)

        out = {}
        drafter = runner.drafter
        chains = drafter._draft_chains
        chain_calls = []

        def count_chains(*args, **kwargs):  # a reader, as the chain loop is (``engine/reads.py``)
            chain_calls.append(1)
            return (yield from chains(*args, **kwargs))

        try:
            drafter._draft_chains = count_chains
            seeded = [vllm.SamplingParams(temperature=1.0, seed=10 + k, max_tokens=MAX_TOKENS, ignore_eos=True,
                                          extra_args={"dsbd_width": 1}) for k in range(len(PROMPTS))]
            prompts = [{"prompt_token_ids": p} for p in PROMPTS]
            sampled = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, seeded, use_tqdm=False)]
            out["chain_calls"] = len(chain_calls)
            drafter.chain_drafting = False
            out["sampled"] = (sampled, [list(o.outputs[0].token_ids) for o in llm.generate(prompts, seeded,
                                                                                           use_tqdm=False)])
            out["loop_chain_calls"] = len(chain_calls) - out["chain_calls"]
            drafter.chain_drafting = True
            dispatcher.dispatch = spy
            for width in (1, 2):
                before = metric(llm, "vllm:spec_decode_num_accepted_tokens") or 0
                start = len(calls)
                sp = vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                         extra_args={"dsbd_width": width})
                llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
                out[width] = (calls[start:], metric(llm, "vllm:spec_decode_num_accepted_tokens") - before)
        finally:
            dispatcher.dispatch = dispatch
            drafter._draft_chains = chains
        return out


def test_full_graphs_are_excluded_exactly_for_passes_with_forest_attention(runs):
    for width in (1, 2):
        calls, _ = runs[width]
        assert calls, width
        for has_forest, invalid in calls:
            assert invalid == ({CUDAGraphMode.FULL} if has_forest else None), (width, has_forest, invalid)


def test_chains_need_no_forest_attention(runs):
    calls, accepted = runs[1]
    assert not any(has_forest for has_forest, _ in calls)
    assert accepted >= len(PROMPTS)  # drafts were verified in those passes, and accepted


def test_forests_of_width_two_do(runs):
    calls, accepted = runs[2]
    assert sum(has_forest for has_forest, _ in calls) >= MAX_TOKENS // 4
    assert accepted >= len(PROMPTS)


def test_width_one_requests_of_a_wider_engine_are_drafted_as_chains(runs):
    chained, loop = runs["sampled"]
    assert runs["chain_calls"] >= MAX_TOKENS // 4 and runs["loop_chain_calls"] == 0
    assert chained == loop
    assert len({tuple(t) for t in chained}) == len(PROMPTS)
