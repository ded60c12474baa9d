"""The draft's catch-up pass is bounded by ``max_num_batched_tokens`` (``DSBDDrafter.catch_up_prefix``), real vLLM
0.26.0 on CPU.

A request's first forest needs the draft's K/V of its whole prompt; the drafter runs it in the catch-up pass, for
every new request of the step at once, which vLLM's drafter dummy run (a pass of ``max_num_batched_tokens`` tokens)
does not profile. One engine (the peaky tiny random Llama pair, W = 2, G = 3, pinned; ``max_num_batched_tokens`` = 64,
4 requests of 150-token prompts: catch-ups of 600 tokens), greedy plain requests and a beam search, run twice: with
the bound, and with it lifted (the drafter's ``max_catch_up`` set past every catch-up). Asserted:

* bounded, no draft pass runs more than 64 tokens; lifted, one does (the bound has power);
* the outputs are the same, and so are the forests' accepted tokens and the beam requests' passed layers (the draft
  K/V the passes ahead wrote are the one pass's: a wrong slot or position would draft other tokens).
"""
from __future__ import annotations

import random

import pytest

from engine_utils import beam_counters, dsbd_llm, metric, peaky_pair, runner_of  # sets the CPU engine environment first
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm.sampling_params import BeamSearchParams  # noqa: E402

BOUND, PROMPT, R = 64, 150, 4


def _run(llm, runner, bound: int) -> dict:
    runner.drafter.max_catch_up = bound
    sizes = []
    real = runner.drafter.forward_ragged

    def recording(input_ids, *args, **kwargs):
        sizes.append(len(input_ids))
        return real(input_ids, *args, **kwargs)

    runner.drafter.forward_ragged = recording
    try:
        prompts = [{"prompt_token_ids": random.Random(k).choices(range(300), k=PROMPT)} for k in range(R)]
        before = metric(llm, "vllm:spec_decode_num_accepted_tokens") or 0
        greedy = llm.generate(prompts, vllm.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                              use_tqdm=False)
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens") - before
        b0 = beam_counters(llm)
        beams = llm.beam_search(prompts[:2], BeamSearchParams(beam_width=2, max_tokens=6))
        b1 = beam_counters(llm)
    finally:
        del runner.drafter.forward_ragged
    return dict(sizes=sizes, greedy=[list(o.outputs[0].token_ids) for o in greedy], accepted=accepted,
                beams=[[list(s.tokens) for s in o.sequences] for o in beams],
                layers=b1["beam_layers_passed"] - b0["beam_layers_passed"],
                nodes=b1["beam_draft_nodes"] - b0["beam_draft_nodes"])


@pytest.fixture(scope="module")
def runs():
    target, draft = peaky_pair()
    with dsbd_llm(target, max_num_seqs=R, max_num_batched_tokens=BOUND, max_model_len=PROMPT + 32,
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": 3,
                                      "width": 2, "verify_budget": None}) as llm:
        runner = runner_of(llm)
        assert runner.drafter.max_catch_up == BOUND
        return _run(llm, runner, BOUND), _run(llm, runner, 1 << 30)


def test_no_draft_pass_runs_more_than_the_batched_tokens(runs):
    bounded, lifted = runs
    print(f"\nlongest draft pass: {max(bounded['sizes'])} tokens bounded, {max(lifted['sizes'])} lifted")
    assert max(bounded["sizes"]) <= BOUND < max(lifted["sizes"])


def test_the_bounded_catch_up_drafts_what_the_one_pass_drafts(runs):
    bounded, lifted = runs
    print(f"\naccepted {bounded['accepted']} / {lifted['accepted']}; beam layers passed {bounded['layers']} / "
          f"{lifted['layers']} of {bounded['nodes']} / {lifted['nodes']} nodes")
    assert bounded["greedy"] == lifted["greedy"] and bounded["beams"] == lifted["beams"]
    assert bounded["accepted"] == lifted["accepted"] > 0
    assert (bounded["layers"], bounded["nodes"]) == (lifted["layers"], lifted["nodes"]) and bounded["nodes"] > 0
