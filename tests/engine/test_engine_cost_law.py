"""With the cost model on, a plain request's law is still plain vLLM's (docs/design.md §3.6, "Exactness").

The cost model chooses each request's depth and nodes per depth from its earlier forests' results and the batch, never
from a draw of the step: a forest's shape is fixed before its coins are drawn, so every shape gives the target's law.
Real vLLM 0.26.0 on CPU, temperature 0.6, the peaky tiny Llama pair (the draft: the target's first 3 of 4 layers), a
DSBD engine of width 2 and depth 2 with a pinned table whose passes cost by tokens (target 10 ms + 0.2 ms a token,
draft 2 ms + 0.1 ms a token) and 8 requests a step: at the prior's 0.6 a request drafts depth 1, after a passed layer
(0.73) depth 2, after a failed one (0.4) depth 1, and below 0.3 nothing; the width goes from 1 up. Test: the law of
the first 4 tokens over 800 seeded requests against plain vLLM's, two-sample chi-square (threshold df + 10 sqrt(2 df),
``chisq.py``), with at least two depths above 0 in the engine's depth histogram and forests accepted; and the same
requests with the residual dropped from the engine's verification (``planted.py``, "dropped_residual": after a
rejection the target's law instead of the residual's) are rejected by the same statistic.
"""
from __future__ import annotations

from collections import Counter

import pytest

from engine_utils import dsbd_llm, metric, peaky_pair  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402

import chisq  # noqa: E402
import vllm_dsbd.core.verify as verify_mod  # noqa: E402
from planted import planted_verify_layer  # noqa: E402

pytestmark = pytest.mark.slow

WIDTH, DEPTH, TEMP = 2, 2, 0.6
N_LAW, LAW_TOKENS = 800, 4
PLANTED = "dropped_residual"
PROMPT = [(7 * i + 3) % 290 + 5 for i in range(24)]
TABLE = {"target_ms": {"1": 10, "1024": 10 + 0.2 * 1023}, "draft_ms": {"1": 2, "1024": 2 + 0.1 * 1023}}


def _sample(llm, seed0):
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N_LAW,
                        [vllm.SamplingParams(temperature=TEMP, max_tokens=LAW_TOKENS, ignore_eos=True,
                                             seed=None if seed0 is None else seed0 + i) for i in range(N_LAW)],
                        use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids) for o in outs)


@pytest.fixture(scope="module")
def plain():
    with dsbd_llm(peaky_pair()[0]) as llm:
        return _sample(llm, None)


@pytest.fixture(scope="module")
def dsbd(plain):  # after plain: one engine at a time
    target, draft = peaky_pair()
    out = {}
    with dsbd_llm(target, max_num_seqs=8, speculative_config={
            "method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH, "width": WIDTH,
            "cost_model": TABLE}) as llm:
        for name in ("exact", "planted"):
            real = verify_mod.verify_layer
            if name == "planted":
                verify_mod.verify_layer = planted_verify_layer(PLANTED)
            try:
                before = llm.collective_rpc("dsbd_load")[0]["depths"]
                accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens") or 0
                samples = _sample(llm, 70_000)
                after = llm.collective_rpc("dsbd_load")[0]["depths"]
            finally:
                verify_mod.verify_layer = real
            out[name] = {"samples": samples, "depths": {d: n - before.get(d, 0) for d, n in after.items()},
                         "accepted": (metric(llm, "vllm:spec_decode_num_accepted_tokens") or 0) - accepted}
    return out


def test_law_with_the_cost_model_equals_plain_vllm_and_a_planted_rule_is_rejected(dsbd, plain):
    exact, bad = dsbd["exact"], dsbd["planted"]
    print(f"depths chosen {exact['depths']}, accepted draft tokens {exact['accepted']:.0f}")
    drafted = {d for d, n in exact["depths"].items() if d > 0 and n > 0}
    assert len(drafted) >= 2, exact["depths"]  # the cost model chose different depths
    assert exact["accepted"] > 0 and bad["accepted"] > 0
    stat = chisq.two_sample(exact["samples"], plain)
    planted = chisq.two_sample(bad["samples"], plain)
    chisq.report_power(f"first {LAW_TOKENS} tokens, DSBD W={WIDTH} with the cost model vs plain vLLM, T={TEMP}", stat,
                       planted, PLANTED)
    assert stat[1] >= 3 and stat[0] < stat[2]
    assert planted[0] > planted[2], "the test cannot tell a dropped residual from the exact rule"
