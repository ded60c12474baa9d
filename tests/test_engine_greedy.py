"""DSBD through a real vLLM 0.26.0 engine on CPU, temperature 0 (milestone M1).

One DSBD engine (width 4, depth 3) serves every request; each request picks its width with
``SamplingParams(extra_args={"dsbd_width": w})``. ``max_num_seqs`` is small so that requests join the batch at
different steps (prefill and decode rows, and different widths, in one batch). Checked:

* every request's tokens are exactly ``core.reference.dsbd_decode`` (single-output-beam mode, temperature 0) on the
  same float32 weights through Hugging Face, with vLLM's iteration structure: the prefill step is a depth-0
  iteration (one target token), then DSBD iterations from prompt + that token;
* width 1 equals plain greedy vLLM (no speculation);
* the checks are not vacuous: vLLM's speculative metrics show drafts and accepted tokens, and the DSBD metrics show
  verified forests.

The models: a tiny random Llama target (3 layers) and its first 2 layers as the draft (they agree on about half of
the greedy tokens, so iterations both pass and fail layers).
"""
from __future__ import annotations


import pytest
import torch

from engine_utils import metric, shutdown  # sets the CPU engine environment before vllm is imported
vllm = pytest.importorskip("vllm")

from vllm_dsbd.core.reference import dsbd_decode  # noqa: E402
from vllm_dsbd.models import load_hf, next_token_logits_fn, tiny_llama_pair  # noqa: E402

WIDTH, DEPTH, MAX_TOKENS = 4, 3, 24
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [7], [250, 3, 77, 12, 9]]
WIDTHS = [1, 2, 4]


def _llm(target, **kw):
    return vllm.LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                    disable_log_stats=False, enable_prefix_caching=False, max_num_seqs=4, **kw)


def reference_tokens(target_fn, draft_fn, prompt, width, n, *, temperature=0.0, seed=0, dynamic=False):
    """``dsbd_decode`` with vLLM's iteration structure: one depth-0 step (the prefill), then DSBD from there."""
    kw = dict(width=width, depth=DEPTH, temperature=temperature, mode="single", seed=seed, dynamic_width=dynamic)
    first = dsbd_decode(target_fn, draft_fn, prompt, max_new_tokens=1, **kw).beams[0][0]
    rest = dsbd_decode(target_fn, draft_fn, prompt + first, max_new_tokens=n - 1, **kw).beams[0][0]
    return first + rest


@pytest.fixture(scope="module")
def pair():
    return tiny_llama_pair(vocab_size=400, seed=0, draft_init="truncate", init_std=0.1, target_layers=3,
                           draft_layers=2)


@pytest.fixture(scope="module")
def plain_greedy(pair):
    target, _ = pair
    llm = _llm(target)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    shutdown(llm)
    return tokens


@pytest.fixture(scope="module")
def dsbd_run(pair, plain_greedy):  # plain_greedy first: one engine at a time
    target, draft = pair
    llm = _llm(target, speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                           "width": WIDTH})
    reqs = [(w, p) for w in WIDTHS for p in PROMPTS]
    outs = llm.generate(
        [{"prompt_token_ids": p} for _, p in reqs],
        [vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args={"dsbd_width": w})
         for w, _ in reqs])
    tokens = {(w, tuple(p)): list(o.outputs[0].token_ids) for (w, p), o in zip(reqs, outs)}
    metrics = {name: metric(llm, name) for name in (
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
        "vllm:dsbd_iterations", "vllm:dsbd_emitted_tokens")}
    metrics["layers_passed"] = metric(llm, "vllm:dsbd_layers_passed")
    yield tokens, metrics
    shutdown(llm)


@pytest.fixture(scope="module")
def hf_fns(pair):
    target, draft = pair
    return next_token_logits_fn(load_hf(target)), next_token_logits_fn(load_hf(draft))


def test_width1_equals_plain_greedy(dsbd_run, plain_greedy):
    tokens, _ = dsbd_run
    for p, expected in zip(PROMPTS, plain_greedy):
        assert tokens[(1, tuple(p))] == expected, p


@pytest.mark.parametrize("width", WIDTHS)
def test_equals_reference_decoder(dsbd_run, hf_fns, width):
    tokens, _ = dsbd_run
    target_fn, draft_fn = hf_fns
    with torch.no_grad():
        for p in PROMPTS:
            expected = reference_tokens(target_fn, draft_fn, p, width, MAX_TOKENS)
            assert tokens[(width, tuple(p))] == expected, (width, p)


def test_not_vacuous(dsbd_run):
    _, m = dsbd_run
    assert m["vllm:spec_decode_num_drafts"] > 0
    assert m["vllm:spec_decode_num_draft_tokens"] > 0
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0
    assert m["vllm:dsbd_iterations"] > 0
    # one emitted-token count per request and step: prefill tokens plus DSBD iterations
    assert m["vllm:dsbd_emitted_tokens"] >= len(WIDTHS) * len(PROMPTS) * MAX_TOKENS
    hist = m["layers_passed"]
    assert hist is not None and hist.count == m["vllm:dsbd_iterations"]
    # mean layers passed = vLLM's accepted tokens per draft
    assert abs(hist.sum - m["vllm:spec_decode_num_accepted_tokens"]) < 1e-6
