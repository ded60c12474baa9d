"""``length_penalty`` on the in-engine beam routes, against vLLM's own beam-search loop, real vLLM 0.26.0 on CPU.

Tiny random Llama pair of ``test_engine_beams.py`` with the tokenizer's EOS moved to the second greedy token of the
first prompt (so beams finish on EOS at different lengths; with equal lengths a length penalty cannot change a
ranking). Oracle: vLLM's ``LLM.beam_search`` loop on a plain engine with the same float32 weights, at
length_penalty 0.5, 1 and 2. vLLM's loop ranks each step's candidates by ``get_beam_search_score``, which at one step
(all candidates of one length) orders them as the cumulative log-probability does, and sorts the finished and last
beams by it at the end: so the penalty decides which finished beams are returned and in which order. Checked:

* the penalty matters here (not vacuous): at 0.5 and at 2 vLLM's best beam differs from its best at 1 on some
  prompt;
* ``LLM.beam_search`` on a DSBD engine with forests (width 4, depth 3) returns vLLM's sequences, in order, at 0.5 and
  2 (tokens equal, cumulative log-probabilities to 1e-4);
* ``extra_args["dsbd_beam"]`` with ``length_penalty`` returns the same beams (the OpenAI ``use_beam_search`` route
  sends the request's ``length_penalty`` the same way: ``test_engine_beams_serve.py`` compares it with vLLM's
  server at 0.5 and 2);
* the engine drafted forests for these requests.
"""
from __future__ import annotations

import pytest

from engine_utils import (  # sets the CPU engine environment before vllm is imported
    LOGPROB_TOL, beam_counters, dsbd_llm, greedy_tokens, tiny_pair, with_eos)
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm.sampling_params import BeamSearchParams  # noqa: E402
from vllm_dsbd.patches.beam_search_route import finished_beams  # noqa: E402
from vllm_dsbd.requests import BeamParams  # noqa: E402
from vllm_dsbd.testing.models import load_hf, next_token_logits_fn  # noqa: E402

WIDTH, DEPTH, MAX_TOKENS = 4, 3, 8
# the last three: length_penalty 0.5 returns a shorter best beam than 1 (its beams end on EOS after 3 or 4 tokens), and 2
# a longer one on the first two
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [7], [126, 129, 252], [241, 244, 82], [287, 290, 174]]
PENALTIES = (0.5, 2.0)


def _loop(llm, lp):
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS, length_penalty=lp))
    return [[(list(s.tokens[len(p):]), s.cum_logprob) for s in o.sequences] for p, o in zip(PROMPTS, outs)]


def _dsbd_beam(llm, lp, eos):
    bp = {"width": WIDTH, "max_tokens": MAX_TOKENS, "length_penalty": lp, "eos_token_id": eos}
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=BeamParams.parse(bp, WIDTH).engine_tokens(),
                             extra_args={"dsbd_beam": bp})
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [[(list(b["token_ids"]), b["cum_logprob"]) for b in finished_beams(o)] for o in outs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    target, draft = tiny_pair()
    g0 = greedy_tokens(next_token_logits_fn(load_hf(target)), PROMPTS[0], 8)
    eos = next(t for i, t in enumerate(g0) if i >= 1 and t not in g0[:i])  # the second greedy token
    folder = with_eos(target, tmp_path_factory.mktemp("lp") / "target", eos)
    with dsbd_llm(folder) as llm:
        vllm_beams = {lp: _loop(llm, lp) for lp in (1.0, *PENALTIES)}
    spec = {"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH, "width": WIDTH}
    with dsbd_llm(folder, speculative_config=spec) as llm:
        before = beam_counters(llm)
        routes = {lp: {"beam_search": _loop(llm, lp), "dsbd_beam": _dsbd_beam(llm, lp, eos)} for lp in PENALTIES}
        after = beam_counters(llm)
    return vllm_beams, routes, {k: after[k] - before[k] for k in before}


def _same(got, want):
    assert [[t for t, _ in p] for p in got] == [[t for t, _ in p] for p in want]
    for gp, wp in zip(got, want):
        assert all(abs(a - b) < max(1e-4, LOGPROB_TOL) for (_, a), (_, b) in zip(gp, wp))


@pytest.mark.parametrize("lp", PENALTIES)
def test_penalty_changes_vllms_choice(runs, lp):
    vllm_beams = runs[0]
    changed = [i for i in range(len(PROMPTS)) if vllm_beams[lp][i][0][0] != vllm_beams[1.0][i][0][0]]
    assert changed, f"length_penalty {lp} picks vLLM's length_penalty-1 best beam on every prompt"


@pytest.mark.parametrize("route", ["beam_search", "dsbd_beam"])
@pytest.mark.parametrize("lp", PENALTIES)
def test_route_equals_vllms_loop(runs, lp, route):
    _same(runs[1][lp][route], runs[0][lp])


def test_forests_were_drafted(runs):
    assert runs[2]["beam_draft_nodes"] > 0 and runs[2]["beam_steps"] > 0, runs[2]
