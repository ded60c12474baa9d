"""With the cost model on, beam sampling's law is still exactly target beam sampling (issue 39, item 2).

The cost model chooses each beam request's depth and nodes per depth from its earlier forests and the engine-wide
rates, before the step's coins are drawn, so every choice keeps the law (docs/design/cost-model.md §3.6). A beam
request (``extra_args["dsbd_beam"]``: width 2, 4 steps, top-k 3 on the joint, no depth: the cost model's) on the tiny
random Llama pair of ``test_engine_beam_forest_law.py`` (the draft: the target's first 2 of 3 layers, logits x 3),
engine depth 2, a pinned flat table (target passes 10 ms, draft passes 1 ms: depth 1 pays above a rate of 0.1,
depth 2 above ~0.36), so that requests draft different depths by what their earlier forests passed (a new request
starts from the engine-wide rate of the forests before it, cost.PassRates; with draft passes of 4 ms that rate was
below what any forest needed and the engine drafted in 1,696 of 43,880 request-steps, too few to test the planted
rule). Outcome = the set of the 2 final beams; oracle: ``beam_oracle.beam_sampling_law`` (exact, by
enumeration over the Hugging Face model). Checked: at least two depths above 0 in the engine's depth histogram and
forest layers passed; the law against the oracle (``chisq.goodness_of_fit``, threshold at p = 1e-6); and the same
requests with the with-replacement acceptance rule planted into the verification (``planted.py``) rejected.
Measured (2 CPU cores, loaded, 2026-11-27, branch beamcost, 11,000 requests): depths 1 / 2 chosen in 261 / 40,344
request-steps, 3,395 layers passed; chi2 41.9 against 94.6 (df 38, MDE TV 0.049); planted at 2,000 requests 217.1
against 91.5. Before new requests started from the engine-wide rate (4 ms draft passes, the prior's 0.6 for every
new request): depths 0 / 1 / 2 in 12,966 / 13,222 / 13,301 request-steps at 10,500 requests, chi2 27.7.
"""
from __future__ import annotations

from collections import Counter

import pytest

from engine_utils import (  # the CPU engine environment first
    beam_counters, beam_sets, dsbd_llm, runner_of, sharpened, tiny_pair)
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from beam_oracle import beam_sampling_law, hf_next_probs  # noqa: E402
from chisq import goodness_of_fit, mde_tv, report  # noqa: E402
from planted import planted_beam_layer  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8]
WIDTH, STEPS, DEPTH, TOP_K, N, N_PLANTED = 2, 4, 2, 3, 11000, 2000
SHARPEN = 3.0
TABLE = {"target_ms": {"1": 10, "1024": 10}, "draft_ms": {"1": 1, "1024": 1}}


def _params(seed):
    beam = {"width": WIDTH, "max_tokens": STEPS, "ignore_eos": True}  # no depth: the cost model's choice
    return vllm.SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_tokens=STEPS * (WIDTH + 1) + 2,
                               ignore_eos=True, detokenize=False, extra_args={"dsbd_beam": beam})


def _run(llm, n) -> tuple[Counter, dict, dict]:
    before, d0 = beam_counters(llm), llm.collective_rpc("dsbd_load")[0]["depths"]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * n, [_params(s) for s in range(n)], use_tqdm=False)
    after, d1 = beam_counters(llm), llm.collective_rpc("dsbd_load")[0]["depths"]
    sets = beam_sets(outs)
    return sets, {k: after[k] - before[k] for k in after}, {d: m - d0.get(d, 0) for d, m in d1.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    target, draft = tiny_pair()
    draft = sharpened(draft, tmp_path_factory.mktemp("draft") / "sharp", SHARPEN)
    with dsbd_llm(target, max_num_seqs=256, max_num_batched_tokens=2048,
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                      "width": WIDTH, "cost_model": TABLE}) as llm:
        runner_of(llm).dsbd_static_layers = True  # every verified layer of a step in one call, as on a device
        exact = _run(llm, N)
        with planted_beam_layer("with_replacement"):
            planted = _run(llm, N_PLANTED)
    law = beam_sampling_law(hf_next_probs(target), PROMPT, width=WIDTH, max_new_tokens=STEPS, temperature=1.0,
                            top_k=TOP_K)
    return exact, planted, law


def test_the_cost_model_chose_several_depths_and_forests_passed(runs):
    (_, c, depths), _, _ = runs
    print("counters:", c, "depths chosen:", depths)
    assert c["beam_steps"] == N * STEPS
    assert c["beam_draft_nodes"] > 0 and c["beam_layers_passed"] > 0
    assert len({d for d, m in depths.items() if d > 0 and m > 0}) >= 2, depths


def test_beam_sampling_law_with_the_cost_model_is_target_beam_sampling(runs):
    (exact, _, _), _, law = runs
    assert sum(exact.values()) == N
    stat, df, thr = goodness_of_fit(exact, law, N)
    print(report(f"DSBD beam sampling, cost model on, W={WIDTH}, {STEPS} steps, top-k {TOP_K}", stat, df, thr, n=N))
    assert stat < thr
    assert mde_tv(N, df) <= 0.05


def test_planted_with_replacement_rule_is_rejected(runs):
    _, (planted, c, _), law = runs
    assert c["beam_layers_passed"] > 0  # the planted rule ran on forests
    stat, df, thr = goodness_of_fit(planted, law, N_PLANTED)
    print(report("planted with-replacement acceptance, cost model on", stat, df, thr, n=N_PLANTED))
    assert stat > thr
