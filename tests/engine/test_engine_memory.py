"""DSBD's per-step working memory is covered by what vLLM's profiling run reserves (``engine/memory.py``), real vLLM
0.26.0 on CPU, measured by torch's CPU allocator records (``mem_peak.peak_bytes``: the most bytes allocated during a
call and held at once).

Three engines on the tiny random Llama (W = 4, G = 3, pinned speculation, ``max_num_seqs`` = 24 and just enough batched
tokens for all of them at full forests): a draft model (the pair's draft), the draft-free sources (the default engine:
recycle + lookup, no draft model) and the draft mixed with the sources. On a GPU the runner's ``profile_run`` is
vLLM's profiling run inside DSBD's dummy step (``memory.profile_step``), and vLLM sizes the KV cache from its peak; on
the CPU it is vLLM's alone unless ``memory.PROFILE_CPU``, which the test sets to measure the device's profile here.
Then 24 requests at once (T = 1 with top-k and top-p, all three penalties, min_p and a logit bias, seeded: the widest
joints, the penalized copy of their rows, the rules' clones of the draft rows; full forests every step) run under the
same measurement. The sources' requests have prompts of every token of the vocabulary (each request its own order),
so the recycle table has a row after every token from the prefill on: every node has candidates (full forests).
Asserted, per engine:

* the whole run's peak (prefill with the recycle source's prompt rows, target passes, verification with the harvest
  beside it, drafting, the forests held between steps) <= the profile's;
* the bound has power: vLLM's profiling run alone (what was reserved before) peaks below the run;
* ``VLLM_DSBD_PROFILE_STEP=0`` leaves vLLM's profiling run alone (its peak below the run's; the draft model's engine);
* the run drafted full forests (vLLM's spec-decode counters: draft tokens per draft, accepted tokens).
"""
from __future__ import annotations

import dataclasses
import random

import pytest

from engine_utils import dsbd_llm, metric, runner_of  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from mem_peak import peak_bytes  # noqa: E402
from vllm_dsbd.engine import memory  # noqa: E402

W, G, R, MAX_TOKENS = 4, 3, 24, 12
VOCAB = 400  # the tiny pair's


def _spec(kind: str, draft) -> dict:
    spec = {"method": "dsbd", "num_speculative_tokens": G, "width": W, "verify_budget": None}
    if kind != "sources":
        spec["model"] = str(draft)
    if kind == "mixed":
        spec["sources"] = ["model", "recycle", "lookup"]
    return spec


@pytest.fixture(scope="module", params=["model", "sources", "mixed"])
def measured(request, tiny_pair):
    kind = request.param
    target, draft = tiny_pair
    # the draft model's engine: short prompts, just enough batched tokens; the sources': prompts of VOCAB tokens
    kw = (dict(max_num_batched_tokens=R * (1 + W * G)) if kind == "model" else
          dict(max_num_batched_tokens=2 * VOCAB, max_model_len=VOCAB + 2 * MAX_TOKENS))
    with dsbd_llm(target, max_num_seqs=R, speculative_config=_spec(kind, draft), **kw) as llm:
        runner = runner_of(llm)
        _, vllm_only = peak_bytes(runner.profile_run)  # the CPU default: vLLM's profiling run alone
        memory.PROFILE_CPU = True
        env = runner.dsbd_env
        try:
            _, profiled = peak_bytes(runner.profile_run)  # what a device's profiling run measures
            runner.dsbd_env = dataclasses.replace(env, profile_step=False)  # VLLM_DSBD_PROFILE_STEP=0
            _, switched_off = peak_bytes(runner.profile_run)
        finally:
            memory.PROFILE_CPU = False
            runner.dsbd_env = env
        params = [vllm.SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=k, max_tokens=MAX_TOKENS,
                                      ignore_eos=True, repetition_penalty=1.2, presence_penalty=0.3,
                                      frequency_penalty=0.2, min_p=0.01, logit_bias={7: 0.5}) for k in range(R)]
        if kind == "model":
            prompts = [{"prompt_token_ids": [5 + k, 17, 3 * k + 1]} for k in range(R)]
        else:  # every token once, each request its own order: a recycled row after every token
            prompts = [{"prompt_token_ids": random.Random(k).sample(range(VOCAB), VOCAB)} for k in range(R)]
        outs, step = peak_bytes(llm.generate, prompts, params, use_tqdm=False)
        counts = {k: metric(llm, f"vllm:spec_decode_num_{k}") for k in ("drafts", "draft_tokens", "accepted_tokens")}
    return dict(kind=kind, vllm_only=vllm_only, profiled=profiled, switched_off=switched_off, step=step, outs=outs,
                counts=counts)


def test_the_profile_covers_a_full_batch_of_full_forests(measured):
    m = measured
    print(f"\n{m['kind']}: peak bytes: vLLM's profiling run {m['vllm_only']:,}, with DSBD's dummy step "
          f"{m['profiled']:,}; {R} requests at W = {W}, G = {G}: {m['step']:,}")
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in m["outs"])
    assert m["step"] <= m["profiled"]
    assert m["step"] > m["vllm_only"]  # without DSBD's dummy step the profile would not cover the run


def test_the_switch_leaves_vllms_profiling_run_alone(measured):
    """``VLLM_DSBD_PROFILE_STEP=0`` (the fallback while the dummy step has not run on a GPU): no dummy step."""
    print(f"\n{measured['kind']}: peak bytes with VLLM_DSBD_PROFILE_STEP=0: {measured['switched_off']:,}")
    assert measured["switched_off"] < measured["step"] <= measured["profiled"]


def test_the_run_drafted_full_forests(measured):
    c = measured["counts"]
    print(f"\n{measured['kind']}: {c}")
    # forests were drafted and verified (the sources' recycled rows pass the flat target's penalized rows seldom)
    assert c["accepted_tokens"] >= (R if measured["kind"] == "model" else 1)
    assert c["draft_tokens"] >= 0.75 * W * G * c["drafts"]  # mostly full forests (the last steps are cut by max_tokens)
