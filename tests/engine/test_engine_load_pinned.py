"""Pinned speculation (``verify_budget`` null) in a real vLLM 0.26.0 engine on CPU, temperature 0.

The engine, prompts and oracle of ``test_engine_load.py`` with load-awareness off: the batch of 16, which drafts
nothing under a budget of 16 tokens, drafts every request's full shape (depth 3, width 2) in every step, with the
same tokens as plain greedy decoding; and no start-up probe ran.
"""
from __future__ import annotations

import pytest

import engine_utils  # noqa: F401  (sets the CPU engine environment before vllm is imported)
import vllm  # noqa: E402,F401  (a broken vLLM must fail the suite, never skip it)

import test_engine_load  # noqa: E402
from test_engine_load import DEPTH, PROMPTS, WIDTH, _llm, run_batches  # noqa: E402

greedy = test_engine_load.greedy


def _probe(worker):
    """The start-up probe of ``verify_budget="auto"`` (a GPU engine runs it at start-up; a CPU engine pins "auto"),
    run here on the CPU engine's runner: (budget, table)."""
    from vllm_dsbd.engine.load_probe import measure_budget

    return measure_budget(getattr(worker, "worker", worker).model_runner)


@pytest.fixture(scope="module")
def pinned(tiny_pair):
    target, draft = tiny_pair
    with _llm(target, model=str(draft), verify_budget=None) as llm:
        out = run_batches(llm, [("sixteen", PROMPTS)])
        out["load"] = llm.collective_rpc("dsbd_load")[0]
        out["probe"] = llm.collective_rpc(_probe)[0]
        return out


def test_pinned_drafts_the_full_shape_at_any_load(pinned, greedy):
    run = pinned["sixteen"]
    assert run["tokens"] == greedy
    assert pinned["load"]["budget"] is None and pinned["load"]["times"] is None
    # every request, every step: the configured depth (one observation per request and step, so at least one per
    # forest verified)
    drafts, nodes = run["vllm:spec_decode_num_drafts"], run["vllm:spec_decode_num_draft_tokens"]
    assert set(run["depths"]) == {DEPTH} and run["depths"][DEPTH] >= drafts
    # forests of the full width: more than width 1 x depth 3 nodes each on average (the last ones are cut by
    # max_tokens), where the budget of test_engine_load drafts none
    assert drafts >= len(PROMPTS) and DEPTH * drafts < nodes <= WIDTH * DEPTH * drafts


def test_the_auto_probe_runs_on_the_engine(pinned):
    # the probe's passes run through vLLM's own dummy run: sizes 1, 2, 4, ... from one token on, a positive time each,
    # and a budget of at least one request's full step (W * depth + W tokens), whatever the knee
    budget, times = pinned["probe"]
    sizes = sorted(times)
    assert sizes[0] == 1 and sizes == [2 ** k for k in range(len(sizes))]
    assert all(t > 0 for t in times.values())
    assert budget >= WIDTH * DEPTH + WIDTH
