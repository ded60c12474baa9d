"""An engine without a draft model drafts from the draft-free sources (the default ``["recycle", "lookup"]``,
``engine/source_drafter.py``) and stays exact at T = 0. Real vLLM 0.26.0 on CPU, SmolLM2-135M-Instruct in float32,
code-edit prompts (a function to copy with changes: what lookup and the recycled prompt rows cover).

One plain engine (vLLM's own ``LLM.beam_search`` and greedy decoding, the oracles), then one DSBD engine
``{"method": "dsbd", "width": 4}`` (cost model off: every step drafts, as the tests of forests do). Checked:

* the engine drafts from the sources: its runner's drafter is the ``SourceDrafter``, depth 3 by default;
* ``LLM.beam_search`` (W = 4, T = 0) returns vLLM's beams token for token, with forest nodes verified, layers passed
  and fewer target passes than beam steps (the engine's counters);
* plain greedy requests equal plain vLLM greedy token for token, at >= 2 tokens per target pass on these prompts
  (the engine's counts; deterministic at T = 0 with pinned shapes: measured 2.3 and 2.9);
* the engine as a user gets it (cost model on): greedy equal to plain vLLM, and forests verified with more tokens
  than target passes (the engine's counts); its first requests' prompt rows not recycled (no verdict of the step
  clock yet), where the pinned engine recycles every prompt row but the last.
"""
from __future__ import annotations

import contextlib

import pytest

from engine_utils import dsbd_llm, metric  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm.sampling_params import BeamSearchParams  # noqa: E402

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh (engine_tests)

WIDTH, BEAM_TOKENS, GREEDY_TOKENS = 4, 24, 40
CODE = [
    'def add(a, b):\n    """Add two numbers."""\n    result = a + b\n    return result\n\n\n'
    "def scale(values, factor):\n    out = []\n    for v in values:\n        out.append(v * factor)\n    return out\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        word = word.lower()\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
]


@pytest.fixture(scope="module")
def setup():
    from vllm_dsbd.testing.models import load_tokenizer, smollm2_dir

    folder = smollm2_dir()
    tok = load_tokenizer(folder)
    prompts = []
    for code in CODE:
        ids = tok.apply_chat_template([{"role": "user", "content": "Add type hints to this Python code and return "
                                        f"the whole code.\n\n{code}"}], add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return folder, prompts


def _beams(llm, prompts):
    out = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                          BeamSearchParams(beam_width=WIDTH, max_tokens=BEAM_TOKENS))
    return [[(list(s.tokens), s.cum_logprob) for s in o.sequences] for o in out]


def _greedy(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        vllm.SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _drafter(worker) -> dict:
    runner = getattr(worker, "worker", worker).model_runner
    return {"drafter": type(runner.drafter).__name__, "depth": runner.dsbd_cfg.depth,
            "sources": list(runner.dsbd_cfg.sources)}


@pytest.fixture(scope="module")
def runs(setup):
    folder, prompts = setup
    out = {"prompts": prompts}
    kw = dict(max_model_len=1024, max_num_seqs=4)
    with dsbd_llm(folder, **kw) as llm:
        out["vllm_beams"], out["vllm_greedy"] = _beams(llm, prompts), _greedy(llm, prompts)
    with contextlib.ExitStack() as stack:
        llm = stack.enter_context(dsbd_llm(folder, **kw, speculative_config={"method": "dsbd", "width": WIDTH}))
        out["runner"] = llm.collective_rpc(_drafter)[0]
        out["beams"] = _beams(llm, prompts)
        out["beam"] = {n: metric(llm, f"vllm:dsbd_beam_{n}") for n in ("steps", "target_passes", "draft_nodes",
                                                                         "layers_passed")}
        per, rows0 = [], llm.collective_rpc("dsbd_load")[0]["prompt_rows"]
        for p in prompts:  # one at a time: each prompt's own tokens per target pass
            before = llm.collective_rpc("dsbd_decisions")[0]
            g = _greedy(llm, [p])[0]
            after = llm.collective_rpc("dsbd_decisions")[0]
            per.append((g, {k: after[k] - before[k] for k in ("iterations", "tokens", "forest_iterations")}))
        out["greedy"] = per
        out["prompt_rows"] = llm.collective_rpc("dsbd_load")[0]["prompt_rows"] - rows0
    # the engine as a user gets it: the same, cost model on (nothing overridden)
    user = {"method": "dsbd", "width": WIDTH, "cost_model": "auto"}  # "auto" is the default; named for engine_utils
    with dsbd_llm(folder, **kw, speculative_config=user) as llm:
        before = llm.collective_rpc("dsbd_decisions")[0]
        out["user_greedy"] = _greedy(llm, prompts)
        after = llm.collective_rpc("dsbd_decisions")[0]
        out["user_counts"] = {k: after[k] - before[k] for k in ("iterations", "tokens", "forest_iterations")}
        load = llm.collective_rpc("dsbd_load")[0]
        out["user_depths"], out["user_prompt_rows"] = load["depths"], load["prompt_rows"]
    return out


def test_drafts_from_the_sources(runs):
    assert runs["runner"] == {"drafter": "SourceDrafter", "depth": 3, "sources": ["recycle", "lookup"]}


def test_beam_search_equals_vllm_with_layers_passed(runs):
    for got, want in zip(runs["beams"], runs["vllm_beams"]):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)
    c = runs["beam"]
    print("beam counters:", c)
    assert c["draft_nodes"] > 0 and c["layers_passed"] > 0
    assert c["target_passes"] < c["steps"]


def test_greedy_equals_plain_vllm_at_two_tokens_per_pass(runs):
    for (got, c), want in zip(runs["greedy"], runs["vllm_greedy"]):
        print("greedy counts:", c, f"{c['tokens'] / c['iterations']:.2f} tokens per target pass")
        assert got == want
        assert c["tokens"] == GREEDY_TOKENS and c["forest_iterations"] > 0
        assert c["tokens"] >= 2.0 * c["iterations"]


def test_the_users_engine_drafts_from_the_sources_and_equals_plain_vllm(runs):
    """Cost model on: the sources cost no draft pass, so on these prompts it drafts (the engine's counts). Its first
    requests' prompt rows are not recycled: they are taken only where forests are measured to pay at the batch size,
    and the step clock has measured nothing at their prefill; the pinned engine (no clock) takes them,
    so the count is not vacuous."""
    c = runs["user_counts"]
    print("user's engine greedy counts:", c, "depths chosen:", runs["user_depths"], "prompt rows:",
          runs["user_prompt_rows"], "pinned:", runs["prompt_rows"])
    assert runs["user_greedy"] == runs["vllm_greedy"]
    assert c["forest_iterations"] > 0 and c["tokens"] > c["iterations"]
    assert runs["user_prompt_rows"] == 0 and runs["prompt_rows"] == sum(len(p) - 1 for p in runs["prompts"])
