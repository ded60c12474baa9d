"""DSBD through a real vLLM 0.26.0 engine on CPU, temperature 0.

One DSBD engine (width 4, depth 3) serves every request; each request picks its width with
``SamplingParams(extra_args={"dsbd_width": w})``. ``max_num_seqs`` is small so that requests join the batch at
different steps (prefill and decode rows, and different widths, in one batch). Checked:

* every width (1, 2, 4) equals plain greedy vLLM (no speculation): the engine's default mode "sample" verifies each
  layer's up to W drafts with one output (K = 1), so a plain request is greedy decoding whatever W
  (docs/design/algorithm.md §1);
* every request's tokens are exactly ``core.reference.dsbd_decode(mode="sample", temperature=0)`` on the same
  float32 weights through Hugging Face, with vLLM's iteration structure: the prefill step is a depth-0 iteration
  (one target token), then DSBD iterations from prompt + that token;
* logprobs (``logprobs=5``) of every emitted token and its top 5 equal plain vLLM's (raw logprobs, 1e-4; on a GPU
  ``engine_utils.LOGPROB_TOL``), so vLLM's
  own ``LLM.beam_search`` (a front-end loop over one-token requests with logprobs) runs on a DSBD engine and returns
  the sequences and cumulative log-probabilities of a plain engine;
* the checks are not vacuous: vLLM's speculative metrics show drafts and accepted tokens, and the DSBD metrics show
  verified forests; at W = 4, more drafts are accepted than at W = 1.

The models: a tiny random Llama target (3 layers) and its first 2 layers as the draft (they agree on about half of
the greedy tokens, so iterations both pass and fail layers).
"""
from __future__ import annotations


import pytest
import torch

from engine_utils import LOGPROB_TOL, dsbd_llm, metric  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm.sampling_params import BeamSearchParams  # noqa: E402
from vllm_dsbd.core.reference import dsbd_decode  # noqa: E402
from vllm_dsbd.testing.models import load_hf, next_token_logits_fn  # noqa: E402

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh

WIDTH, DEPTH, MAX_TOKENS = 4, 3, 24
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [7], [250, 3, 77, 12, 9]]
WIDTHS = [1, 2, 4]
LOGPROBS = 5
BEAM = BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.8)


def _beams(llm):
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:3]], BEAM)
    return [[(list(s.tokens), s.cum_logprob) for s in o.sequences] for o in outs]


def reference_tokens(target_fn, draft_fn, prompt, width, n, *, temperature=0.0, seed=0, dynamic=False):
    """``dsbd_decode`` with vLLM's iteration structure: one depth-0 step (the prefill), then DSBD from there."""
    kw = dict(width=width, depth=DEPTH, temperature=temperature, mode="sample", seed=seed, dynamic_width=dynamic)
    first = dsbd_decode(target_fn, draft_fn, prompt, max_new_tokens=1, **kw).beams[0][0]
    rest = dsbd_decode(target_fn, draft_fn, prompt + first, max_new_tokens=n - 1, **kw).beams[0][0]
    return first + rest


@pytest.fixture(scope="module")
def plain_greedy(tiny_pair):
    target, _ = tiny_pair
    with dsbd_llm(target, max_num_seqs=4) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                logprobs=LOGPROBS))
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [o.outputs[0].logprobs for o in outs]
        beams = _beams(llm)
    return tokens, logprobs, beams


@pytest.fixture(scope="module")
def dsbd_run(tiny_pair, plain_greedy):  # plain_greedy first: one engine at a time
    target, draft = tiny_pair
    # pinned (verify_budget null): test_not_vacuous compares the acceptance of widths 4 and 1, and at a measured
    # budget of 16 tokens load-aware speculation would draft 4 requests of width 4 at width 1
    with dsbd_llm(target, max_num_seqs=4,
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                      "width": WIDTH, "verify_budget": None}) as llm:
        reqs = [(w, p) for w in WIDTHS for p in PROMPTS]
        outs = llm.generate(
            [{"prompt_token_ids": p} for _, p in reqs],
            [vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args={"dsbd_width": w},
                                 logprobs=LOGPROBS) for w, _ in reqs])
        tokens = {(w, tuple(p)): list(o.outputs[0].token_ids) for (w, p), o in zip(reqs, outs)}
        logprobs = {(w, tuple(p)): o.outputs[0].logprobs for (w, p), o in zip(reqs, outs)}
        # per-width acceptance, one width at a time (the counters are engine-wide)
        accepted = {}
        for w in (1, WIDTH):
            before = metric(llm, "vllm:spec_decode_num_accepted_tokens") or 0
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                         vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                             extra_args={"dsbd_width": w}))
            accepted[w] = metric(llm, "vllm:spec_decode_num_accepted_tokens") - before
        metrics = {name: metric(llm, name) for name in (
            "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
            "vllm:dsbd_iterations", "vllm:dsbd_emitted_tokens", "vllm:dsbd_draft_nodes", "vllm:dsbd_target_passes")}
        metrics["layers_passed"] = metric(llm, "vllm:dsbd_layers_passed")
        metrics["per_pos"] = metric(llm, "vllm:spec_decode_num_accepted_tokens_per_pos")
        metrics["accepted_by_width"] = accepted
        beams = _beams(llm)
        yield tokens, metrics, logprobs, beams


@pytest.fixture(scope="module")
def hf_fns(tiny_pair):
    target, draft = tiny_pair
    return next_token_logits_fn(load_hf(target)), next_token_logits_fn(load_hf(draft))


@pytest.mark.parametrize("width", WIDTHS)
def test_every_width_equals_plain_greedy(dsbd_run, plain_greedy, width):
    tokens = dsbd_run[0]
    for p, expected in zip(PROMPTS, plain_greedy[0]):
        assert tokens[(width, tuple(p))] == expected, (width, p)


@pytest.mark.parametrize("width", WIDTHS)
def test_logprobs_equal_plain_vllm(dsbd_run, plain_greedy, width):
    got = dsbd_run[2]
    n_checked = 0
    for p, expected in zip(PROMPTS, plain_greedy[1]):
        mine = got[(width, tuple(p))]
        assert mine is not None and len(mine) == len(expected) == MAX_TOKENS, (width, p)
        for a, b in zip(mine, expected):
            assert set(a) == set(b) and len(a) >= LOGPROBS, (width, p, a, b)
            for tok in b:
                assert abs(a[tok].logprob - b[tok].logprob) < LOGPROB_TOL, (width, p, tok)
                assert a[tok].rank == b[tok].rank
                n_checked += 1
    assert n_checked >= len(PROMPTS) * MAX_TOKENS * LOGPROBS


def test_vllm_beam_search_runs_on_dsbd_engine(dsbd_run, plain_greedy):
    got, expected = dsbd_run[3], plain_greedy[2]
    assert len(got) == len(expected) == 3
    for g, e in zip(got, expected):
        assert [t for t, _ in g] == [t for t, _ in e]
        assert all(abs(a - b) < LOGPROB_TOL for (_, a), (_, b) in zip(g, e))


@pytest.mark.parametrize("width", WIDTHS)
def test_equals_reference_decoder(dsbd_run, hf_fns, width):
    tokens = dsbd_run[0]
    target_fn, draft_fn = hf_fns
    with torch.no_grad():
        for p in PROMPTS:
            expected = reference_tokens(target_fn, draft_fn, p, width, MAX_TOKENS)
            assert tokens[(width, tuple(p))] == expected, (width, p)


def test_not_vacuous(dsbd_run):
    m = dsbd_run[1]
    # W = 4 checks four drafts per depth against the one output: it accepts more than W = 1 on the same prompts
    print("accepted draft tokens by width:", m["accepted_by_width"])
    assert m["accepted_by_width"][WIDTH] > m["accepted_by_width"][1] > 0
    assert m["vllm:spec_decode_num_drafts"] > 0
    assert m["vllm:spec_decode_num_draft_tokens"] > 0
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0
    assert m["vllm:dsbd_iterations"] > 0
    # one emitted-token count per request and step: prefill tokens plus DSBD iterations
    assert m["vllm:dsbd_emitted_tokens"] >= len(WIDTHS) * len(PROMPTS) * MAX_TOKENS
    hist = m["layers_passed"]
    assert hist is not None and hist.count == m["vllm:dsbd_iterations"]
    # target passes, counted per request and step: each emits 1 token plus the layers it passed, and at least one
    # pass per request is a prefill (no forest)
    assert m["vllm:dsbd_target_passes"] == m["vllm:dsbd_emitted_tokens"] - hist.sum
    assert m["vllm:dsbd_target_passes"] >= m["vllm:dsbd_iterations"] + (len(WIDTHS) + 2) * len(PROMPTS)
    # mean layers passed = vLLM's accepted tokens per draft
    assert abs(hist.sum - m["vllm:spec_decode_num_accepted_tokens"]) < 1e-6


def test_vllm_spec_decode_metrics_describe_the_forest(dsbd_run):
    """vLLM's own spec-decode metrics tell the truth about DSBD (patches spec_stats_depths / spec_stats_prometheus):
    drafts = forests verified, drafted tokens = forest nodes verified, accepted = layers passed, and one
    per-position series per draft depth, position p counting the iterations that passed depth p + 1."""
    m = dsbd_run[1]
    hist = m["layers_passed"]
    assert m["vllm:spec_decode_num_drafts"] == m["vllm:dsbd_iterations"] == hist.count > 0
    assert m["vllm:spec_decode_num_draft_tokens"] == m["vllm:dsbd_draft_nodes"] > m["vllm:spec_decode_num_drafts"]
    per_pos = m["per_pos"].values
    assert len(per_pos) == DEPTH, per_pos  # vLLM made WIDTH * DEPTH positions, all beyond DEPTH always 0
    cumulative = {float(le): n for le, n in hist.buckets.items()}
    passed_more_than = [hist.count - cumulative[float(p)] for p in range(DEPTH)]
    print("accepted per position:", per_pos, "iterations passing depth p+1:", passed_more_than)
    assert per_pos == passed_more_than
    assert per_pos[0] > 0
