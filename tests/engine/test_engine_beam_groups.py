"""Diverse beam search (``extra_args["dsbd_beam"]``: ``num_beam_groups``, ``diversity_penalty``) inside the DSBD engine,
real vLLM 0.26.0 on CPU, one engine: the tiny random Llama target with the tokenizer's EOS moved to the second greedy
token of the first prompt (so that beams finish at different lengths), width 4, draft depth 3, the target as its own
draft with 16 forest nodes per depth (the draft beam-searches without groups, so it covers the groups' beams only when
over-drafted; a truncated draft passed no layer here, plain beams or groups).

Oracle: ``group_beam.group_beam_search``, HF's group beam search written out in plain torch over the Hugging Face
target's log-softmax rows (no code shared with ``vllm_dsbd``). Checked, on 5 prompts, 8 tokens:

* with one group and no penalty the oracle gives the engine's plain beams (it is the engine's beam step);
* G = 2 and 4 groups at penalty 0.5 and 2: the engine's beams equal the oracle's (tokens, order, finish reasons,
  cumulative log-probabilities to 1e-4), and they are not plain beam search (the returned beams differ from the plain
  request's on some prompt for every case);
* forests were drafted and verified for these requests and layers passed (the engine's counters): the groups' beams
  were taken from forest logits in the same target pass, and still equal the oracle's;
* bad values (width not divisible by the groups, a negative penalty, a penalty with one group, groups at temperature
  > 0) raise a ValueError naming the parameter, and the engine serves a good request afterwards.
"""
from __future__ import annotations

import pytest

from engine_utils import (  # sets the CPU engine environment before vllm is imported
    LOGPROB_TOL, beam_counters, dsbd_llm, greedy_tokens, tiny_pair, with_eos)
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from group_beam import group_beam_search  # noqa: E402
from vllm_dsbd.patches.beam_search_route import finished_beams  # noqa: E402
from vllm_dsbd.requests import BeamParams  # noqa: E402
from vllm_dsbd.testing.models import load_hf, next_token_logits_fn  # noqa: E402

WIDTH, DEPTH, STEPS, NODES = 4, 3, 8, 16
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [7], [126, 129, 252], [83, 60, 71, 9]]
CASES = [(2, 0.5), (2, 2.0), (4, 0.5), (4, 2.0)]  # (num_beam_groups, diversity_penalty)
BAD = [({"num_beam_groups": 3}, "num_beam_groups"), ({"num_beam_groups": 2, "diversity_penalty": -0.5},
                                                      "diversity_penalty"),
       ({"diversity_penalty": 1.0}, "diversity_penalty")]


def _sp(eos, temperature=0.0, **kw):
    bp = {"width": WIDTH, "max_tokens": STEPS, "eos_token_id": eos, **kw}
    return vllm.SamplingParams(temperature=temperature, max_tokens=STEPS * (WIDTH + 1) + 2, extra_args={"dsbd_beam": bp})


def _beams(llm, eos, **kw):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _sp(eos, **kw), use_tqdm=False)
    return [[(list(b["token_ids"]), b["cum_logprob"], b["finish_reason"]) for b in finished_beams(o)] for o in outs]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    target, _ = tiny_pair()
    fn = next_token_logits_fn(load_hf(target))
    g0 = greedy_tokens(fn, PROMPTS[0], 8)
    eos = next(t for i, t in enumerate(g0) if i >= 1 and t not in g0[:i])  # the second greedy token
    folder = with_eos(target, tmp_path_factory.mktemp("groups") / "target", eos)
    spec = {"method": "dsbd", "model": str(folder), "num_speculative_tokens": DEPTH, "width": WIDTH,
            "beam_nodes": NODES}
    with dsbd_llm(folder, speculative_config=spec) as llm:
        plain = _beams(llm, eos)
        before = beam_counters(llm)
        got = {case: _beams(llm, eos, num_beam_groups=case[0], diversity_penalty=case[1]) for case in CASES}
        after = beam_counters(llm)
        errors = []
        for kw, _ in BAD:
            try:
                _beams(llm, eos, **kw)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        try:
            _beams(llm, eos, temperature=1.0, num_beam_groups=2, diversity_penalty=1.0)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
        again = _beams(llm, eos, num_beam_groups=2, diversity_penalty=0.5)
    ref = {case: [group_beam_search(fn, p, WIDTH, case[0], case[1], STEPS, ends=(eos,)) for p in PROMPTS]
           for case in [(1, 0.0), *CASES]}
    return {"plain": plain, "got": got, "ref": ref, "counters": {k: after[k] - before[k] for k in before},
            "errors": errors, "again": again}


def _same(got, want):
    assert [[(t, r) for t, _, r in p] for p in got] == [[(t, r) for t, _, r in p] for p in want]
    for gp, wp in zip(got, want):
        assert all(abs(a - b) < max(1e-4, LOGPROB_TOL) for (_, a, _), (_, b, _) in zip(gp, wp))


def test_reference_with_one_group_is_the_engines_plain_beam_search(run):
    _same(run["plain"], run["ref"][(1, 0.0)])
    assert any(r == "stop" for p in run["plain"] for _, _, r in p)  # beams finished on EOS


@pytest.mark.parametrize("case", CASES)
def test_groups_equal_the_reference(run, case):
    _same(run["got"][case], run["ref"][case])


@pytest.mark.parametrize("case", CASES)
def test_groups_are_not_plain_beam_search(run, case):
    sets = lambda beams: [sorted(tuple(t) for t, _, _ in p) for p in beams]  # noqa: E731
    assert sets(run["got"][case]) != sets(run["plain"])


def test_forests_were_drafted_for_groups(run):
    c = run["counters"]
    print("counters:", c)
    assert c["beam_draft_nodes"] > 0 and c["beam_layers_passed"] > 0


def test_bad_values_are_refused_naming_the_parameter(run):
    names = [name for _, name in BAD] + ["num_beam_groups"]
    for err, name in zip(run["errors"], names):
        assert err is not None and f"['{name}']" in err, (name, err)
    assert run["again"] == run["got"][(2, 0.5)]


def test_parse():
    bp = BeamParams.parse({"width": 4, "max_tokens": 2, "num_beam_groups": 2, "diversity_penalty": 1}, 4)
    assert (bp.num_beam_groups, bp.diversity_penalty) == (2, 1.0)
    assert BeamParams.parse(bp.to_dict(), 4) == bp
    with pytest.raises(ValueError, match=r"\['num_beam_groups'\]"):
        BeamParams.parse({"width": 4, "max_tokens": 2, "num_beam_groups": 8}, 4)
