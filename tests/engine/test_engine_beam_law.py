"""Beam sampling inside the DSBD engine (γ = 0), temperature 1: the law of the beam set is exactly target beam sampling.

A beam request (``extra_args["dsbd_beam"]``, width 2, 2 steps, top-k 4 on the joint, EOS ignored) on the tiny random
Llama of ``test_engine_greedy.py``, 10,000 requests with seeds 0..9999 (each request's randomness is keyed by its
seed). Outcome of a request = the set of its 2 final beams. Oracle: ``beam_oracle.beam_sampling_law``, the exact law
by enumeration from the definition (plain Python floats over the Hugging Face model's next-token probabilities; no
code shared with ``vllm_dsbd.core``). Goodness of fit at the threshold p = 1e-6 (10,000 requests: minimum detectable
effect TV 0.047, asserted <= 0.05).

Power: the same requests on the same engine with the beam step replaced (in the test) by the naive rule that lets
each live beam draw its own child (W independent per-beam draws instead of W draws without replacement from the
joint) must be rejected by the same test, on the first 2,000 requests (chi2 351 against 67).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine_utils import beam_sets, dsbd_llm, tiny_pair  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from beam_oracle import beam_sampling_law, hf_next_probs  # noqa: E402
from chisq import goodness_of_fit, mde_tv, report  # noqa: E402
from vllm_dsbd.core import rng  # noqa: E402
from vllm_dsbd.core.sampling import BeamStep  # noqa: E402
from vllm_dsbd.engine.beams import sampling as beam_sampling_mod  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8]
WIDTH, STEPS, TOP_K, N = 2, 2, 4, 10_000
N_PLANTED = 2000  # the planted rule is gross: seen at 2,000 (chi2 351 against 67)


def _params(seed):
    beam = {"width": WIDTH, "max_tokens": STEPS, "ignore_eos": True}
    return vllm.SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_tokens=STEPS * (WIDTH + 1) + 2,
                               ignore_eos=True, detokenize=False, extra_args={"dsbd_beam": beam})


def _outcomes(llm, n=N) -> Counter:
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * n, [_params(s) for s in range(n)], use_tqdm=False)
    return beam_sets(outs)


def _per_beam_step(logits, scores, live, params, position, stream):
    """Planted wrong rule for the target's beam steps (the draft's are left alone): a request with one live beam
    draws W pairs without replacement from it; with several, each live beam draws one child of its own, among its
    pairs in the joint's top-k (the naive "sample per beam" rule)."""
    real = _REAL_STEP(logits, scores, live, params, position, stream)
    if stream != rng.Stream.TARGET_DRAW:
        return real
    R, S, V = logits.shape
    joint = real.joint.view(R, S, V)
    # rows with several live beams, each with a pair in the joint's top-k (else the real step, so that the planted
    # rule has the same outcomes, only another law)
    per_beam = (live.sum(1) > 1) & (torch.isfinite(joint).any(-1) | ~live).all(1)
    g = rng.gumbel(rng.request_key(params.seed, position, stream), S * V).view(R, S, V)
    tok = torch.argmax(joint + g, dim=-1)  # [R, S]
    score = joint.gather(2, tok[:, :, None]).squeeze(2)
    C = max(S, real.parent.shape[1])
    pad = lambda t, fill: torch.nn.functional.pad(t, (0, C - t.shape[1]), value=fill)  # noqa: E731
    pick = lambda a, b, fill: torch.where(per_beam[:, None], pad(a, fill), pad(b, fill))  # noqa: E731
    return BeamStep(parent=pick(torch.arange(S)[None].expand(R, S), real.parent, 0), token=pick(tok, real.token, 0),
                    score=pick(score, real.score, float("-inf")),
                    valid=pick(live & torch.isfinite(score), real.valid, False), joint=real.joint,
                    eos_done=real.eos_done, eos_score=real.eos_score)


_REAL_STEP = beam_sampling_mod.beam_step


@pytest.fixture(scope="module")
def runs():
    target, draft = tiny_pair()
    with dsbd_llm(target, max_num_seqs=256, max_num_batched_tokens=2048, disable_log_stats=True,  # vLLM's default
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": 3,
                                      "width": 4}) as llm:
        exact = _outcomes(llm)
        beam_sampling_mod.beam_step = _per_beam_step
        try:
            planted = _outcomes(llm, N_PLANTED)
        finally:
            beam_sampling_mod.beam_step = _REAL_STEP
    law = beam_sampling_law(hf_next_probs(target), PROMPT, width=WIDTH, max_new_tokens=STEPS, temperature=1.0, top_k=TOP_K)
    return exact, planted, law


def test_beam_set_law_is_target_beam_sampling(runs):
    exact, _, law = runs
    assert sum(exact.values()) == N
    assert len(exact) > 10  # many distinct beam sets: the test has something to compare
    stat, df, thr = goodness_of_fit(exact, law, N)
    print(report("in-engine beam sampling W=2, 2 steps, top-k 4", stat, df, thr, n=N))
    assert stat < thr
    assert mde_tv(N, df) <= 0.05


def test_planted_per_beam_rule_is_rejected(runs):
    _, planted, law = runs
    stat, df, thr = goodness_of_fit(planted, law, N_PLANTED)
    print(report("planted per-beam draws", stat, df, thr, n=N_PLANTED))
    assert stat > thr
