"""DSBD through a real vLLM 0.26.0 engine on CPU, temperature 1, and its metrics.

Engine: width 4, depth 2, dynamic width on (the defaults' rule) with min_width 2, the opt-in single-output-beam mode
(``mode="single"``: layers keep up to W beams; plain requests in the default mode are tested in
``test_engine_law.py``). min_width 2 forces layers of width K >= 2, which the last test counts. Models: a tiny random
Llama target (4 layers, peaky next-token laws) and its first 3 layers as the draft (about half of the probability
mass in common), so layers pass and fail and accepted paths often go through a draw other than the first (the
commit then moves K/V).

* Seeded requests reproduce ``core.reference.dsbd_decode`` token for token (same seed, same keyed randomness; the
  prefill step is a depth-0 iteration), at widths 1 and 2 (``extra_args={"dsbd_width": w}``).
* The law of the first three tokens over many seeded requests equals the reference decoder's at widths 2 and 4 (two-
  sample chi-square against independent reference samples, threshold at p = 1e-6 (600 per sample: minimum detectable
  effect TV 0.28), bins with fewer than 10 samples merged); at width 4 the same test rejects the reference at
  temperature 1.5 (power).
* A seed repeats; the checks are not vacuous (drafts, accepted tokens, moved K/V slots, per-layer widths, layers of
  width K >= 2).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine_utils import dsbd_llm, metric, peaky_pair  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

import chisq  # noqa: E402
from vllm_dsbd.core import rng  # noqa: E402
from vllm_dsbd.core.reference import Settings, dsbd_decode, dsbd_decode_mixed  # noqa: E402
from vllm_dsbd.testing.models import load_hf, next_token_logits_fn  # noqa: E402

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh

WIDTH, DEPTH, MIN_WIDTH = 4, 2, 2
PROMPT = [5, 6, 7]
N_LAW, LAW_TOKENS = 600, 3
SEEDS = range(100, 106)


@pytest.fixture(scope="module")
def hf_fns():
    target, draft = peaky_pair()
    return next_token_logits_fn(load_hf(target)), next_token_logits_fn(load_hf(draft))


@pytest.fixture(scope="module")
def llm():
    target, draft = peaky_pair()
    with dsbd_llm(target, max_model_len=128,
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                      "width": WIDTH, "mode": "single", "min_width": MIN_WIDTH}) as engine:
        yield engine


def _reference(target_fn, draft_fn, prompt, width, n, seed):
    kw = dict(width=width, depth=DEPTH, temperature=1.0, mode="single", seed=seed, dynamic_width=True,
              min_width=min(MIN_WIDTH, width))
    first = dsbd_decode(target_fn, draft_fn, prompt, max_new_tokens=1, **kw).beams[0][0]
    rest = dsbd_decode(target_fn, draft_fn, prompt + first, max_new_tokens=n - 1, **kw).beams[0][0]
    return first + rest


@pytest.mark.parametrize("width", [1, 2])
def test_seeded_requests_equal_reference(llm, hf_fns, width):
    n = 12
    prompts = [PROMPT, [40, 41, 42, 43, 44]]
    reqs = [(p, s) for p in prompts for s in SEEDS]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                        [vllm.SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=s,
                                             extra_args={"dsbd_width": width}) for _, s in reqs])
    target_fn, draft_fn = hf_fns
    with torch.no_grad():
        for (p, s), o in zip(reqs, outs):
            assert list(o.outputs[0].token_ids) == _reference(target_fn, draft_fn, p, width, n, s), (p, s)


def test_seed_repeats(llm):
    sp = vllm.SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=7)
    a, b = llm.generate([{"prompt_token_ids": PROMPT}] * 2, [sp, sp])
    c = llm.generate([{"prompt_token_ids": PROMPT}], sp)[0]
    assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids) == list(c.outputs[0].token_ids)


def _reference_law(target_fn, draft_fn, n, seed, temperature=1.0, width=WIDTH):
    """n independent reference samples of the first LAW_TOKENS tokens, batched (lock-step) for speed."""
    kw = dict(width=width, depth=DEPTH, temperature=temperature, single=True, dynamic=True,
              min_width=min(MIN_WIDTH, width))
    seeds = [rng.derive_seed(seed, i) for i in range(n)]
    firsts = dsbd_decode_mixed(target_fn, draft_fn, [PROMPT] * n, [Settings(max_new_tokens=1, **kw)] * n, seeds)
    firsts = [f.beams[0][0] for f in firsts]
    rests = dsbd_decode_mixed(target_fn, draft_fn, [PROMPT + f for f in firsts],
                              [Settings(max_new_tokens=LAW_TOKENS - 1, **kw)] * n, seeds)
    return [tuple(f + r.beams[0][0]) for f, r in zip(firsts, rests)]


@pytest.mark.slow
@pytest.mark.parametrize("width", [2, 4])
def test_law_of_first_tokens_equals_reference(llm, hf_fns, width):
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N_LAW,
                        [vllm.SamplingParams(temperature=1.0, max_tokens=LAW_TOKENS, ignore_eos=True, seed=10_000 + i,
                                             extra_args={"dsbd_width": width}) for i in range(N_LAW)])
    engine = Counter(tuple(o.outputs[0].token_ids) for o in outs)
    target_fn, draft_fn = hf_fns
    with torch.no_grad():
        ref = Counter(_reference_law(target_fn, draft_fn, N_LAW, seed=12345, width=width))
    stat, df, thr = chisq.two_sample(engine, ref)
    chisq.report(f"first {LAW_TOKENS} tokens, W={width}, engine vs reference", stat, df, thr, n=N_LAW,
                 two_sample=True)
    assert df >= 3, "the law test has too few bins to mean anything"
    assert stat < thr
    if width != WIDTH:
        return
    # power: the same test, sample size and threshold see a modest change of law (temperature 1 -> 1.5)
    with torch.no_grad():
        other = Counter(_reference_law(target_fn, draft_fn, N_LAW, seed=777, temperature=1.5, width=width))
    stat1, df1, thr1 = chisq.two_sample(engine, other)
    chisq.report(f"first {LAW_TOKENS} tokens, engine T=1 vs reference T=1.5 (must differ)", stat1, df1, thr1)
    assert stat1 > thr1


def test_not_vacuous(llm):
    # runs last in this module: the counters include every request above
    assert metric(llm, "vllm:spec_decode_num_drafts") > 0
    assert metric(llm, "vllm:spec_decode_num_accepted_tokens") > 0
    assert metric(llm, "vllm:dsbd_iterations") > 0
    assert metric(llm, "vllm:dsbd_kv_commit_slots") > 0, "no accepted path ever needed moving: commit untested"
    widths = [m for m in llm.get_metrics() if m.name == "vllm:dsbd_layer_width"]
    assert widths and any(m.count > 0 for m in widths)
    assert {m.labels.get("layer") for m in widths} <= {str(d) for d in range(1, DEPTH + 1)}
    # every verified layer has K >= 1; a mean above 1 means layers of width K >= 2 were verified
    assert sum(m.sum for m in widths) > sum(m.count for m in widths)
