"""Wide beams past ``max_model_len``: a beam request's KV slots (every beam's tokens) do not count against the model's
context length on an engine with ``max_beam_slots`` (``DSBDConfig.slot_len``), real vLLM 0.26.0 on CPU.

Tiny random Llama target of ``test_engine_beams.py`` (EOS moved to a token greedy decoding emits early), no forest
source (``"sources": []``); oracle: vLLM's own ``LLM.beam_search`` loop on a plain engine with the same float32 weights
and ``max_logprobs = 2W`` (its loop asks for 2W logprobs per beam). ``max_model_len`` 256 in both. Checked:

* W = 64 and W = 128, 4 tokens, on a 200-token prompt (and a short one), where ``prompt + max_tokens * (W + 1) + 2``
  (up to 718 slots) exceeds ``max_model_len`` 256: ``LLM.beam_search`` on the DSBD engine returns vLLM's sequences token for token, in order,
  cumulative log-probabilities to 1e-4; the runner's block table really is wider than ``max_model_len`` allows and
  some request really held more than ``max_model_len`` slots (the largest ``num_computed_tokens`` the scheduler saw);
* a plain greedy request on the same engine still stops at ``max_model_len`` (finish reason "length", the token count
  vLLM's own bound gives) and equals plain vLLM's greedy tokens;
* a beam search whose trie may exceed ``max_beam_slots`` is refused with a ``ValueError`` naming ``max_tokens`` and
  ``max_beam_slots``, as is a beam longer than ``max_model_len``; the engine keeps serving;
* an engine whose KV pool cannot hold one request of ``max_beam_slots`` slots refuses to start, naming it.
"""
from __future__ import annotations

import random

import pytest

from engine_utils import LOGPROB_TOL, dsbd_llm, runner_of  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

import test_engine_beams  # noqa: E402
from vllm.sampling_params import BeamSearchParams  # noqa: E402

setup = test_engine_beams.setup  # the target with EOS moved (module fixture)

MAX_MODEL_LEN, SLOTS, TOKENS = 256, 1024, 4
WIDTHS = (64, 128)
_rng = random.Random(7)
# long prompts nearly fill the context (positions stay <= 204 < 256), and their beams' slots go past it
PROMPTS = [[_rng.randrange(3, 400) for _ in range(200)], [5, 6, 7, 8]]


def _beam_search(llm, width, max_tokens=TOKENS, prompts=PROMPTS):
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=width, max_tokens=max_tokens))
    return [[(list(s.tokens), s.cum_logprob) for s in o.sequences] for o in outs]


def _greedy(llm, prompt):
    out = llm.generate([{"prompt_token_ids": prompt}], vllm.SamplingParams(temperature=0, max_tokens=400),
                       use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.finish_reason


def test_kv_pool_too_small_refuses_to_start(setup):  # first: before the module's engines start
    folder, _, _ = setup
    with pytest.raises(Exception, match=r"max_beam_slots' = 4096 needs 256 KV blocks"):
        with dsbd_llm(folder, num_gpu_blocks_override=64, block_size=16,
                      speculative_config={"method": "dsbd", "width": 4, "sources": [], "max_beam_slots": 4096}):
            pass
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()  # the engine that refused to start


@pytest.fixture(scope="module")
def plain(setup):
    folder, _, _ = setup
    with dsbd_llm(folder, max_logprobs=2 * max(WIDTHS), max_num_seqs=256) as llm:
        yield {"beams": {w: _beam_search(llm, w) for w in WIDTHS}, "greedy": _greedy(llm, PROMPTS[0])}


@pytest.fixture(scope="module")
def wide(setup, plain):
    folder, _, _ = setup
    with dsbd_llm(folder, max_num_seqs=8, max_logprobs=2 * max(WIDTHS),
                  speculative_config={"method": "dsbd", "width": max(WIDTHS), "sources": [],
                                      "max_beam_slots": SLOTS}) as llm:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        seen = {"max_slots": 0}
        orig = sched.update_from_output

        def spy(scheduler_output, model_runner_output):  # the largest slot count any request reached
            for req in sched.running:
                seen["max_slots"] = max(seen["max_slots"], req.num_computed_tokens)
            return orig(scheduler_output, model_runner_output)

        sched.update_from_output = spy
        yield llm, seen


@pytest.mark.parametrize("width", WIDTHS)
def test_wide_beams_are_vllms_past_max_model_len(plain, wide, width):
    llm, seen = wide
    assert max(len(p) for p in PROMPTS) + TOKENS * (width + 1) + 2 > MAX_MODEL_LEN  # the old bound refused it
    seen["max_slots"] = 0
    got = _beam_search(llm, width)
    want = plain["beams"][width]
    for g, w in zip(got, want):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert all(abs(a - b) < max(1e-4, LOGPROB_TOL) for (_, a), (_, b) in zip(g, w))
    assert all(len(g) == width for g in got)
    # the slots really went past the context length, in a block table wider than max_model_len allows
    assert seen["max_slots"] > MAX_MODEL_LEN, seen
    bt = runner_of(llm).input_batch.block_table[0]
    assert bt.max_num_blocks_per_req * bt.block_size >= SLOTS > MAX_MODEL_LEN


def test_plain_requests_keep_max_model_len(plain, wide):
    llm, _ = wide
    tokens, reason = _greedy(llm, PROMPTS[0])
    assert (tokens, reason) == plain["greedy"]
    assert reason == "length" and len(PROMPTS[0]) + len(tokens) == MAX_MODEL_LEN


def test_refusals(wide):
    llm, _ = wide
    with pytest.raises(ValueError, match=r"max_tokens: .*may hold .*max_beam_slots"):
        _beam_search(llm, 128, max_tokens=8, prompts=PROMPTS[1:])  # 4 + 8 * 129 + 2 = 1038 slots > 1024
    with pytest.raises(ValueError, match=r"max_tokens: a beam of 300 tokens .*longer than max_model_len 256"):
        _beam_search(llm, 1, max_tokens=300, prompts=PROMPTS[1:])
    assert len(_beam_search(llm, 64, prompts=PROMPTS[1:])[0]) == 64  # still serving

