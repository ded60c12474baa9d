"""With the cost model on, a plain request's law is still plain vLLM's (docs/design/cost-model.md §3.6, "Exactness").

The cost model chooses each request's depth and nodes per depth from its earlier forests' results and the batch,
never from a draw of the step: a forest's shape is fixed before its coins are drawn, so every shape gives the
target's law. Real vLLM 0.26.0 on CPU, temperature 0.6, the peaky tiny Llama target, a DSBD engine of width 2 and
depth 2 whose draft is the target with its logits x 3 (peakier than the target, so a wrong rule shows), with a pinned
flat table (target passes 10 ms, draft passes 4 ms) and one request a step: at the prior's 0.6 a request drafts depth
1, after a passed layer (0.73) depth 2, after a failed one (0.4) nothing; the width goes from 1 up (flat passes: the
wider on ties). Test: the laws of the first 2, 3 and 4 tokens over 1,600 seeded requests against plain vLLM's,
two-sample chi-square (``chisq.py``: the thresholds at p = 1e-6), with at least two depths above 0 in the engine's
depth histogram and forests accepted; and the same requests with the residual dropped from the engine's verification
(``planted.py``, "dropped_residual": after a rejection the target's law instead of the residual's; planted in every
core a plain forest can take, the width-1 chains' too) are rejected by the law of the first 2 tokens, where every
request's first forest decides. Measured (2 CPU cores, 2026-11-27): depths chosen 0 / 1 / 2 in 558 / 1600 / 2921
request-steps; exact rule chi2 25.4 / 96.1 (2 tokens), 59.9 / 115.5 (3), 54.5 / 122.8 (4); planted 143.0 / 91.5 (2
tokens), 132.2 / 117.0 (3), 115.1 / 125.7 (4: later tokens spread the sample over more bins); MDE TV 0.181 (2
tokens). At 800 requests the planted rule was not seen (2 tokens: 88.1 against the old threshold df + 10 sqrt(2 df),
90.8).
"""
from __future__ import annotations

from collections import Counter

import pytest

from engine_utils import dsbd_llm, metric, peaky_pair, sharpened  # sets the CPU engine environment before vllm
import vllm  # noqa: E402

import chisq  # noqa: E402
import vllm_dsbd.core.chain as chain_mod  # noqa: E402
import vllm_dsbd.core.verify as verify_mod  # noqa: E402
import vllm_dsbd.core.verify_static as static_mod  # noqa: E402
import vllm_dsbd.engine.sampler as sampler_mod  # noqa: E402
from planted import planted_chain, planted_verify_layer  # noqa: E402

pytestmark = pytest.mark.slow

WIDTH, DEPTH, TEMP = 2, 2, 0.6
N_LAW, LAW_TOKENS = 1600, 4
PLANTED_TOKENS = 2  # the planted rule is looked for in the law of the first 2 tokens (every request's first forest)
PLANTED = "dropped_residual"
COLD = 3.0  # the draft: the target with its logits x 3 (peakier than the target: a wrong rule shows)
PROMPT = [(7 * i + 3) % 290 + 5 for i in range(24)]
TABLE = {"target_ms": {"1": 10, "1024": 10}, "draft_ms": {"1": 4, "1024": 4}}


def _sample(llm, seed0):
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N_LAW,
                        [vllm.SamplingParams(temperature=TEMP, max_tokens=LAW_TOKENS, ignore_eos=True,
                                             seed=None if seed0 is None else seed0 + i) for i in range(N_LAW)],
                        use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids) for o in outs)


def _planted():
    """(module, attribute, planted function) of every verification core a plain request's forest can take."""
    return [(verify_mod, "verify_layer", planted_verify_layer(PLANTED)),
            (static_mod, "verify_layer_static", planted_verify_layer(PLANTED, static=True)),
            (chain_mod, "_layer", planted_chain(PLANTED)),
            (sampler_mod, "verify_chains_static", planted_chain(PLANTED, static=True))]


@pytest.fixture(scope="module")
def plain():
    with dsbd_llm(peaky_pair()[0]) as llm:
        return _sample(llm, None)


@pytest.fixture(scope="module")
def dsbd(plain, tmp_path_factory):  # after plain: one engine at a time
    monkeypatch = pytest.MonkeyPatch()
    target, _ = peaky_pair()
    draft = sharpened(target, tmp_path_factory.mktemp("cold") / "draft", COLD)
    out = {}
    with dsbd_llm(target, max_num_seqs=1, speculative_config={
            "method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH, "width": WIDTH,
            "cost_model": TABLE}) as llm:
        for name in ("exact", "planted"):
            if name == "planted":  # every verification path a plain request's forest can take (fused kernel aside)
                for mod, attr, fn in _planted():
                    monkeypatch.setattr(mod, attr, fn)
            try:
                before = llm.collective_rpc("dsbd_load")[0]["depths"]
                accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens") or 0
                samples = _sample(llm, 70_000)
                after = llm.collective_rpc("dsbd_load")[0]["depths"]
            finally:
                monkeypatch.undo()
            out[name] = {"samples": samples, "depths": {d: n - before.get(d, 0) for d, n in after.items()},
                         "accepted": (metric(llm, "vllm:spec_decode_num_accepted_tokens") or 0) - accepted}
    return out


def test_law_with_the_cost_model_equals_plain_vllm_and_a_planted_rule_is_rejected(dsbd, plain):
    exact, bad = dsbd["exact"], dsbd["planted"]
    print(f"depths chosen {exact['depths']}, accepted draft tokens {exact['accepted']:.0f}")
    drafted = {d for d, n in exact["depths"].items() if d > 0 and n > 0}
    assert len(drafted) >= 2, exact["depths"]  # the cost model chose different depths
    assert exact["accepted"] > 0 and bad["accepted"] > 0
    for k in range(PLANTED_TOKENS, LAW_TOKENS + 1):  # the law of the first k tokens; later ones follow varied shapes
        stat = chisq.two_sample(_prefix(exact["samples"], k), _prefix(plain, k))
        planted = chisq.two_sample(_prefix(bad["samples"], k), _prefix(plain, k))
        chisq.report_power(f"first {k} tokens, DSBD W={WIDTH} with the cost model vs plain vLLM, T={TEMP}", stat,
                           planted, PLANTED, n=N_LAW, two_sample=True)
        assert stat[1] >= 3 and stat[0] < stat[2]
        if k == PLANTED_TOKENS:
            assert planted[0] > planted[2], "the test cannot tell a dropped residual from the exact rule"
            assert chisq.mde_tv(N_LAW, stat[1], two_sample=True) <= 0.2  # the project's plain-law tests: 0.20-0.28


def _prefix(counts: Counter, k: int) -> Counter:
    out = Counter()
    for seq, c in counts.items():
        out[seq[:k]] += c
    return out
