"""The ``use_beam_search`` route's stops (``patches/beam_serving_route``), without an engine: an OpenAI request's
``stop`` / ``stop_token_ids`` become the engine request's ``dsbd_beam`` stop keys (vLLM's loop ignores them; the
DSBD beams obey them), and a finished beam's output follows vLLM's rules for a plain request's stops: a stop string
cuts the text (kept with ``include_stop_str_in_output``), a stop token id is left out of the tokens and text (kept
with it); ``stop_reason`` is the string or the id."""
from __future__ import annotations

import types

import vllm  # noqa: F401  (a broken vLLM must fail the suite, never skip it)
from vllm.sampling_params import BeamSearchParams

from vllm_dsbd.patches.beam_search_route import beam_request_params
from vllm_dsbd.patches.beam_serving_route import beam_request_output, request_stops


class _Tok:
    eos_token_id = 0

    def decode(self, ids):
        return "".join(chr(ord("a") + t - 1) for t in ids)  # 1 -> "a", 2 -> "b", ...


def _out(beams):
    return types.SimpleNamespace(request_id="r", kv_transfer_params={"dsbd_beam": beams}, outputs=[])


def test_openai_stops_become_beam_stops():
    req = types.SimpleNamespace(stop="cd", stop_token_ids=[7], logprobs=None, top_logprobs=None)
    assert request_stops(req) == {"stop": ["cd"], "stop_token_ids": [7]}
    params = BeamSearchParams(beam_width=2, max_tokens=4, include_stop_str_in_output=True)
    sp = beam_request_params(params, 0, 3, 256, 4, temperature=0.0, stops=request_stops(req))
    beam = sp.extra_args["dsbd_beam"]
    assert (beam["stop"], beam["stop_token_ids"], beam["include_stop_str_in_output"]) == (["cd"], [7], True)


def test_openai_group_fields_become_beam_groups():
    """``num_beam_groups`` / ``diversity_penalty`` (extra fields of the OpenAI request) go to the beams; a bad value is
    a ``ValueError`` naming ``extra_args['dsbd_beam'][key]``, which the route turns into a 400 naming the field."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_dsbd.patches.beam_serving_route import _validation_error

    req = CompletionRequest(model="m", prompt=[1, 2], use_beam_search=True, n=4, num_beam_groups=2,
                            diversity_penalty=0.5)
    assert request_stops(req) == {"num_beam_groups": 2, "diversity_penalty": 0.5}
    params = BeamSearchParams(beam_width=4, max_tokens=4)
    beam = beam_request_params(params, 0, 3, 256, 4, temperature=0.0, stops=request_stops(req)).extra_args["dsbd_beam"]
    assert (beam["num_beam_groups"], beam["diversity_penalty"]) == (2, 0.5)
    for bad, name in (({"num_beam_groups": 3}, "num_beam_groups"), ({"diversity_penalty": -1}, "diversity_penalty")):
        try:
            beam_request_params(params, 0, 3, 256, 4, temperature=0.0, stops={"num_beam_groups": 2, **bad})
        except ValueError as e:
            assert _validation_error(str(e)).parameter == name
        else:
            raise AssertionError(f"{bad} accepted")


def test_stopped_beams_output():
    beams = [{"token_ids": [1, 3, 4], "cum_logprob": -1.0, "logprobs": [-0.5, -0.3, -0.2], "finish_reason": "stop",
              "stop_reason": "cd"},
             {"token_ids": [2, 7], "cum_logprob": -2.0, "logprobs": [-1.0, -1.0], "finish_reason": "stop",
              "stop_reason": 7},
             {"token_ids": [2, 0], "cum_logprob": -3.0, "logprobs": [-1.0, -2.0], "finish_reason": "stop",
              "stop_reason": 0}]
    prompt = {"prompt_token_ids": [5, 6]}
    for include in (False, True):
        params = BeamSearchParams(beam_width=3, max_tokens=4, include_stop_str_in_output=include)
        o = beam_request_output(prompt, "r", _out(beams), _Tok(), params).outputs
        assert [c.stop_reason for c in o] == ["cd", 7, 0] and {c.finish_reason for c in o} == {"stop"}
        assert o[0].token_ids == [1, 3, 4] and o[0].text == ("acd" if include else "a")
        assert o[1].token_ids == ([2, 7] if include else [2]) and o[1].text == ("bg" if include else "b")
        assert o[2].token_ids == ([2, 0] if include else [2]) and o[2].text == "b"  # EOS: vLLM's loop's rule
        assert len(o[1].logprobs) == 2  # the stop step's log-probability stays, as EOS's does
