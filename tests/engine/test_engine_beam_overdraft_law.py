"""Beam sampling (temperature 1) with over-drafted forests inside the engine: N = 3 draft nodes per depth for W = 2
beams, and the law of the beam set is still exactly target beam sampling of width 2.

``test_engine_beam_forest_law.py`` with the engine's ``beam_nodes`` = 3 (every request's N) and one more step: a beam
request (width 2, 4 steps, draft depth pinned to 2, top-k 3 on the joint, EOS ignored) on the tiny random Llama pair
(the draft = the target's first 2 of 3 layers, its logits sharpened x 3), 2,000 requests with seeds 0..1999. After
the prompt's step the target pass verifies a forest of 2 depths, each 3 draws without replacement from the draft's
joint (depth 2 drawn from all 3 depth-1 nodes), by recursive rejection sampling without replacement over the 3 drafts
(``core.verify_layer``'s rule as beam requests run it, every layer in one call: ``beam_sampling.verify_forests``):
layer 1 emits 2 pairs; when both are drafts the third depth-1 node is a dead slot, and layer 2 verifies 3 drafts, some
of which may hang from it (rejected: the target has no mass there); then the bonus layer. Outcome = the set of the 2
final beams. Oracle: ``beam_oracle.beam_sampling_law`` (exact, by enumeration over the Hugging Face model).

The counters must show 3 draft nodes per depth (N > W) and layers passed. Power: the with-replacement acceptance rule
planted into the verification (``planted.py``) must be rejected by the same test (chi2 451 against 91.5). Threshold at
p = 1e-6; 2,000 requests: minimum detectable effect TV 0.11.
"""
from __future__ import annotations

from collections import Counter

import pytest

from engine_utils import (  # the CPU engine environment first
    beam_counters, beam_sets, dsbd_llm, runner_of, sharpened, tiny_pair)
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from beam_oracle import beam_sampling_law, hf_next_probs  # noqa: E402
from chisq import goodness_of_fit, report  # noqa: E402
from planted import planted_beam_layer  # noqa: E402
from vllm_dsbd.engine import proposing as proposing_mod  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8]
WIDTH, NODES, STEPS, DEPTH, TOP_K, N = 2, 3, 4, 2, 3, 2000
SHARPEN = 3.0  # the draft's logits are the truncated target's x 3, as in test_engine_beam_forest_law.py


def _params(seed):
    beam = {"width": WIDTH, "max_tokens": STEPS, "ignore_eos": True, "depth": DEPTH}
    return vllm.SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_tokens=STEPS * (WIDTH + 1) + 2,
                               ignore_eos=True, detokenize=False, extra_args={"dsbd_beam": beam})


def _recording(real, sizes: Counter):
    """``drafter.propose_beam_forests`` as the runner calls it, counting the nodes of every drafted forest depth."""
    def propose(drafter, jobs):
        yield from real(drafter, jobs)
        for job in jobs:
            if (f := job.state.beam.forest) is not None:
                sizes.update(Counter(f.layers).values())
    return propose


def _run(llm) -> tuple[Counter, dict]:
    before = beam_counters(llm)
    sizes, real = Counter(), proposing_mod.propose_beam_forests
    proposing_mod.propose_beam_forests = _recording(real, sizes)
    try:
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, [_params(s) for s in range(N)], use_tqdm=False)
    finally:
        proposing_mod.propose_beam_forests = real
    after = beam_counters(llm)
    sets = beam_sets(outs)
    return sets, {**{k: after[k] - before[k] for k in after}, "depth_sizes": sizes}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    target, draft = tiny_pair()
    draft = sharpened(draft, tmp_path_factory.mktemp("draft") / "sharp", SHARPEN)
    with dsbd_llm(target, max_num_seqs=256, max_num_batched_tokens=4096,
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                      "width": WIDTH, "beam_nodes": NODES}) as llm:
        runner_of(llm).dsbd_static_layers = True  # every verified layer of a step in one call, as on a device
        exact = _run(llm)
        with planted_beam_layer("with_replacement"):
            planted = _run(llm)
    law = beam_sampling_law(hf_next_probs(target), PROMPT, width=WIDTH, max_new_tokens=STEPS, temperature=1.0,
                            top_k=TOP_K)
    return exact, planted, law


def test_over_drafted_forest_path_ran(runs):
    (_, c), _, _ = runs
    print("counters:", c)
    assert c["beam_steps"] == N * STEPS
    # every drafted depth of every forest had N = 3 nodes (more drafts than beams); at least one forest per request
    assert set(c["depth_sizes"]) == {NODES} and c["depth_sizes"][NODES] >= N * DEPTH
    assert c["beam_draft_nodes"] == NODES * c["depth_sizes"][NODES]
    assert c["beam_layers_passed"] > 0 and c["beam_steps"] == c["beam_target_passes"] + c["beam_layers_passed"]
    # fixed width: every verified layer that had drafts emitted W pairs (never N)
    assert c["drafted_layers"] > 0 and c["width_sum"] == WIDTH * c["drafted_layers"]


def test_beam_set_law_with_over_drafted_forests_is_target_beam_sampling(runs):
    (exact, _), _, law = runs
    assert sum(exact.values()) == N and len(exact) > 10
    stat, df, thr = goodness_of_fit(exact, law, N)
    print(report(f"DSBD T=1, W={WIDTH}, N={NODES}, {STEPS} steps, depth {DEPTH}, top-k {TOP_K}", stat, df, thr, n=N))
    assert stat < thr


def test_planted_with_replacement_rule_is_rejected(runs):
    _, (planted, c), law = runs
    assert c["beam_layers_passed"] > 0
    stat, df, thr = goodness_of_fit(planted, law, N)
    print(report("planted with-replacement acceptance, N > W", stat, df, thr))
    assert stat > thr
