"""Beam search with structured outputs on a DSBD engine equals vLLM's own ``LLM.beam_search`` under the same grammar.

Real vLLM 0.26.0 on CPU, SmolLM2-135M-Instruct in float32, vLLM's xgrammar backend, chat prompts asking for JSON.
Oracle: vLLM's ``LLM.beam_search(..., BeamSearchParams(..., structured_outputs=...))`` on a plain engine (its
front-end loop, upstream #35022: per step each beam's grammar replayed, ``allowed_token_ids`` under the cap, the
candidates filtered to the allowed set). Engines one after another: plain, DSBD without forest sources
(``"sources": []``), DSBD with the default draft-free sources (structured beam requests draft nothing there).
Checked on both DSBD engines:

* ``LLM.beam_search`` with a JSON schema (W = 2 and 4), a ``choice`` and a regex: the same sequences in the same order,
  token for token and text for text, cumulative log-probabilities to 1e-4; the beams differ from the unconstrained
  beams on some prompt (the constraint acts) and every JSON beam that ended on EOS parses under the schema;
* the ``dsbd_beam`` route (``structured_outputs`` on the engine request's ``SamplingParams``) gives the same beams;
* the OpenAI ``use_beam_search`` route's engine request, built from a ``CompletionRequest`` with a ``json_schema``
  ``response_format`` as the server builds it (patch ``beam_serving_route``), and its ``RequestOutput``: vLLM's beams;
* the engine's counters show the beam steps ran in the engine, without forests;
* a structured beam request at temperature > 0 is refused (``ValueError`` naming ``structured_outputs``) and the
  engine keeps serving.
"""
from __future__ import annotations

import json

import pytest

from engine_utils import dsbd_llm, metric  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm.sampling_params import BeamSearchParams, StructuredOutputsParams as SO  # noqa: E402

pytestmark = pytest.mark.slow

WIDTH, MAX_TOKENS = 4, 20
ASKS = ["Give me a person as JSON with a name and an age.", "Describe a city in JSON: its name and population.",
        "Return a JSON object for a pet called Rex."]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe", "I do not know"]
REGEX = r"[0-9]{1,3} (apples|pears|cats)\."
CONSTRAINTS = {"json": {"json": SCHEMA}, "choice": {"choice": CHOICES}, "regex": {"regex": REGEX}}
# (constraint, beam width, ignore_eos): with ignore_eos an EOS the grammar allows stays a beam, whose grammar is then
# terminated, so vLLM's loop completes it as it is the next step (the quirk path: no new token)
CASES = [("json", 2, False), ("json", 4, False), ("choice", 4, False), ("regex", 2, False), ("choice", 2, True)]
ENGINE = dict(max_model_len=512, structured_outputs_config={"backend": "xgrammar"})


@pytest.fixture(scope="module")
def setup():
    from vllm_dsbd.testing.models import load_tokenizer, smollm2_dir

    folder = smollm2_dir()
    tok = load_tokenizer(folder)
    prompts = []
    for ask in ASKS:
        ids = tok.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return folder, prompts, tok


def _params(name, width, ignore_eos=False, oracle=False):
    """``oracle``: vLLM's ``LLM.beam_search`` skips the front end's validation, which turns a ``choice`` into the
    grammar xgrammar compiles (``backend_xgrammar.validate_xgrammar_grammar``), so its loop raises on a ``choice``;
    it gets that grammar (the DSBD engine request is validated, and takes the ``choice`` itself)."""
    so = dict(CONSTRAINTS[name])
    if oracle and "choice" in so:
        from vllm.v1.structured_output.backend_xgrammar import choice_as_grammar

        so = {"grammar": choice_as_grammar(so["choice"])}
    return BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos,
                            structured_outputs=SO(**so))


def _seqs(outs):
    return [[(list(s.tokens), s.text, s.cum_logprob) for s in o.sequences] for o in outs]


def _runs(llm, prompts, oracle=False) -> dict:
    out = {}
    for case in CASES:
        out[case] = _seqs(llm.beam_search([{"prompt_token_ids": p} for p in prompts], _params(*case, oracle=oracle)))
    out["free"] = _seqs(llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                        BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS)))
    return out


def _dsbd_extra(llm, prompts, tok) -> dict:
    """The dsbd_beam route, the use_beam_search route's engine request, the counters and the T > 0 refusal."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_dsbd.patches.beam_search_route import beam_outputs, beam_request_params
    from vllm_dsbd.patches.beam_serving_route import STRUCTURED_ATTR, beam_request_output

    out = {}
    before = {k: metric(llm, f"vllm:dsbd_beam_{k}") or 0 for k in ("steps", "draft_nodes")}
    sps = [beam_request_params(_params("json", 2), tok.eos_token_id, len(p), 512, WIDTH, temperature=0.0,
                               rank_by_score=True) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    out["dsbd_beam"] = _seqs([beam_outputs({"prompt_token_ids": p}, o, tok) for p, o in zip(prompts, outs)])
    after = {k: metric(llm, f"vllm:dsbd_beam_{k}") or 0 for k in ("steps", "draft_nodes")}
    out["counters"] = {k: after[k] - before[k] for k in after}
    served = []
    for p in prompts:  # as the OpenAI server builds it (patches beam_serving_route and beam_search_route)
        req = CompletionRequest(model="m", prompt=p, use_beam_search=True, n=2, max_tokens=MAX_TOKENS, temperature=0,
                                response_format={"type": "json_schema",
                                                 "json_schema": {"name": "person", "schema": SCHEMA}})
        bp = req.to_beam_search_params(MAX_TOKENS, {})
        sp = beam_request_params(bp, tok.eos_token_id, len(p), 512, WIDTH, temperature=0.0,
                                 structured=getattr(bp, STRUCTURED_ATTR))
        o = llm.generate([{"prompt_token_ids": p}], [sp], use_tqdm=False)[0]
        served.append([(list(c.token_ids), c.text) for c in
                       beam_request_output({"prompt_token_ids": p}, "r", o, tok, bp).outputs])
    out["served"] = served
    with pytest.raises(ValueError, match=r"^structured_outputs: not supported on a beam request .* temperature > 0"):
        llm.generate([{"prompt_token_ids": prompts[0]}], vllm.SamplingParams(
            temperature=0.5, max_tokens=200, ignore_eos=True, structured_outputs=SO(choice=CHOICES),
            extra_args={"dsbd_beam": {"width": 2, "max_tokens": 4}}), use_tqdm=False)
    out["after_refusal"] = _seqs(llm.beam_search([{"prompt_token_ids": prompts[0]}], _params("json", 2)))
    return out


@pytest.fixture(scope="module")
def plain(setup):
    folder, prompts, _ = setup
    with dsbd_llm(folder, **ENGINE) as llm:
        return _runs(llm, prompts, oracle=True)


@pytest.fixture(scope="module", params=["no_sources", "default_sources"])
def dsbd(request, setup, plain):  # after plain: one engine at a time
    folder, prompts, tok = setup
    spec = {"method": "dsbd", "width": WIDTH}
    if request.param == "no_sources":
        spec["sources"] = []
    with dsbd_llm(folder, **ENGINE, speculative_config=spec) as llm:
        out = _runs(llm, prompts)
        out.update(_dsbd_extra(llm, prompts, tok))
        return out


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-W{w}{'-ignore_eos' if i else ''}" for n, w, i in CASES])
def test_structured_beam_search_equals_vllm(plain, dsbd, case):
    for p, (mine, ref) in enumerate(zip(dsbd[case], plain[case])):
        print(f"{case} prompt {p}: " + " | ".join(repr(t) for _, t, _ in ref))
        assert [(t, x) for t, x, _ in mine] == [(t, x) for t, x, _ in ref]
        assert all(abs(a[2] - b[2]) < 1e-4 for a, b in zip(mine, ref))


def test_constraint_changes_the_beams(plain, dsbd):
    strip = lambda outs: [[s[:2] for s in o] for o in outs]  # noqa: E731  (tokens, text)
    assert strip(dsbd["free"]) == strip(plain["free"])
    for case in CASES:  # the constraint acts: different beams on some prompt (every prompt, as it happens)
        assert [o[:1] for o in strip(plain[case])] != [o[:1] for o in strip(plain["free"])], case
    for tokens_text in (o[0] for o in plain[("json", 4, False)]):
        print("best JSON beam:", repr(tokens_text[1]))


def test_dsbd_beam_and_served_routes(setup, plain, dsbd):
    _, prompts, tok = setup
    strip = lambda outs: [[s[:2] for s in o] for o in outs]  # noqa: E731
    assert strip(dsbd["dsbd_beam"]) == strip(plain[("json", 2, False)])
    eos = tok.eos_token_id
    for p, served, ref in zip(prompts, dsbd["served"], plain[("json", 2, False)]):
        # vLLM's server loop: an EOS-finished beam's token ids and text without the EOS
        want = [t[len(p):-1] if t[-1] == eos else t[len(p):] for t, _, _ in ref]
        assert served == [(ids, tok.decode(ids)) for ids in want]
    c = dsbd["counters"]
    print("counters:", c)
    assert c["steps"] > 0 and c["draft_nodes"] == 0


def test_temperature_refusal_keeps_serving(plain, dsbd):
    assert [[s[:2] for s in o] for o in dsbd["after_refusal"]] == [[s[:2] for s in o]
                                                                  for o in plain[("json", 2, False)][:1]]


def test_terminated_grammar_completes_beams(setup, plain, dsbd):
    """Not vacuous: with ignore_eos some beam ends on EOS before max_tokens (kept as a beam, then completed as it is
    because its grammar was terminated), on both engines alike (compared above)."""
    _, prompts, tok = setup
    ended = [s for p, o in zip(prompts, plain[("choice", 2, True)]) for s in o
             if s[0][-1] == tok.eos_token_id and len(s[0]) - len(p) < MAX_TOKENS]
    assert ended
