"""A DSBD engine without a draft model and without forest sources (``speculative_config={"method": "dsbd", "width": 4,
"sources": []}``: the γ = 0 engine), real vLLM 0.26.0 on CPU. (Without ``"sources": []`` such an engine drafts from
the draft-free sources: ``test_engine_sources.py``.)

The target and the oracle are ``test_engine_beams.py``'s (its ``setup`` and ``plain`` fixtures and helpers are reused:
the tiny random Llama with EOS moved to a token greedy decoding emits early, and vLLM's own ``LLM.beam_search`` and
greedy decoding on a plain engine with the same float32 weights). One DSBD engine, started after the plain one is shut
down. Checked:

* it starts without a draft: the runner has no draft model (``NoDrafter``), the KV cache holds the target's layers
  only, vLLM's config says ``model=None``, and the runner logs "no draft model";
* ``LLM.beam_search`` at temperature 0 (W = 2 and 4, length_penalty != 1, beams finishing on EOS) equals vLLM's beams
  (tokens, order; cumulative log-probabilities to 1e-4);
* plain greedy requests equal plain vLLM greedy token for token, one target pass per token (the engine's counts);
* the engine's counters: beam steps made, one target pass per beam step, 0 draft nodes, 0 layers passed, and no
  vLLM spec-decode drafts;
* a seeded temperature-1 beam request returns W beams, the same ones again with the same seed (another seed gives
  other beams); a beam request asking for a draft depth is refused with a ValueError and the engine keeps serving.
"""
from __future__ import annotations

import contextlib
import logging

import pytest

from engine_utils import LogRecords, dsbd_llm, metric  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402,F401  (a broken vLLM must fail the suite, never skip it)

import test_engine_beams  # noqa: E402
from test_engine_beams import (  # noqa: E402
    CASES, LONG, MAX_TOKENS, SHORT, _assert_same_beams, _beam_search, _greedy_params, _read,
)
from vllm.sampling_params import BeamSearchParams  # noqa: E402
from vllm_dsbd.patches.beam_search_route import beam_request_params  # noqa: E402

# test_engine_beams' fixtures: the target (EOS moved) and vLLM's own beams and greedy tokens
setup, plain = test_engine_beams.setup, test_engine_beams.plain

WIDTH = 4
SEEDED = [SHORT[0], SHORT[2]]


def _runner_report(worker) -> dict:
    """What the worker's DSBD runner holds (``LLM.collective_rpc``)."""
    runner = getattr(worker, "worker", worker).model_runner
    spec = runner.speculative_config
    return {
        "draft": runner.dsbd_cfg.draft, "depth": runner.dsbd_cfg.depth, "drafter": type(runner.drafter).__name__,
        "draft_model": runner.get_draft_model(), "method": spec.method, "model": spec.model,
        "kv_layers": sorted(n for g in runner.kv_cache_config.kv_cache_groups for n in g.layer_names),
        "num_layers": runner.model_config.hf_config.num_hidden_layers,
    }


def _seeded(llm, eos, seed: int):
    bp = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS, temperature=1.0)
    params = []
    for p in SEEDED:
        sp = beam_request_params(bp, eos, len(p), 256, WIDTH)
        sp.seed = seed
        params.append(sp)
    return _read(llm, SEEDED, llm.generate([{"prompt_token_ids": p} for p in SEEDED], params, use_tqdm=False))


@pytest.fixture(scope="module")
def nodraft(setup, plain):  # after plain: one engine at a time
    folder, _, eos = setup
    records = LogRecords()
    log = logging.getLogger("vllm.vllm_dsbd.engine")
    log.addHandler(records)
    with contextlib.ExitStack() as stack:
        try:
            llm = stack.enter_context(dsbd_llm(folder, max_num_seqs=8,
                                               speculative_config={"method": "dsbd", "width": WIDTH,
                                                                   "sources": []}))
        finally:
            log.removeHandler(records)
        out = {"log": records.messages, "runner": llm.collective_rpc(_runner_report)[0],
               "spec": repr(llm.llm_engine.vllm_config.speculative_config)}
        out["beams"] = {case: _beam_search(llm, SHORT, *case) for case in CASES}
        for name in ("steps", "target_passes", "requests", "draft_nodes", "layers_passed"):
            out[f"beam_{name}"] = metric(llm, f"vllm:dsbd_beam_{name}")
        before = llm.collective_rpc("dsbd_decisions")[0]
        prompts = SHORT + LONG
        out["greedy"] = [list(o.outputs[0].token_ids) for o in
                         llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy_params(), use_tqdm=False)]
        after = llm.collective_rpc("dsbd_decisions")[0]
        out["plain_counts"] = {k: after[k] - before[k] for k in ("iterations", "tokens", "forest_iterations",
                                                                 "draft_nodes")}
        out["draft_nodes"] = metric(llm, "vllm:dsbd_draft_nodes")
        out["spec_draft_tokens"] = metric(llm, "vllm:spec_decode_num_draft_tokens") or 0
        out["spec_drafts"] = metric(llm, "vllm:spec_decode_num_drafts") or 0
        out["seeded"] = [_seeded(llm, eos, 7), _seeded(llm, eos, 7), _seeded(llm, eos, 8)]
        bad = vllm.SamplingParams(max_tokens=40, extra_args={"dsbd_beam": {"width": 2, "max_tokens": 4, "depth": 2}})
        with pytest.raises(ValueError, match=r"\['depth'\] = 2: this DSBD engine has no forest source") as err:
            llm.generate([{"prompt_token_ids": SHORT[0]}], bad, use_tqdm=False)
        out["refused"] = str(err.value)
        out["after_refusal"] = _beam_search(llm, SHORT[:1], 2, 0.8)
        yield out


def test_starts_without_a_draft_model(nodraft):
    r = nodraft["runner"]
    assert (r["draft"], r["depth"], r["drafter"], r["draft_model"]) == (False, 0, "NoDrafter", None)
    assert (r["method"], r["model"]) == ("dsbd", None)  # the runner's build-time view of the method was put back
    # the KV cache holds the target's attention layers only: no draft layers
    assert len(r["kv_layers"]) == r["num_layers"] and all(n.startswith("model.layers.") for n in r["kv_layers"])
    # the scheduler's slots: the leaves of the widest beam request (max_beam_width 64), whatever the width
    assert nodraft["spec"] == "SpeculativeConfig(method='dsbd', model=None, num_spec_tokens=63)"
    assert any("DSBD engine: width 4, no draft model" in m for m in nodraft["log"]), nodraft["log"]
    assert not any("depth" in m for m in nodraft["log"] if m.startswith("DSBD engine:"))


@pytest.mark.parametrize("case", CASES, ids=[f"W{w}-lp{lp}" for w, lp in CASES])
def test_beam_search_equals_vllm(nodraft, plain, setup, case):
    got = nodraft["beams"][case]
    _assert_same_beams(got, plain["beams"][case])
    ends = [t[-1] for g in got for t, _ in g]
    assert setup[2] in ends, ends  # some beams finished on EOS: the EOS rule was exercised
    assert any(len(t) == len(p) + MAX_TOKENS for g, p in zip(got, SHORT) for t, _ in g)


def test_greedy_equals_plain_vllm_one_target_pass_per_token(nodraft, plain):
    assert nodraft["greedy"] == plain["greedy"]
    c = nodraft["plain_counts"]
    assert c["tokens"] == len(SHORT + LONG) * MAX_TOKENS
    assert c["iterations"] == c["tokens"]  # one token per target pass over a request: no drafts
    assert c["forest_iterations"] == 0 and c["draft_nodes"] == 0


def test_counters_show_beam_steps_and_no_drafts(nodraft):
    n_req = len(CASES) * len(SHORT)
    assert nodraft["beam_requests"] == n_req
    assert 0 < nodraft["beam_steps"] <= n_req * MAX_TOKENS
    assert nodraft["beam_target_passes"] == nodraft["beam_steps"]  # every beam step its own target pass
    assert nodraft["beam_draft_nodes"] == 0 and nodraft["beam_layers_passed"] == 0
    assert nodraft["draft_nodes"] == 0
    # the leaves a beam request schedules in vLLM's draft slots are not drafts: vLLM's spec-decode counters stay 0
    assert nodraft["spec_draft_tokens"] == 0 and nodraft["spec_drafts"] == 0


def test_seeded_beam_sampling_repeats(nodraft):
    first, again, other = nodraft["seeded"]
    for beams in first:
        assert len(beams) == WIDTH and len({tuple(t) for t, _ in beams}) == WIDTH
    assert [[t for t, _ in g] for g in first] == [[t for t, _ in g] for g in again]
    assert [[t for t, _ in g] for g in first] != [[t for t, _ in g] for g in other]


def test_beam_depth_is_refused_and_the_engine_keeps_serving(nodraft, plain):
    assert "leave 'depth' out" in nodraft["refused"]
    assert [t for t, _ in nodraft["after_refusal"][0]] == [t for t, _ in plain["beams"][(2, 0.8)][0]]
