"""A beam request that does not ignore EOS, on a model whose generation config lists a second EOS id, real vLLM 0.26.0
on CPU (a DSBD engine without a draft model: the path is the scheduler's, the same with a draft).

vLLM adds the generation config's other EOS ids to such a request's ``stop_token_ids``
(``SamplingParams.update_from_generation_config``) and stops a request whose appended token is one of them. A beam
request's appended tokens are its trie slots, where that id is an ordinary beam token: without patch
``beam_scheduler``'s ``ignore_token_stops`` the request below ends at its first step with no beams. Here its second
EOS id is the prompt's greedy first token, which the trie holds from the first step on. Checked: the request returns
the beams of the same request with ``ignore_eos=True`` (tokens, finish reasons and cumulative log-probabilities),
some of which contain that token.
"""
from __future__ import annotations

import json

import pytest

from engine_utils import (  # sets the CPU engine environment before vllm is imported
    dsbd_llm, greedy_tokens, tiny_pair, with_eos)
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm_dsbd.requests import BeamParams  # noqa: E402
from vllm_dsbd.testing.models import load_hf, next_token_logits_fn  # noqa: E402
from vllm_dsbd.patches.beam_search_route import finished_beams  # noqa: E402

PROMPT = [5, 6, 7, 8]
WIDTH, MAX_TOKENS = 2, 8


@pytest.fixture(scope="module")
def beams(tmp_path_factory):
    target, _ = tiny_pair()
    g = greedy_tokens(next_token_logits_fn(load_hf(target)), PROMPT, 8)[len(PROMPT):]
    second_eos = g[0]  # the greedy first token: in the trie from the first step on
    eos = next(t for t in g[1:] if t != second_eos)  # a token greedy decoding reaches: some beams end on it
    folder = with_eos(target, tmp_path_factory.mktemp("eos_ids") / "target", eos)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, second_eos]}))
    with dsbd_llm(folder, enable_prefix_caching=None, disable_log_stats=True,  # vLLM's defaults
                  speculative_config={"method": "dsbd", "width": WIDTH}) as llm:
        beam = {"width": WIDTH, "max_tokens": MAX_TOKENS, "eos_token_id": eos}
        engine_tokens = BeamParams.parse(beam, WIDTH).engine_tokens()
        out = {"eos": eos, "second_eos": second_eos}
        for ignore in (False, True):
            sp = vllm.SamplingParams(temperature=0.0, max_tokens=engine_tokens, ignore_eos=ignore,
                                     extra_args={"dsbd_beam": beam})
            (o,) = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)
            out[ignore] = [(list(b["token_ids"]), b["cum_logprob"], b["finish_reason"]) for b in finished_beams(o)]
        return out


def test_generation_config_eos_ids_do_not_stop_a_beam_request(beams):
    got, expected = beams[False], beams[True]
    assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in expected] and len(got) == WIDTH
    assert all(abs(a - b) < 1e-5 for (_, a, _), (_, b, _) in zip(got, expected))
    assert any(beams["second_eos"] in t for t, _, _ in got)  # the id vLLM would have stopped on is a beam token
