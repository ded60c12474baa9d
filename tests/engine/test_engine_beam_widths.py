"""Beams at every width vLLM's loop serves on the engine a user starts: ``{"method": "dsbd"}`` (no width: plain
requests' forests at the default width 2) serves ``LLM.beam_search`` at W = 4 to 64, real vLLM 0.26.0 on CPU.

Tiny random Llama target of ``test_engine_beams.py`` (EOS moved to a token greedy decoding emits early, so beams
finish both ways), vLLM's default ``max_model_len`` (the model's 2048) on both engines; oracle: vLLM's own
``LLM.beam_search`` loop on a plain engine with the same float32 weights (``max_logprobs`` 128: its loop asks for 2W
logprobs per beam). The DSBD engine drafts beam forests from its default draft-free sources (recycle + lookup, depth
3), with the cost model off so that every step drafts what its slots allow (the user's default has it on; the slots
do not depend on it). Its scheduler slots per request are 63 (``max_beam_width`` 64 - 1: a beam request of width W
schedules W - 1 leaves; plain requests' forests need 7), so a beam request's forest takes the 64 - W slots left: N = W
nodes per depth, at most 3 depths. Checked:

* at W = 4, 8, 16, 32, 64 (2 prompts, 5 tokens) the DSBD engine returns vLLM's sequences token for token, in
  order, cumulative log-probabilities to 1e-4;
* forests narrowed or left out where the slots say so (the engine's beam counters per width): forest nodes drafted
  and verified at W <= 32, never more per target pass than the slots left (64 - W: 12 nodes at W = 4, one depth of
  32 at W = 32), none at W = 64 (its 63 leaves take every slot);
* W = 65 is refused with a ``ValueError`` naming the width and the 64 beams that fit, a trie that cannot fit
  ``max_model_len`` with the tokens that fit; the engine keeps serving.
"""
from __future__ import annotations

import pytest

from engine_utils import LOGPROB_TOL, beam_counters, dsbd_llm  # sets the CPU engine environment before vllm
import vllm  # noqa: E402,F401  (a broken vLLM must fail the suite, never skip it)

import test_engine_beams  # noqa: E402
from vllm.sampling_params import BeamSearchParams  # noqa: E402

setup = test_engine_beams.setup  # the target with EOS moved (module fixture)

WIDTHS, TOKENS = (4, 8, 16, 32, 64), 5
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [10, 20, 30, 40, 10, 20]]  # repeats: lookup has candidates from the start
KW = dict(max_model_len=None, max_logprobs=2 * max(WIDTHS))  # None: vLLM's default, the model's 2048


def _beam_search(llm, width, max_tokens=TOKENS, prompts=PROMPTS):
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=width, max_tokens=max_tokens))
    return [[(list(s.tokens), s.cum_logprob) for s in o.sequences] for o in outs]


@pytest.fixture(scope="module")
def plain(setup):
    folder, _, _ = setup
    with dsbd_llm(folder, **KW) as llm:
        yield {w: _beam_search(llm, w) for w in WIDTHS}


@pytest.fixture(scope="module")
def default(setup, plain):  # after plain: one engine at a time
    folder, _, _ = setup
    with dsbd_llm(folder, **KW, speculative_config={"method": "dsbd"}) as llm:
        out = {"slots": llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens}
        for w in WIDTHS:
            before = beam_counters(llm)
            got = _beam_search(llm, w)
            after = beam_counters(llm)
            out[w] = got, {k: after[k] - before[k] for k in after}
        with pytest.raises(ValueError, match=r"\['width'\] = 65 is above the engine's 64 beams per request "
                                             r"\(max_beam_width.* up to 64 fit"):
            _beam_search(llm, 65)
        # 7 + 40 * 65 + 2 slots > 2048: up to (2048 - 7 - 2) // 65 = 31 tokens fit at width 64
        with pytest.raises(ValueError, match=r"max_tokens: a beam search of width 64 and 40 tokens .*more than "
                                             r"max_model_len 2048 \(up to 31 tokens fit at width 64, width 49 at 40"):
            _beam_search(llm, 64, max_tokens=40, prompts=PROMPTS[:1])
        out["after"] = _beam_search(llm, 4, prompts=PROMPTS[:1])
        yield out


def test_default_engine_slots(default):
    assert default["slots"] == 63


@pytest.mark.parametrize("width", WIDTHS)
def test_beam_search_equals_vllm_at_every_width(plain, default, width):
    got, c = default[width]
    print(f"W = {width}:", c)
    want = plain[width]
    for g, w in zip(got, want):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert all(abs(a - b) < max(1e-4, LOGPROB_TOL) for (_, a), (_, b) in zip(g, w))
    assert c["beam_steps"] > 0
    if width < 64:  # a forest in the slots the leaves leave: N = W per depth, up to 3 depths
        assert c["beam_draft_nodes"] > 0, c
        assert c["beam_draft_nodes"] <= min(3 * width, 64 - width) * c["beam_target_passes"], c
    else:  # 63 leaves take every slot: no forest
        assert c["beam_draft_nodes"] == 0 and c["beam_target_passes"] == c["beam_steps"], c


def test_refusals_name_what_fits_and_the_engine_keeps_serving(plain, default):
    assert [[t for t, _ in b] for b in default["after"]] == [[t for t, _ in b] for b in plain[4][:1]]
