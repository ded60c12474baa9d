"""Beam sampling inside the engine with two verified forest layers per target pass, EOS and width 3: the law of the
returned beams is exactly target beam sampling's.

``test_engine_beam_forest_law.py`` verifies depth-1 forests only (one drafted layer per pass). Here a beam request
(``extra_args["dsbd_beam"]``: width 3, 4 steps, draft depth 2, top-k 4 on the joint, EOS a token the target's joint
ranks in its top 4 now and then) on the tiny random Llama target, with the target's own weights at logits x 3 as the
draft, gets after the prompt's step a forest of depth 2 with 3 nodes per depth; one target pass verifies layer 1 and,
when it passes (its outputs that are not EOS are all depth-1 nodes), layer 2 on those nodes' logits rows, then the
bonus layer. So the multi-layer wiring (``beams.step._take``: the next layer's beams are the passed layer's drafts, a
draft that is not a new beam, e.g. one that ended on EOS, stays as a dead slot, the next layer's Q is the draft joint
over those slots) runs on every pass that passes a layer. Both verification paths run: the CPU default (one layer
per call, ``_take`` moving the rows) and the device's (``beam_sampling.verify_forests``, every layer in one call).

Outcome = the set of the 3 returned beams (tokens, EOS included when a beam ended on it). Oracle: the exact law of
every final candidate by enumeration (``beam_oracle.beam_sampling_law`` over the Hugging Face model), mapped to the 3
best by vLLM's length-normalised score, as the engine returns them. Not vacuous (asserted): some beams end on EOS, and
``vllm:dsbd_beam_pass_layers`` shows passes that passed two layers. Power: the with-replacement acceptance rule
planted into the layer beam requests run (``planted.py``) is rejected by the same test (chi2 271 against 90). Threshold
at p = 1e-6; 1,500 requests: minimum detectable effect TV 0.13 (a 10% bias in the residual or the acceptance ratio is
left to ``test_verify_layer.py``: at 8,500 requests this file's forests would take minutes).
"""
from __future__ import annotations

import functools
import math
from collections import Counter, defaultdict

import pytest

from engine_utils import (  # the CPU engine environment first
    beam_counters, beam_sets, dsbd_llm, metric, runner_of, sharpened, tiny_pair, with_eos)
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from beam_oracle import beam_sampling_law, hf_next_probs  # noqa: E402
from chisq import goodness_of_fit, report, report_power  # noqa: E402
from planted import planted_beam_layer  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8]
WIDTH, STEPS, DEPTH, TOP_K, N = 3, 4, 2, 4, 1500
# the target's EOS moved to token 74 (``with_eos``): one of the joint's top 4 now and then, so that about half of the
# law's mass has a returned beam that ended on EOS (0.53 by enumeration)
EOS = 74
SHARPEN = 3.0


def _params(seed):
    beam = {"width": WIDTH, "max_tokens": STEPS, "depth": DEPTH, "eos_token_id": EOS}
    return vllm.SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_tokens=STEPS * (WIDTH + 1) + 2,
                               ignore_eos=True, detokenize=False, extra_args={"dsbd_beam": beam})


def _counters(llm) -> dict:
    out = beam_counters(llm)
    hist = metric(llm, "vllm:dsbd_beam_pass_layers")
    out["forest_passes"] = int(hist.count) if hist is not None else 0
    # cumulative bucket counts: passes that passed at most one layer
    out["passes_le_1"] = int(hist.buckets.get("1.0", 0)) if hist is not None else 0
    return out


def _run(llm) -> tuple[Counter, dict]:
    before = _counters(llm)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, [_params(s) for s in range(N)], use_tqdm=False)
    after = _counters(llm)
    sets = beam_sets(outs)
    return sets, {k: after[k] - before[k] for k in after}


def returned_law(next_probs, law: dict) -> dict:
    """The oracle's law of every final candidate, mapped to the ``WIDTH`` best candidates by vLLM's beam-search score
    (cumulative raw log-probability / (prompt + generated tokens, minus a final EOS), length penalty 1), as a sorted
    tuple: what the engine returns. A near-tie at the cut raises (float32 could rank it either way)."""
    def cum(seq):
        return sum(math.log(next_probs(tuple(PROMPT) + seq[:i])[x]) for i, x in enumerate(seq))

    out = defaultdict(float)
    for cands, p in law.items():
        keyed = sorted(((cum(s) / (len(PROMPT) + len(s) - (1 if s[-1] == EOS else 0)), s) for s in cands),
                       reverse=True)
        if len(keyed) > WIDTH and keyed[WIDTH - 1][0] - keyed[WIDTH][0] < 1e-5:
            raise ValueError(f"near-tie at the cut of {cands}: choose another configuration")
        out[tuple(sorted(s for _, s in keyed[:WIDTH]))] += p
    return dict(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    target, _ = tiny_pair()
    tmp = tmp_path_factory.mktemp("beam_layers")
    folder = with_eos(target, tmp / "target", EOS)
    # the draft: the target itself, logits x SHARPEN (the tiny pair's 2-layer draft ranks the joint's top 4 too
    # differently from the target for all 3 drafts of a layer ever to be the target's 3 outputs: no layer passed)
    draft = sharpened(target, tmp / "sharp", SHARPEN)
    out = {}
    with dsbd_llm(folder, max_num_seqs=256, max_num_batched_tokens=2048,
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                      "width": WIDTH}) as llm:
        runner = runner_of(llm)
        for static in (False, True):  # the CPU default (one layer per call), then every layer in one call
            runner.dsbd_static_layers = static
            out["static" if static else "layered"] = _run(llm)
        runner.dsbd_static_layers = False
        with planted_beam_layer("with_replacement"):
            out["planted"] = _run(llm)
    probs = functools.cache(lambda ctx: hf_next_probs(target)(list(ctx)))
    law = beam_sampling_law(lambda ctx: probs(tuple(ctx)), PROMPT, width=WIDTH, max_new_tokens=STEPS,
                            temperature=1.0, top_k=TOP_K, eos=EOS)
    out["law"] = returned_law(probs, law)
    return out


@pytest.mark.parametrize("path", ["layered", "static"])
def test_two_layers_per_pass_ran(runs, path):
    _, c = runs[path]
    print(path, "counters:", c)
    assert c["beam_draft_nodes"] > 0 and c["beam_layers_passed"] > 0
    # passes that verified a forest and passed two layers (three beam steps in one target pass)
    assert c["forest_passes"] > 0 and c["forest_passes"] - c["passes_le_1"] > N // 20
    assert c["beam_steps"] <= c["beam_target_passes"] + c["beam_layers_passed"]


@pytest.mark.parametrize("path", ["layered", "static"])
def test_beam_law_with_two_layer_forests_and_eos(runs, path):
    sets, _ = runs[path]
    law = runs["law"]
    assert sum(sets.values()) == N
    # EOS mattered: returned beams that ended on it, in the sample and in the law
    eos_mass = sum(p for s, p in law.items() if any(b[-1] == EOS for b in s))
    eos_seen = sum(c for s, c in sets.items() if any(b[-1] == EOS for b in s))
    print(f"EOS in the returned beams: law {eos_mass:.3f}, sample {eos_seen / N:.3f}")
    assert 0.05 < eos_mass < 0.95 and eos_seen > 0
    stat, df, thr = goodness_of_fit(sets, law, N)
    report(f"beam sampling W={WIDTH}, {STEPS} steps, depth {DEPTH}, top-k {TOP_K}, EOS {EOS} [{path}]", stat, df, thr,
           n=N)
    assert df >= 5
    assert stat < thr


def test_planted_with_replacement_rule_is_rejected(runs):
    planted, c = runs["planted"]
    assert c["beam_layers_passed"] > 0 and c["forest_passes"] - c["passes_le_1"] > 0  # it ran on two-layer forests
    bad = goodness_of_fit(planted, runs["law"], N)
    exact = goodness_of_fit(runs["layered"][0], runs["law"], N)
    report_power("beam sampling, two-layer forests", exact, bad, "with_replacement", n=N)
    assert bad[0] > bad[2]
