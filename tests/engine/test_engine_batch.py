"""DSBD in a real vLLM 0.26.0 engine on CPU under batching and preemption, temperature 0.

One DSBD engine (width 4, depth 3) with a KV cache far too small for the batch (``num_gpu_blocks_override``,
block size 16) and a large ``max_num_seqs``, so the scheduler preempts running requests and later resumes them
(recomputing their prefix). Checked:

* a batch mixing per-request widths (``extra_args={"dsbd_width": 1 / 2 / 4}``), long (~150-token) and short prompts
  gives exactly the tokens of the same requests run one at a time on the same engine, and preemption did happen
  (``vllm:num_preemptions`` > 0 after the batch), so the check is not vacuous;
* width 1 equals vLLM's own ``draft_model`` speculation with the same draft (a second engine), and both engines
  report drafted and accepted tokens.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine_utils import dsbd_llm, metric  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh

WIDTH, DEPTH, MAX_TOKENS = 4, 3, 32
BLOCK_SIZE, NUM_BLOCKS = 16, 16  # 256 token slots (the least max_model_len allows) for ~1300 tokens of requests

_rng = random.Random(1234)
LONG = [[_rng.randrange(3, 400) for _ in range(150)] for _ in range(4)]
SHORT = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [250, 3, 77, 12, 9]]
PROMPTS = [LONG[0], SHORT[0], LONG[1], SHORT[1], LONG[2], SHORT[2], LONG[3], SHORT[3]]
# every width on long and short prompts
REQS = [(p, w) for p, w in zip(PROMPTS, [1, 2, 4, 4, 2, 1, 4, 2])] + [(LONG[0], 4), (SHORT[0], 1)]


def _params(width=None):
    extra = {"dsbd_width": width} if width is not None else None
    return vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args=extra)


SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens")


@pytest.fixture(scope="module")
def dsbd_runs(tiny_pair):
    target, draft = tiny_pair
    with dsbd_llm(target, block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS, max_num_seqs=64,
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                      "width": WIDTH}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in REQS], [_params(w) for _, w in REQS])
        batch = [list(o.outputs[0].token_ids) for o in outs]
        preempted = metric(llm, "vllm:num_preemptions")  # 35 with these settings
        one_by_one = []
        for p, w in REQS:
            (o,) = llm.generate([{"prompt_token_ids": p}], _params(w))
            one_by_one.append(list(o.outputs[0].token_ids))
        # W = 1 on the short prompts, for the comparison with vLLM's draft_model speculation
        w1 = [list(o.outputs[0].token_ids)
              for o in llm.generate([{"prompt_token_ids": p} for p in SHORT], _params(1))]
        spec = {name: metric(llm, name) for name in SPEC_METRICS}
        # a bad per-request width is a ValueError for the caller, and the engine keeps serving
        bad = []
        for value in (99, 0, "two"):
            with pytest.raises(ValueError, match="dsbd_width") as err:
                llm.generate([{"prompt_token_ids": SHORT[0]}], vllm.SamplingParams(
                    temperature=0, max_tokens=4, extra_args={"dsbd_width": value}))
            bad.append(str(err.value))
        # so is a setting the DSBD sampler does not apply (named in the message), never silently ignored
        from vllm.sampling_params import RepetitionDetectionParams

        for name, value in (("repetition_detection", RepetitionDetectionParams(max_pattern_size=4, min_count=3)),):
            with pytest.raises(ValueError, match=rf"^{name}: not supported with speculative method 'dsbd'") as err:
                llm.generate([{"prompt_token_ids": SHORT[0]}], vllm.SamplingParams(
                    temperature=0, max_tokens=4, **{name: value}))
            bad.append(str(err.value))
        (after,) = llm.generate([{"prompt_token_ids": SHORT[0]}], _params(1))
        yield {"batch": batch, "one_by_one": one_by_one, "preempted": preempted, "w1": w1, "spec": spec,
               "bad": bad, "after_bad": list(after.outputs[0].token_ids)}


@pytest.fixture(scope="module")
def draft_model_run(tiny_pair, dsbd_runs):  # after dsbd_runs: one engine at a time
    target, draft = tiny_pair
    with dsbd_llm(target, max_num_seqs=8,
                  speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": DEPTH}
                  ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in SHORT], _params())
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        yield tokens, {name: metric(llm, name) for name in SPEC_METRICS}


def test_preemption_happened(dsbd_runs):
    assert dsbd_runs["preempted"] is not None and dsbd_runs["preempted"] > 0


def test_batch_equals_one_at_a_time(dsbd_runs):
    for (p, w), b, s in zip(REQS, dsbd_runs["batch"], dsbd_runs["one_by_one"]):
        assert len(b) == MAX_TOKENS
        assert b == s, (len(p), w)


def test_width1_equals_draft_model(dsbd_runs, draft_model_run):
    tokens, spec = draft_model_run
    assert dsbd_runs["w1"] == tokens
    for m in (dsbd_runs["spec"], spec):
        assert m["vllm:spec_decode_num_draft_tokens"] > 0, m
        assert m["vllm:spec_decode_num_accepted_tokens"] > 0, m


def test_bad_request_is_value_error_and_engine_keeps_serving(dsbd_runs):
    assert len(dsbd_runs["bad"]) == 4  # three bad widths, one refused setting
    assert dsbd_runs["after_bad"] == dsbd_runs["w1"][0][: len(dsbd_runs["after_bad"])]
    assert len(dsbd_runs["after_bad"]) > 0
