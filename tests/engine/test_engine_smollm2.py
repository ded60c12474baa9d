"""DSBD through a real vLLM 0.26.0 engine on CPU with the real model: SmolLM2-135M-Instruct (float32) and the committed
distilled draft (``drafts/``, assembled as the demo does).

At temperature 0 and width 1, DSBD is greedy speculative decoding: on chat prompts (EOS allowed) its outputs must equal
plain greedy vLLM's and vLLM's own ``draft_model`` speculation's with the same draft, token for token, and the metrics
must show that forests were drafted and accepted (so the equality is not that of a run without speculation). The DSBD
engine has width 2; the requests ask for width 1 (``extra_args``).

The committed EAGLE-3 head (``drafts/smollm2-135m-eagle3``, trained on the target's features; ``head_folder``), alone
and mixed with the draft-free sources: greedy tokens and ``LLM.beam_search`` results equal plain vLLM's, with layers
passed by forests that a head which reads the target's features drafted.
"""
from __future__ import annotations


import pytest

from engine_utils import dsbd_llm, metric  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm.sampling_params import BeamSearchParams  # noqa: E402
from vllm_dsbd.testing import models  # noqa: E402

from vllm_dsbd.testing.drafts import draft_folder, head_folder  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a haiku about autumn.", "def add(a, b):"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def models_and_prompts():
    target = models.smollm2_dir()
    draft, kind = draft_folder(target, 8)
    assert kind.startswith("distilled"), kind
    tok = models.load_tokenizer(target)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True)
               for p in PROMPTS]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    return target, draft, prompts


BEAM = BeamSearchParams(beam_width=2, max_tokens=10, length_penalty=0.9)


def _generate(target, prompts, spec=None, extra_args=None, beams=False):
    with dsbd_llm(target, speculative_config=spec) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, extra_args=extra_args),
                            use_tqdm=False)
        res = ([list(o.outputs[0].token_ids) for o in outs],
               {k: metric(llm, k) for k in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")})
        if beams:  # LLM.beam_search: vLLM's loop on the plain engine, in the engine on the DSBD engine
            res[1]["beams"] = [[(list(s.tokens), s.cum_logprob) for s in o.sequences] for o in
                               llm.beam_search([{"prompt_token_ids": p} for p in prompts], BEAM)]
            for k in ("steps", "target_passes", "draft_nodes", "layers_passed"):
                res[1][f"beam_{k}"] = metric(llm, f"vllm:dsbd_beam_{k}")
        return res


@pytest.fixture(scope="module")
def runs(models_and_prompts):
    target, draft, prompts = models_and_prompts
    plain, plain_m = _generate(target, prompts, beams=True)
    sd, sd_m = _generate(target, prompts, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    # pinned (verify_budget null): the beam test counts forest layers passed on the real model, and on CPU its
    # measured budget is about one request's full step, so load-aware speculation would cut the three beam requests'
    # forests to a node or none
    dsbd, dsbd_m = _generate(target, prompts, {"method": "dsbd", "model": str(draft), "num_speculative_tokens": 3,
                                               "width": 2, "verify_budget": None}, extra_args={"dsbd_width": 1},
                             beams=True)
    dsbd_m["plain_beams"] = plain_m["beams"]
    head = head_folder(target)
    assert head is not None, "drafts/smollm2-135m-eagle3 is missing"
    heads = {name: _generate(target, prompts, {"method": "dsbd", "model": str(head), "num_speculative_tokens": 3,
                                               "width": 2, "verify_budget": None, "sources": sources},
                             extra_args={"dsbd_width": 1}, beams=True)
             for name, sources in (("head", ["model"]), ("head+sources", ["model", "recycle", "lookup"]))}
    return plain, sd, sd_m, dsbd, dsbd_m, heads


@pytest.mark.parametrize("name", ["head", "head+sources"])
def test_committed_head_equals_vllm_with_layers_passed(runs, name):
    plain, dsbd_m, (greedy, m) = runs[0], runs[4], runs[5][name]
    print(name, {k: v for k, v in m.items() if k != "beams"})
    assert greedy == plain
    assert [[t for t, _ in b] for b in m["beams"]] == [[t for t, _ in b] for b in dsbd_m["plain_beams"]]
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0 and m["beam_layers_passed"] > 0


def test_width1_equals_plain_greedy_and_draft_model(runs):
    plain, sd, _, dsbd, *_ = runs
    for i, (a, b, c) in enumerate(zip(plain, sd, dsbd)):
        assert c == a, (PROMPTS[i], c, a)
        assert c == b, (PROMPTS[i], c, b)
    assert all(len(x) > 3 for x in plain)


def test_drafts_were_made_and_accepted(runs):
    _, _, sd_m, _, dsbd_m, _ = runs
    assert dsbd_m["vllm:spec_decode_num_drafts"] > 0 and dsbd_m["vllm:spec_decode_num_accepted_tokens"] > 0, dsbd_m
    assert sd_m["vllm:spec_decode_num_drafts"] > 0 and sd_m["vllm:spec_decode_num_accepted_tokens"] > 0, sd_m


def test_in_engine_beam_search_equals_vllm_beam_search(runs):
    """LLM.beam_search on the DSBD engine (beams inside one engine request) returns vLLM's own beam search results on
    the real model: same sequences in the same order, cumulative log-probabilities to 1e-4."""
    dsbd_m = runs[4]
    assert dsbd_m["beam_steps"] and dsbd_m["beam_steps"] > 0  # the beams were stepped in the engine
    print("BEAMSMOL", {k: v for k, v in dsbd_m.items() if k.startswith("beam_")})
    # at T = 0 the draft beam-searched forests off the live beams; some forest layers passed (beam steps made with
    # no target pass of their own)
    assert dsbd_m["beam_draft_nodes"] > 0 and dsbd_m["beam_layers_passed"] > 0
    assert dsbd_m["beam_steps"] == dsbd_m["beam_target_passes"] + dsbd_m["beam_layers_passed"]
    for got, expected in zip(dsbd_m["beams"], dsbd_m["plain_beams"]):
        assert [t for t, _ in got] == [t for t, _ in expected]
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(got, expected))
