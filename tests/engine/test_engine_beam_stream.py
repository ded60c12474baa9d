"""A streamed beam request streams its settled prefix (real vLLM 0.26.0 on CPU, engine core in-process).

What vLLM outputs for a DSBD beam request (``extra_args["dsbd_beam"]``) is not its token list (prompt + trie slots)
but, after every step, the tokens the step *settled*: the longest common prefix of the live beams and the ``n`` best
finished beams so far (``BeamRequest.settle``, patch ``beam_scheduler``), and when the search ends the rest of the
best beam. The target is ``test_engine_beams.py``'s tiny random Llama with EOS moved to a token greedy decoding emits
early (so beams finish on EOS and finished beams can hold the prefix back); DSBD engine with its 2-layer draft
(depth 3, width 4). Requests go through ``LLMEngine.add_request`` / ``step`` with ``RequestOutputKind.DELTA`` (and one
run with ``CUMULATIVE`` and detokenization), all prompts of a case in one batch, at T = 0 (W = 2, W = 4, W = 4 with
n = 2) and seeded T = 1. Checked:

* after every engine step, the tokens streamed so far equal the settled prefix computed here from the runner's beams
  (live beams' trie paths and the n best finished beams), and once the request finished, its best beam; so the
  streamed tokens before the finishing output are a prefix of every returned beam (never retracted), and all the
  deltas together are the best beam;
* not vacuous: every case's streamed run drafted forests and the runs passed forest layers (DSBD's beam counters), most
  requests stream tokens before they finish, and finished beams held the prefix back at some step (the live beams
  alone agreed on more: a stream of the live beams' prefix would have retracted tokens);
* the beams (``kv_transfer_params["dsbd_beam"]``) equal the same requests' non-streamed (``FINAL_ONLY``) beams, whose
  ``CompletionOutput`` is the best beam too (tokens and finish reason); settings given as a JSON string (the OpenAI
  server's ``vllm_xargs`` carry no mappings) give the same beams;
* ``CUMULATIVE``: every output extends the previous one, tokens and text, and the last is the best beam (its text is
  vLLM's incremental detokenization, which differs from a one-shot decode on the random model's byte tokens);
* engine ``logprobs`` above 2W on a beam request are refused (ValueError naming ``logprobs``) and the engine keeps serving.
"""
from __future__ import annotations

import json

import pytest

from engine_utils import dsbd_llm, metric  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

import test_engine_beams  # noqa: E402
from test_engine_beams import SHORT  # noqa: E402
from vllm.sampling_params import BeamSearchParams, RequestOutputKind  # noqa: E402
from vllm_dsbd.patches.beam_search_route import beam_request_params  # noqa: E402

setup = test_engine_beams.setup  # the target (EOS moved) and its draft

WIDTH, DEPTH, MAX_TOKENS = 4, 3, 12
PROMPTS = SHORT + [[83, 60], [377, 113], [243, 129, 197, 281, 55, 296, 130], [187, 215], [356, 103, 199, 155]]
# (name, beam width, n returned, temperature)
CASES = [("W2", 2, None, 0.0), ("W4", 4, None, 0.0), ("W4-n2", 4, 2, 0.0), ("W4-T1", 4, None, 1.0)]


def _params(width, n, temperature, kind, eos):
    sp = beam_request_params(BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, temperature=temperature), eos,
                             max(map(len, PROMPTS)), 256, WIDTH)
    if n is not None:
        sp.extra_args["dsbd_beam"]["n"] = n
    if temperature > 0:
        sp.seed = 3
    sp.output_kind = kind
    return sp


def _beam_states(worker) -> dict:
    """Per beam request in the runner (engine request id): its live beams' tokens (trie paths) and its n best finished
    beams' tokens."""
    runner = getattr(worker, "worker", worker).model_runner
    out = {}
    for rid, st in runner.dsbd_requests._states.items():
        b = st.beam
        if b is not None:
            out[rid] = {"live": [b._path(x.node)[0] for x in b.live], "best": [list(f.tokens) for f in b.best()]}
    return out


def _common_prefix(seqs) -> list[int]:
    first = list(seqs[0])
    for q in seqs[1:]:
        k = 0
        while k < min(len(first), len(q)) and first[k] == q[k]:
            k += 1
        first = first[:k]
    return first


def _streamed_run(llm, params, tag: str):
    """The prompts as one batch through ``add_request`` / ``step``. Returns per prompt: the outputs' new tokens per
    output ``(delta, finished)``, the final output, and per step ``(streamed so far, settled prefix, live prefix)``."""
    eng = llm.llm_engine
    ids = [f"{tag}-{i}" for i in range(len(PROMPTS))]
    for rid, p, sp in zip(ids, PROMPTS, params):
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    res = {rid: {"outputs": [], "final": None, "steps": [], "streamed": [], "cum": []} for rid in ids}
    while eng.has_unfinished_requests():
        for o in eng.step():
            r = res[o.request_id]
            r["outputs"].append((list(o.outputs[0].token_ids), o.finished))
            if params[0].output_kind == RequestOutputKind.DELTA:
                r["streamed"] += list(o.outputs[0].token_ids)
            else:
                r["cum"].append((list(o.outputs[0].token_ids), o.outputs[0].text))
                r["streamed"] = list(o.outputs[0].token_ids)
            if o.finished:
                r["final"] = o
        for eid, st in llm.collective_rpc(_beam_states)[0].items():
            rid = eid.rsplit("-", 1)[0]  # vLLM adds 8 random characters to the request id
            if rid not in res:
                continue
            settled = _common_prefix(st["best"] + st["live"]) if st["live"] else st["best"][0]
            live = _common_prefix(st["live"]) if st["live"] else settled
            res[rid]["steps"].append((list(res[rid]["streamed"]), settled, live))
    return [res[rid] for rid in ids]


def _final_run(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(o.kv_transfer_params["dsbd_beam"], list(o.outputs[0].token_ids), o.outputs[0].finish_reason)
            for o in outs]


@pytest.fixture(scope="module")
def runs(setup):
    folder, draft, eos = setup
    with dsbd_llm(folder, max_num_seqs=16,
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                      "width": WIDTH}) as llm:
        out = {"counts": {}}
        for name, width, n, temp in CASES:
            before = _beam_counts(llm)
            streamed = _streamed_run(llm, [_params(width, n, temp, RequestOutputKind.DELTA, eos) for _ in PROMPTS],
                                     name)
            after = _beam_counts(llm)
            final = _final_run(llm, [_params(width, n, temp, RequestOutputKind.FINAL_ONLY, eos) for _ in PROMPTS])
            out[name] = (streamed, final)
            out["counts"][name] = {k: after[k] - before[k] for k in after}
        cum = [_params(4, None, 0.0, RequestOutputKind.CUMULATIVE, eos) for _ in PROMPTS]
        for sp in cum:
            sp.detokenize = True
        out["cumulative"] = _streamed_run(llm, cum, "cum")
        as_json = [_params(4, None, 0.0, RequestOutputKind.FINAL_ONLY, eos) for _ in PROMPTS]
        for sp in as_json:
            sp.extra_args["dsbd_beam"] = json.dumps(sp.extra_args["dsbd_beam"])
        out["json"] = _final_run(llm, as_json)
        bad = _params(2, None, 0.0, RequestOutputKind.DELTA, eos)
        bad.logprobs = 5  # above 2W (LLM.generate returns final outputs: the DELTA refusal is test_engine_beam_logprobs')
        with pytest.raises(ValueError, match=r"^logprobs: a beam request of width 2 returns at most 4") as err:
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], bad, use_tqdm=False)
        out["bad"] = str(err.value)
        out["after_bad"] = _final_run(llm, [_params(4, None, 0.0, RequestOutputKind.FINAL_ONLY, eos)
                                            for _ in PROMPTS])
        yield out


def _beam_counts(llm) -> dict:
    """DSBD's beam counters: target passes, beam steps, forest nodes verified, forest layers passed."""
    return {k: int(metric(llm, f"vllm:dsbd_beam_{k}") or 0)
            for k in ("target_passes", "steps", "draft_nodes", "layers_passed")}


def _beams(final_output):
    return [b["token_ids"] for b in final_output.kv_transfer_params["dsbd_beam"]]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_stream_is_the_settled_prefix_at_every_step(runs, name):
    streamed, _ = runs[name]
    for r in streamed:
        assert r["steps"]
        for got, settled, _ in r["steps"]:
            assert got == settled, (got, settled)
        beams = _beams(r["final"])
        deltas = [d for d, _ in r["outputs"]]
        assert [f for _, f in r["outputs"]] == [False] * (len(deltas) - 1) + [True]
        before = [t for d in deltas[:-1] for t in d]
        for b in beams:  # never retracted: what was streamed before the end starts every returned beam
            assert b[: len(before)] == before, (before, beams)
        assert before + deltas[-1] == beams[0]  # the end: the rest of the best beam


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_streamed_beams_equal_the_non_streamed_ones(runs, name):
    streamed, final = runs[name]
    for r, (beams, tokens, reason) in zip(streamed, final):
        got = r["final"].kv_transfer_params["dsbd_beam"]
        assert [b["token_ids"] for b in got] == [b["token_ids"] for b in beams]
        assert all(abs(a["cum_logprob"] - b["cum_logprob"]) < 1e-4 for a, b in zip(got, beams))
        # a non-streamed beam request's output is its best beam, with the best beam's finish reason
        assert tokens == beams[0]["token_ids"] and reason == beams[0]["finish_reason"]
        assert r["final"].outputs[0].finish_reason == reason
    n = {"W2": 2, "W4": 4, "W4-n2": 2, "W4-T1": 4}[name]
    assert all(len(b) == n for b, _, _ in final)


def test_streams_are_not_vacuous(runs):
    # every streamed case drafted forests (DSBD's counters), and forest layers passed: fewer target passes than steps
    # (at width 4 and T = 0 all 4 new beams must be forest nodes for a layer to pass, which this random pair's draft
    # never managed in the W4 and W4-n2 cases: their passes are all single steps; measured W2 116 passes for 120
    # steps, W4-T1 107 for 120)
    for name, c in runs["counts"].items():
        print(name, c)
        assert c["draft_nodes"] > 0 and c["steps"] <= c["target_passes"] + c["layers_passed"], (name, c)
    total = {k: sum(c[k] for c in runs["counts"].values()) for k in ("target_passes", "steps", "layers_passed")}
    assert total["layers_passed"] > 0 and total["target_passes"] < total["steps"], total
    early = [sum(len(d) for d, f in r["outputs"] if not f) for c in CASES for r in runs[c[0]][0]]
    assert sum(1 for e in early if e > 0) >= len(early) // 2, early
    # some requests end on EOS, some run to max_tokens
    reasons = {b["finish_reason"] for c in CASES for r in runs[c[0]][0] for b in r["final"].kv_transfer_params[
        "dsbd_beam"]}
    assert reasons == {"stop", "length"}
    # finished beams held the prefix back at some step: the live beams alone shared more tokens, which a stream of the
    # live beams' prefix would have sent and then retracted (the best beam is a finished one off that prefix)
    held = [(_beams(r["final"])[0], live) for c in CASES for r in runs[c[0]][0]
            for _, settled, live in r["steps"] if len(live) > len(settled)]
    assert any(best[: len(live)] != live for best, live in held), held


def test_cumulative_outputs_only_grow(runs):
    for r, (beams, _, _) in zip(runs["cumulative"], runs["W4"][1]):
        prev_tokens, prev_text = [], ""
        for tokens, text in r["cum"]:
            assert tokens[: len(prev_tokens)] == prev_tokens and text.startswith(prev_text)
            prev_tokens, prev_text = tokens, text
        assert prev_tokens == beams[0]["token_ids"] == _beams(r["final"])[0]
        for got, settled, _ in r["steps"]:
            assert got == settled
    assert any(len(r["cum"]) > 1 and r["cum"][0][0] and r["cum"][0][1] for r in runs["cumulative"])


def _assert_same_finals(got, expected):
    assert len(got) == len(expected)
    for (g, gt, gr), (e, et, er) in zip(got, expected):
        assert [b["token_ids"] for b in g] == [b["token_ids"] for b in e] and (gt, gr) == (et, er)
        assert all(abs(a["cum_logprob"] - b["cum_logprob"]) < 1e-4 for a, b in zip(g, e))


def test_json_string_settings_and_refused_logprobs(runs):
    _assert_same_finals(runs["json"], runs["W4"][1])
    assert "2 * width" in runs["bad"]
    _assert_same_finals(runs["after_bad"], runs["W4"][1])
