"""Load-aware speculation in a real vLLM 0.26.0 engine on CPU (``engine/load.py``), temperature 0.

One DSBD engine (width 2, depth 3: a request's full step is 1 + 6 = 7 tokens) with ``verify_budget`` 16 tokens per
step. The same prompts run alone, as a batch of 4 and as a batch of 16 (every batch submitted at once, so all its
requests decode together):

* alone, a request drafts its full shape (depth 3, up to 6 nodes);
* in the batch of 4 (full shapes: 28 tokens) each request drafts width 1, depth 3 (4 x 4 = 16 tokens): fewer forest
  nodes per forest than alone, read from vLLM's spec-decode counters (nodes verified / forests verified);
* in the batch of 16 the roots alone fill the budget: depth 0, no forest verified at all;
* every output equals plain greedy decoding (the Hugging Face target), whatever the load;
* the depth each request was allowed is in ``vllm:dsbd_draft_depth`` and the worker's counts.

The pinned setting (``verify_budget`` null) is ``test_engine_load_pinned.py``'s.
"""
from __future__ import annotations

import pytest
import torch

from engine_utils import dsbd_llm, greedy_tokens, metric  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm_dsbd.testing.models import load_hf, next_token_logits_fn  # noqa: E402

WIDTH, DEPTH, BUDGET, MAX_TOKENS = 2, 3, 16, 12
PROMPTS = [[5 + k, 6 + 2 * k, 7 + 3 * k] for k in range(16)]
SPEC = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens")


def _llm(target, **spec):
    """The DSBD engine of these tests (a context manager: ``with _llm(...) as llm``), ``spec`` added to its
    speculative config."""
    return dsbd_llm(target, max_num_seqs=16,
                    speculative_config={"num_speculative_tokens": DEPTH, "width": WIDTH, "method": "dsbd", **spec})


def run_batches(llm, batches) -> dict:
    """Each batch's tokens and what it added to the spec-decode counters and to the allowed depths."""
    out = {}
    for name, prompts in batches:
        before = {k: metric(llm, k) or 0 for k in SPEC}
        depths0 = llm.collective_rpc("dsbd_load")[0]["depths"]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
        depths = llm.collective_rpc("dsbd_load")[0]["depths"]
        out[name] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                     **{k: (metric(llm, k) or 0) - before[k] for k in SPEC},
                     "depths": {d: n - depths0.get(d, 0) for d, n in depths.items() if n - depths0.get(d, 0)}}
    return out


@pytest.fixture(scope="module")
def greedy(tiny_pair):
    fn = next_token_logits_fn(load_hf(tiny_pair[0]))
    with torch.no_grad():
        return [greedy_tokens(fn, p, MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def runs(tiny_pair):
    target, draft = tiny_pair
    with _llm(target, model=str(draft), verify_budget=BUDGET) as llm:
        out = run_batches(llm, [("alone", PROMPTS[:1]), ("four", PROMPTS[:4]), ("sixteen", PROMPTS)])
        out["load"] = llm.collective_rpc("dsbd_load")[0]
        hist = metric(llm, "vllm:dsbd_draft_depth")
        out["hist"] = {float(le): n for le, n in hist.buckets.items()} if hist is not None else None
        out["hist_count"] = hist.count if hist is not None else None
        return out


def test_outputs_equal_greedy_at_every_load(runs, greedy):
    assert runs["alone"]["tokens"] == greedy[:1]
    assert runs["four"]["tokens"] == greedy[:4]
    assert runs["sixteen"]["tokens"] == greedy


def test_budget_is_the_configured_one(runs):
    assert runs["load"]["budget"] == BUDGET and runs["load"]["times"] is None  # no start-up probe


def test_alone_drafts_the_full_shape(runs):
    alone = runs["alone"]
    assert set(alone["depths"]) == {DEPTH}
    assert alone["vllm:spec_decode_num_drafts"] > 0
    # the last steps' forests are cut by max_tokens; the first ones are full: more than width 1 x depth 3 on average
    assert alone["vllm:spec_decode_num_draft_tokens"] > DEPTH * alone["vllm:spec_decode_num_drafts"]


def test_a_batch_of_four_drafts_narrower_forests(runs):
    four, alone = runs["four"], runs["alone"]
    assert set(four["depths"]) == {DEPTH}  # depth first: the width shrinks to 1, the depth stays
    assert four["vllm:spec_decode_num_drafts"] > 0
    per_forest = four["vllm:spec_decode_num_draft_tokens"] / four["vllm:spec_decode_num_drafts"]
    assert per_forest <= DEPTH < alone["vllm:spec_decode_num_draft_tokens"] / alone["vllm:spec_decode_num_drafts"]


def test_past_the_budget_nothing_is_drafted(runs):
    sixteen = runs["sixteen"]
    assert sixteen["depths"] and set(sixteen["depths"]) == {0}
    assert sixteen["depths"][0] >= len(PROMPTS) * (MAX_TOKENS - 1)  # every request, every decoding step
    assert sixteen["vllm:spec_decode_num_drafts"] == 0 and sixteen["vllm:spec_decode_num_draft_tokens"] == 0


def test_allowed_depths_reach_prometheus(runs):
    counts = runs["load"]["depths"]
    assert runs["hist_count"] == sum(counts.values())
    assert runs["hist"][0.0] == counts[0]  # bucket "le 0": the depth-0 observations
    assert runs["hist"][float(DEPTH)] == sum(counts.values())  # nothing above the configured depth
