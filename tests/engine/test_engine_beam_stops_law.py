"""Beam sampling (temperature 1) with stop token ids inside the DSBD engine, with draft forests: the law of the
returned beams is exactly that of target beam sampling where a drawn pair ending in a stop id finishes its beam.

A beam request (``extra_args["dsbd_beam"]``: width 2, 3 steps, draft depth 2, top-k 3 on the joint, EOS ignored,
``stop_token_ids`` one token the beams draw often at their second step: the greedy second token) on the tiny random
Llama pair of ``test_engine_beam_forest_law.py`` (the draft = the target's first 2 of 3 layers, its logits sharpened
x 3), ``N`` requests with seeds 0..N-1. A request with stops verifies its forests layer
by layer on the host (``step.step_beams``): whether a layer passes depends on which drawn pairs finish a beam; the
engine runs with the device's one-read static verification on, which such a request must leave (with it, the same
requests raised "layer 1 of a static verification passed on the host, not on the device").
Outcome = the set of the 2 returned beams. Oracle: ``beam_oracle.beam_sampling_law`` with the stop ids finishing as
EOS does (the exact law of all final candidates, by enumeration over the Hugging Face model; no code shared with
``vllm_dsbd.core``), then ``returned_law``: the 2 best of each outcome by vLLM's length-normalised score (a stop id
counts one token less), as ``BeamRequest.best`` returns them. Threshold p = 1e-6.

Checked: the fit (and its minimum detectable effect TV <= 0.05); beams did stop on the ids (returned beams ending in
a stop id make up a good part of the outcomes); the forest path ran (forest nodes verified, layers passed).
Power: the same requests with the stop check left out of the forest layers' verification (``step._take`` without the
request's ``StopRule``: the bug of a path that knows only EOS) must be rejected by the same test on 1,000 requests.
"""
from __future__ import annotations

import pytest

from engine_utils import (  # the CPU engine environment first
    beam_counters, beam_sets, dsbd_llm, greedy_tokens, runner_of, sharpened, tiny_pair)
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from beam_oracle import beam_sampling_law, hf_next_probs, returned_law  # noqa: E402
from chisq import goodness_of_fit, mde_tv, report  # noqa: E402
from vllm_dsbd.engine.beams import step as step_mod  # noqa: E402
from vllm_dsbd.testing.models import load_hf, next_token_logits_fn  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8]
WIDTH, STEPS, DEPTH, TOP_K, N = 2, 3, 2, 3, 8000
N_PLANTED = 1000
SHARPEN = 3.0


def _params(seed, stops):
    beam = {"width": WIDTH, "max_tokens": STEPS, "ignore_eos": True, "depth": DEPTH, "stop_token_ids": stops}
    return vllm.SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_tokens=STEPS * (WIDTH + 1) + 2,
                               ignore_eos=True, detokenize=False, extra_args={"dsbd_beam": beam})


def _run(llm, stops, n):
    before = beam_counters(llm)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * n, [_params(s, stops) for s in range(n)], use_tqdm=False)
    after = beam_counters(llm)
    return beam_sets(outs), {k: after[k] - before[k] for k in after}


def _planted_take(real):
    def take(st, pairs, k, rows=True):
        saved, st.beam.stops = st.beam.stops, None
        try:
            return real(st, pairs, k, rows)
        finally:
            st.beam.stops = saved
    return take


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    target, draft = tiny_pair()
    draft = sharpened(draft, tmp_path_factory.mktemp("draft") / "sharp", SHARPEN)
    probs = hf_next_probs(target)
    stops = greedy_tokens(next_token_logits_fn(load_hf(target)), PROMPT, 2)[1:]
    with dsbd_llm(target, max_num_seqs=256, max_num_batched_tokens=2048,
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                      "width": WIDTH}) as llm:
        # the device's path (every layer of a step in one read), which a request with stops must leave for the
        # host's layer-by-layer check (``step.step_beams``; on it a drawn stop id would end the step on the host
        # where the device's check passed the layer)
        runner_of(llm).dsbd_static_layers = True
        exact = _run(llm, stops, N)
        real = step_mod._take
        step_mod._take = _planted_take(real)
        try:
            planted = _run(llm, stops, N_PLANTED)
        finally:
            step_mod._take = real
    law = beam_sampling_law(probs, PROMPT, width=WIDTH, max_new_tokens=STEPS, temperature=1.0, top_k=TOP_K,
                            stop_ids=stops)
    return exact, planted, returned_law(law, probs, PROMPT, WIDTH, ends=stops), stops


def test_forest_path_ran_and_beams_stopped(runs):
    (sets, c), _, _, stops = runs
    print("counters:", c, "stop ids:", stops)
    assert c["beam_draft_nodes"] > 0 and c["beam_layers_passed"] > 0
    stopped = sum(n for s, n in sets.items() if any(b and b[-1] in stops for b in s))
    assert stopped > N // 10, stopped


def test_beam_set_law_with_stops_is_target_beam_sampling(runs):
    (sets, _), _, law, _ = runs
    assert sum(sets.values()) == N and len(sets) > 5
    stat, df, thr = goodness_of_fit(sets, law, N)
    print(report(f"beam sampling with stop ids, W={WIDTH}, {STEPS} steps, depth {DEPTH}, top-k {TOP_K}", stat, df,
                 thr, n=N))
    assert stat < thr
    assert mde_tv(N, df) <= 0.05


def test_planted_stops_ignored_on_forest_layers_is_rejected(runs):
    _, (sets, c), law, _ = runs
    assert c["beam_layers_passed"] > 0
    stat, df, thr = goodness_of_fit(sets, law, N_PLANTED)
    print(report("planted: forest layers without the stop check", stat, df, thr, n=N_PLANTED))
    assert stat > thr
