"""Beam search with structured outputs on a DSBD engine equals vLLM's own ``LLM.beam_search`` under the same grammar.

Real vLLM 0.26.0 on CPU, SmolLM2-135M-Instruct in float32, vLLM's xgrammar backend, chat prompts asking for JSON.
Oracle: vLLM's ``LLM.beam_search(..., BeamSearchParams(..., structured_outputs=...))`` on a plain engine (its
front-end loop, upstream #35022: per step each beam's grammar replayed, ``allowed_token_ids`` under the cap, the
candidates filtered to the allowed set). Engines one after another: plain, DSBD without forest sources
(``"sources": []``), DSBD with the default draft-free sources (structured beam requests draft nothing there).
Checked on both DSBD engines:

* ``LLM.beam_search`` with a JSON schema (W = 2 and 4), a ``choice`` and a regex: the same sequences in the same order,
  token for token and text for text, cumulative log-probabilities to 1e-4 or 1e-5 relative; the beams differ from the unconstrained
  beams on some prompt (the constraint acts) and every JSON beam that ended on EOS parses under the schema;
* the ``dsbd_beam`` route (``structured_outputs`` on the engine request's ``SamplingParams``) gives the same beams;
* the OpenAI ``use_beam_search`` route's engine request, built from a ``CompletionRequest`` with a ``json_schema``
  ``response_format`` as the server builds it (patch ``beam_serving_route``), and its ``RequestOutput``: vLLM's beams;
* the engine's counters show the beam steps ran in the engine, without forests;
* power: planted variants of the rule (the best allowed token never added; the candidates the masked row's 2W best)
  give other beams than vLLM's on some case;
* a structured beam request at temperature > 0 is refused (``ValueError`` naming ``structured_outputs``) and the
  engine keeps serving.
"""
from __future__ import annotations

import json
import math

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
# terminated, so vLLM's loop completes it as it is the next step (the quirk path: no new token). Not with a choice:
# there every beam of every prompt ends on the same step, and vLLM's loop then lists those beams twice (it stops
# before replacing the live beams, then adds them to the completed ones again: docs/deviations.md D22); the JSON
# beams of prompt 1 run to max_tokens
CASES = [("json", 2, False), ("json", 4, False), ("choice", 4, False), ("regex", 2, False), ("json", 2, True)]
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
    # planted variants, each a plausible wrong reading of vLLM's rule: the best allowed token never joins the
    # candidates (the cap ignored), or the candidates are the 2W best allowed tokens (the masked row's top 2W)
    from vllm_dsbd.engine.beams import grammar, step

    for name, attr, value in (("no_best_allowed", grammar, ("MAX_ALLOWED", 0)),
                              ("masked_rows", step, ("structured_tops", _masked_tops))):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(attr, *value)
            out[name] = {case: _seqs(llm.beam_search([{"prompt_token_ids": p} for p in prompts], _params(*case)))
                         for case in CASES[:3]}
    return out


def _masked_tops(rows, groups):
    """The planted ``grammar.structured_tops``: each row's 2W best allowed tokens (top 2W of the masked row)."""
    import torch

    from vllm_dsbd.engine.beams.sampling import TopRows

    V = rows.shape[-1]
    mask = torch.cat([beam.grammar.masks(beam, sum(len(r) for r in beam.leaf_rows), m, V) for beam, m in groups])
    logp = torch.log_softmax(rows.float(), dim=-1).masked_fill(~mask.to(rows.device), float("-inf"))
    k = max(2 * beam.params.width for beam, _ in groups)
    vals, idx = torch.topk(logp, k, dim=-1)
    host, = yield [torch.stack([vals.double(), idx.double()])]
    out, at = [], 0
    for beam, m in groups:
        w = 2 * beam.params.width
        out.append(TopRows([r[:w] for r in host[0][at : at + m].tolist()],
                           [[int(x) for x in r[:w]] for r in host[1][at : at + m].tolist()]))
        at += m
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
        # float32 rows computed in other batch shapes: each token's log-probability agrees to float32 rounding,
        # relative to its size (the constrained beams' are large: cumulative -40 and below)
        diff = max((abs(a[2] - b[2]) for a, b in zip(mine, ref)), default=0.0)
        print(f"  cumulative log-probabilities: max difference {diff:.2e}")
        assert all(math.isclose(a[2], b[2], rel_tol=1e-5, abs_tol=1e-4) for a, b in zip(mine, ref))


def test_planted_variants_are_told_apart(plain, dsbd):
    """The equality has power over the rule's details: either planted variant changes the beams of some case."""
    strip = lambda outs: [[s[:2] for s in o] for o in outs]  # noqa: E731
    for name in ("no_best_allowed", "masked_rows"):
        assert any(strip(dsbd[name][case]) != strip(plain[case]) for case in CASES[:3]), name


def test_constraint_changes_the_beams(setup, plain, dsbd):
    strip = lambda outs: [[s[:2] for s in o] for o in outs]  # noqa: E731  (tokens, text)
    assert strip(dsbd["free"]) == strip(plain["free"])
    for case in CASES:  # the constraint acts: different beams on some prompt (every prompt, as it happens)
        assert [o[:1] for o in strip(plain[case])] != [o[:1] for o in strip(plain["free"])], case
    _, prompts, tok = setup
    done = 0
    for case in (("json", 2, False), ("json", 4, False)):
        for p, o in zip(prompts, dsbd[case]):
            for tokens, _, _ in o:
                if tokens[-1] == tok.eos_token_id:  # ended on EOS: a complete object under the schema
                    value = json.loads(tok.decode(tokens[len(p):-1]))
                    assert set(value) == {"name", "age"} and isinstance(value["age"], int), value
                    done += 1
    assert done > 0


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
    ended = [s for p, o in zip(prompts, plain[("json", 2, True)]) for s in o
             if s[0][-1] == tok.eos_token_id and len(s[0]) - len(p) < MAX_TOKENS]
    assert ended


def test_cap_is_vllms():
    from vllm.entrypoints.generate.beam_search.offline import _MAX_NUM_ALLOWED_TOKEN_IDS

    from vllm_dsbd.engine.beams.grammar import MAX_ALLOWED

    assert MAX_ALLOWED == _MAX_NUM_ALLOWED_TOKEN_IDS
