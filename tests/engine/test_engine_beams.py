"""Beam search and beam sampling inside the DSBD engine, real vLLM 0.26.0 on CPU.

Tiny random Llama target of ``test_engine_greedy.py``, with the tokenizer's EOS moved (in a copy of the folder, as
``test_engine_stops.py`` does) to a token greedy decoding emits early, so beams really finish on EOS. Oracle: vLLM's
own ``LLM.beam_search`` (its front-end loop) on a plain engine with the same float32 weights. Checked:

* ``LLM.beam_search`` on the DSBD engine (one engine request per prompt, beams as a trie in the request's KV slots)
  returns exactly the plain engine's sequences, in order, for W = 2 and 4 with length_penalty != 1 (W = 4 also at
  temperature 1.0 and 0.7, where both engines give the T = 0 beams: beam sampling needs ``dsbd_beam``), cumulative
  log-probabilities equal to 1e-4 (GPU: ``LOGPROB_TOL``); beams did finish on EOS (not vacuous), and the engine's counters show the beam
  steps were made in the engine (``vllm:dsbd_beam_steps``) with fewer target passes than vLLM's loop makes requests;
* a batch mixing beam requests (``extra_args["dsbd_beam"]``) and plain greedy requests, with long prompts and a KV
  cache far too small (preemption asserted > 0), equals the same requests one at a time, and the plain ones equal
  plain vLLM greedy;
* with prefix caching on, a plain request whose prompt is a beam request's prompt followed by the tokens of its trie
  slots is served the prompt's blocks only (never trie blocks, whose K/V were computed under the trie's masks) and
  gives the greedy tokens of the Hugging Face model;
* a token budget too small for every leaf (6 tokens per step): a beam step split over several target passes gives
  the same beams;
* bad beam requests (width above the engine's ``max_beam_width``, n > width, a trie that may not fit max_model_len,
  structured outputs
  on beam sampling)
  raise a ValueError naming the parameter, and a good request afterwards still works;
* beam sampling (T = 1, seeded) with forests: with the target as its own draft nearly every layer passes (<= 0.5
  target passes per beam step) and a rerun repeats the beams; with the truncated draft, fixed width emits W pairs on
  every drafted layer and dynamic width (``dsbd_beam.dynamic_width``) chooses narrower layers; every returned beam's
  cumulative log-probability is the Hugging Face target's (the law itself: ``test_engine_beam_forest_law.py``).
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from engine_utils import (  # sets the CPU engine environment before vllm is imported
    LOGPROB_TOL, dsbd_llm, greedy_tokens, metric, tiny_pair, with_eos)
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm.sampling_params import BeamSearchParams, StructuredOutputsParams  # noqa: E402
from vllm_dsbd.engine.state import RELAYOUT_ENV  # noqa: E402
from vllm_dsbd.testing.models import load_hf, next_token_logits_fn  # noqa: E402
from vllm_dsbd.patches.beam_search_route import beam_outputs, beam_request_params  # noqa: E402

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh

WIDTH, DEPTH, MAX_TOKENS = 4, 3, 8
SHORT = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [7], [250, 3, 77, 12, 9]]
_rng = random.Random(99)
LONG = [[_rng.randrange(3, 400) for _ in range(110)] for _ in range(3)]
CASES = [(2, 0.8), (4, 1.3)]  # (beam width, length penalty)
TEMPERATURES = (1.0, 0.7)  # LLM.beam_search at T > 0: vLLM's beams still (it ranks raw log-probabilities)
BLOCK_SIZE, NUM_BLOCKS = 16, 16  # 256 slots: the least max_model_len allows, far less than the mixed batch needs
RELAYOUT_PROMPT = LONG[2][:20]
CACHED = LONG[0] + LONG[1][:2]  # 112 tokens: 7 full blocks; the trie starts on a block boundary


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target, draft = tiny_pair()
    g0 = greedy_tokens(next_token_logits_fn(load_hf(target)), SHORT[0], 8)
    eos = next(t for i, t in enumerate(g0) if i >= 1 and t not in g0[:i])  # the second greedy token
    folder = tmp_path_factory.mktemp("beams") / "target"
    with_eos(target, folder, eos)
    return folder, draft, eos


def _beam_search(llm, prompts, width, lp, temperature=0.0):
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, length_penalty=lp,
                                            temperature=temperature))
    return [[(list(s.tokens), s.cum_logprob) for s in o.sequences] for o in outs]


def _no_draft(params):
    """The same beam request with draft depth 0: in-engine beam search without forests (γ = 0)."""
    params.extra_args["dsbd_beam"]["depth"] = 0
    return params


def _beam_search_no_draft(llm, prompts, width, lp, eos):
    bp = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, length_penalty=lp)
    params = [_no_draft(beam_request_params(bp, eos, len(p), 256, WIDTH)) for p in prompts]
    return _read(llm, prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


def _sampled_beams(llm, eos, seed0: int, dynamic: bool = False):
    """Seeded beam sampling requests at temperature 1 (W = 4, one per short prompt, seeds ``seed0``, ``seed0 + 1``..),
    with the engine's counters and layer-width histogram over them: (beams per prompt, counter deltas)."""
    def counters():
        widths = [m for m in llm.get_metrics() if m.name == "vllm:dsbd_layer_width"]
        c = {k: metric(llm, f"vllm:dsbd_beam_{k}") or 0 for k in ("target_passes", "steps", "layers_passed")}
        return {**c, "drafted_layers": sum(m.count for m in widths), "width_sum": sum(m.sum for m in widths)}

    params = [vllm.SamplingParams(temperature=1.0, seed=seed0 + k, max_tokens=MAX_TOKENS * (WIDTH + 1) + 2,
                                  ignore_eos=True, detokenize=False,
                                  extra_args={"dsbd_beam": {"width": WIDTH, "max_tokens": MAX_TOKENS,
                                                            "eos_token_id": eos, "dynamic_width": dynamic}})
              for k in range(len(SHORT))]
    before = counters()
    outs = llm.generate([{"prompt_token_ids": p} for p in SHORT], params, use_tqdm=False)
    after = counters()
    return _read(llm, SHORT, outs), {k: after[k] - before[k] for k in after}


def _assert_target_logprobs(beams, folder):
    """Every beam's cumulative log-probability is the target's (Hugging Face model) log-probability of its tokens,
    to 1e-3 (GPU: ``LOGPROB_TOL``, vLLM's TF32 attention): the K/V and positions of every step were right, whichever
    pass (or forest layer) computed it."""
    fn = next_token_logits_fn(load_hf(folder))
    for prompt, per_prompt in zip(SHORT, beams):
        assert 1 <= len(per_prompt) <= WIDTH
        for tokens, cum in per_prompt:
            gen = tokens[len(prompt):]
            assert tokens[: len(prompt)] == prompt and 0 < len(gen) <= MAX_TOKENS
            with torch.no_grad():
                lp = sum(float(torch.log_softmax(fn(torch.tensor([tokens[:i]]))[0].double(), -1)[tokens[i]])
                         for i in range(len(prompt), len(tokens)))
            assert abs(lp - cum) < max(1e-3, LOGPROB_TOL), (tokens, lp, cum)


def _greedy_params():
    return vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(setup):
    folder, _, _ = setup
    with dsbd_llm(folder, max_num_seqs=8) as llm:
        beams = {case: _beam_search(llm, SHORT, *case) for case in CASES}
        beams.update({(*CASES[1], t): _beam_search(llm, SHORT, *CASES[1], temperature=t) for t in TEMPERATURES})
        long_beams = _beam_search(llm, LONG, WIDTH, 1.0)
        greedy = [list(o.outputs[0].token_ids) for o in
                  llm.generate([{"prompt_token_ids": p} for p in SHORT + LONG], _greedy_params(), use_tqdm=False)]
        yield {"beams": beams, "long_beams": long_beams, "greedy": greedy}


def _mixed(llm, eos):
    """Beam requests (W = 4) on the long prompts and greedy requests on every prompt, as one generate call."""
    prompts = LONG + SHORT + LONG
    bp = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS)
    params = ([beam_request_params(bp, eos, len(p), 256, WIDTH) for p in LONG]
              + [_greedy_params() for _ in SHORT + LONG])
    return prompts, params


def _read(llm, prompts, outs):
    tok = llm.get_tokenizer()
    res = []
    for p, o in zip(prompts, outs):
        if o.kv_transfer_params and "dsbd_beam" in o.kv_transfer_params:
            res.append([(list(s.tokens), s.cum_logprob) for s in
                        beam_outputs({"type": "token", "prompt_token_ids": p}, o, tok).sequences])
        else:
            res.append(list(o.outputs[0].token_ids))
    return res


def _layout(worker) -> dict:
    """Per beam request in the runner: the token list the worker holds, the one its beams' layout says (prompt, the
    beams' common prefix, the trie up to leaf 0), the prefix length and the worker's block table row per KV group."""
    runner = getattr(worker, "worker", worker).model_runner
    batch, out = runner.input_batch, {}
    for rid, st in runner.dsbd_requests._states.items():
        b, i = st.beam, batch.req_id_to_index.get(rid)
        if b is not None and i is not None and b.live:
            held = batch.token_ids_cpu[i, : batch.num_tokens_no_spec[i]].tolist()
            prompt = batch.token_ids_cpu[i, : b.prompt_len].tolist()
            blocks = [t.block_table.np[i, : t.num_blocks_per_row[i]].tolist() for t in batch.block_table.block_tables]
            out[rid] = (held, prompt + b.prefix + b.tokens[: b.live[0].node + 1], len(b.prefix), blocks)
    return out


def _relayout_run(llm, params, relayout: bool):
    """One beam request of a long prompt step by step, with (or without) the re-layout: per step the scheduler's
    token list, computed count and blocks per KV group, and the worker's lists (``_layout``). Returns (steps, beams,
    free blocks in the pool before and after)."""
    os.environ[RELAYOUT_ENV] = "1" if relayout else "0"  # read when the runner registers the request
    try:
        eng = llm.llm_engine
        scheduler = eng.engine_core.engine_core.scheduler
        kvm = scheduler.kv_cache_manager
        free0 = kvm.block_pool.get_num_free_blocks()
        rid = f"relayout-{relayout}"
        eng.add_request(rid, {"prompt_token_ids": RELAYOUT_PROMPT}, params)
        steps, final = [], None
        while eng.has_unfinished_requests():
            for o in eng.step():
                final = o if o.finished else final
            reqs = [r for r in scheduler.requests.values() if r.request_id.startswith(rid)]
            if not reqs:
                continue
            (req,) = reqs
            (layout,) = llm.collective_rpc(_layout)[0].values() or [None]
            blocks = [[b.block_id for b in m.req_to_blocks.get(req.request_id, [])]
                      for m in kvm.coordinator.single_type_managers]
            steps.append((list(req.all_token_ids), req.num_computed_tokens, layout, blocks))
        free1 = kvm.block_pool.get_num_free_blocks()
    finally:
        os.environ.pop(RELAYOUT_ENV, None)
    beams = [(list(b["token_ids"]), b["cum_logprob"]) for b in final.kv_transfer_params["dsbd_beam"]]
    return steps, beams, (free0, free1)


def _token_list(llm, prompt, params) -> list[int]:
    """vLLM's token list of a beam request (prompt + trie slots) before the step that finished it (its output tokens
    are its best beam, not the trie slots). Engine core in-process."""
    eng = llm.llm_engine
    scheduler = eng.engine_core.engine_core.scheduler
    eng.add_request("token-list", {"prompt_token_ids": prompt}, params)
    tokens = None
    while eng.has_unfinished_requests():
        (req,) = scheduler.requests.values()
        tokens = list(req.all_token_ids)
        eng.step()
    return tokens


@pytest.fixture(scope="module")
def dsbd(setup, plain):  # after plain: one engine at a time
    folder, draft, eos = setup
    # pinned (verify_budget null): test_beam_sampling_fixed_and_dynamic_width counts drafted layers of 4 concurrent
    # beam requests (16 leaves), which a measured budget of 16 tokens leaves without forests
    with dsbd_llm(folder, block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS, max_num_seqs=16,
                  enable_prefix_caching=True,
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                      "width": WIDTH, "verify_budget": None}) as llm:
        out = {}
        steps0 = metric(llm, "vllm:dsbd_beam_steps") or 0
        out["beams"] = {case: _beam_search(llm, SHORT, *case) for case in CASES}
        out["beam_steps"] = metric(llm, "vllm:dsbd_beam_steps") - steps0
        out["beam_passes"] = metric(llm, "vllm:dsbd_beam_target_passes")
        out["beam_requests"] = metric(llm, "vllm:dsbd_beam_requests")
        out["beam_nodes"] = metric(llm, "vllm:dsbd_beam_draft_nodes")
        out["beam_layers"] = metric(llm, "vllm:dsbd_beam_layers_passed")
        out["no_draft"] = {case: _beam_search_no_draft(llm, SHORT, *case, eos) for case in CASES}
        out["no_draft_nodes"] = metric(llm, "vllm:dsbd_beam_draft_nodes") - out["beam_nodes"]
        out["beams"].update({(*CASES[1], t): _beam_search(llm, SHORT, *CASES[1], temperature=t)
                             for t in TEMPERATURES})
        # prefix caching: a plain request whose prompt is a beam request's prompt followed by the tokens of the
        # beam request's slots (vLLM's token list of that request: the beams' common prefix, then the trie) must not
        # be served the blocks past the prompt
        bp = BeamSearchParams(beam_width=WIDTH, max_tokens=3 * MAX_TOKENS)
        out["probe"] = _token_list(llm, CACHED, beam_request_params(bp, eos, len(CACHED), 256, WIDTH))
        hits0 = metric(llm, "vllm:prefix_cache_hits") or 0
        (o,) = llm.generate([{"prompt_token_ids": out["probe"]}], _greedy_params(), use_tqdm=False)
        out["probe_tokens"] = list(o.outputs[0].token_ids)
        out["cache_hits"] = metric(llm, "vllm:prefix_cache_hits") - hits0
        prompts, params = _mixed(llm, eos)
        pre0 = metric(llm, "vllm:num_preemptions") or 0
        out["mixed"] = _read(llm, prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False))
        out["preempted"] = metric(llm, "vllm:num_preemptions") - pre0
        out["one_by_one"] = [_read(llm, [p], llm.generate([{"prompt_token_ids": p}], [sp], use_tqdm=False))[0]
                             for p, sp in zip(prompts, params)]
        # bad requests: a ValueError naming the parameter; the engine keeps serving
        bad = []
        for bp, match in ((BeamSearchParams(beam_width=65, max_tokens=4), r"\['width'\] = 65 is above.* up to 64 fit"),
                          (BeamSearchParams(beam_width=4, max_tokens=60), r"^max_tokens: a beam search of width 4")):
            with pytest.raises(ValueError, match=match) as err:
                llm.beam_search([{"prompt_token_ids": SHORT[0]}], bp)
            bad.append(str(err.value))
        # structured outputs on beam sampling (T > 0; beam search with them: test_engine_beam_structured.py)
        with pytest.raises(ValueError, match=r"^structured_outputs: .* temperature > 0") as err:
            llm.generate([{"prompt_token_ids": SHORT[0]}], vllm.SamplingParams(
                temperature=1.0, max_tokens=20, ignore_eos=True, structured_outputs=StructuredOutputsParams(
                    regex="[ab]+"), extra_args={"dsbd_beam": {"width": 2, "max_tokens": 4}}), use_tqdm=False)
        bad.append(str(err.value))
        with pytest.raises(ValueError, match=r"\['n'\] must be an integer in \[1, 2\]") as err:
            llm.generate([{"prompt_token_ids": SHORT[0]}], vllm.SamplingParams(
                max_tokens=20, extra_args={"dsbd_beam": {"width": 2, "max_tokens": 4, "n": 3}}), use_tqdm=False)
        bad.append(str(err.value))
        out["bad"] = bad
        out["after_bad"] = _beam_search(llm, SHORT[:1], 2, 0.8)
        # re-layout (BeamRequest._relayout) against none, on the same engine: W = 4, 30 steps (172 slots at most)
        bp = BeamSearchParams(beam_width=WIDTH, max_tokens=30)
        drop0 = metric(llm, "vllm:dsbd_beam_relayout_slots") or 0
        out["relayout"] = _relayout_run(llm, beam_request_params(bp, eos, len(RELAYOUT_PROMPT), 256, WIDTH), True)
        out["relayout_dropped"] = metric(llm, "vllm:dsbd_beam_relayout_slots") - drop0
        out["no_relayout"] = _relayout_run(llm, beam_request_params(bp, eos, len(RELAYOUT_PROMPT), 256, WIDTH), False)
        out["no_relayout_dropped"] = metric(llm, "vllm:dsbd_beam_relayout_slots") - drop0 - out["relayout_dropped"]
        # beam sampling (T = 1) with forests: fixed width, then the paper's dynamic width
        out["t1_fixed"] = _sampled_beams(llm, eos, 0)
        out["t1_dynamic"] = _sampled_beams(llm, eos, 0, dynamic=True)
        yield out


def _assert_same_beams(got, expected):
    """Per prompt: the same beams (tokens, in order) with cumulative log-probabilities equal to LOGPROB_TOL."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert [t for t, _ in g] == [t for t, _ in e]
        assert all(abs(a - b) < LOGPROB_TOL for (_, a), (_, b) in zip(g, e))


@pytest.mark.parametrize("case", CASES, ids=[f"W{w}-lp{lp}" for w, lp in CASES])
def test_beam_search_equals_vllm(dsbd, plain, setup, case):
    eos = setup[2]
    got, expected = dsbd["beams"][case], plain["beams"][case]
    assert len(got) == len(expected) == len(SHORT)
    _assert_same_beams(got, expected)
    # EOS finished some returned beams early (the EOS rule was exercised), and some beams ran the full length
    ends = [t[-1] for g in got for t, _ in g]
    assert eos in ends, ends
    assert any(len(t) == len(p) + MAX_TOKENS for g, p in zip(got, SHORT) for t, _ in g)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_beam_search_at_a_temperature_equals_vllm(dsbd, plain, temperature):
    """``LLM.beam_search`` at T > 0 means vLLM's beam search (deterministic: vLLM ranks raw log-probabilities at any
    temperature), never beam sampling: the DSBD engine's beams are the plain engine's at the same temperature, and
    those are vLLM's beams at T = 0."""
    key = (*CASES[1], temperature)
    _assert_same_beams(plain["beams"][key], plain["beams"][CASES[1]])
    _assert_same_beams(dsbd["beams"][key], plain["beams"][key])


def test_beam_search_without_a_draft_equals_vllm(dsbd, plain):
    # draft depth 0 on the request (extra_args["dsbd_beam"]["depth"]): no forest drafted, the same beams
    assert dsbd["no_draft_nodes"] == 0
    for case in CASES:
        _assert_same_beams(dsbd["no_draft"][case], plain["beams"][case])


def test_beam_steps_counted_by_the_engine(dsbd):
    # every beam step ran in the engine: at most MAX_TOKENS per request, all requests finished in the engine
    n_req = len(CASES) * len(SHORT)
    assert dsbd["beam_requests"] >= n_req
    assert 0 < dsbd["beam_steps"] <= n_req * MAX_TOKENS
    # the draft (the target's first 2 of 3 layers) made forests; some layers passed (a beam step with no target
    # pass of its own), and every other beam step took at least one target pass
    assert dsbd["beam_nodes"] > 0 and dsbd["beam_layers"] > 0
    assert dsbd["beam_passes"] >= dsbd["beam_steps"] - dsbd["beam_layers"]
    assert dsbd["beam_passes"] < dsbd["beam_steps"]


def test_mixed_batch_under_preemption_equals_one_at_a_time(dsbd, plain):
    assert dsbd["preempted"] > 0
    n = len(LONG)
    assert dsbd["mixed"][n:] == dsbd["one_by_one"][n:]
    # tokens equal; log-probabilities to 1e-4 (the batch's shape changes float rounding)
    _assert_same_beams(dsbd["mixed"][:n], dsbd["one_by_one"][:n])
    # the beam requests equal vLLM's beam search, the greedy ones plain greedy
    for g, e in zip(dsbd["mixed"][:n], plain["long_beams"]):
        assert [t for t, _ in g] == [t for t, _ in e]
    assert dsbd["mixed"][n:] == plain["greedy"]


def test_prefix_caching_never_serves_trie_blocks(dsbd, setup):
    probe = dsbd["probe"]
    # the probe's full blocks reach past the beam request's prompt into its trie slots
    assert len(probe) >= len(CACHED) + BLOCK_SIZE
    # it was served the beam request's prompt blocks (and no more: with trie blocks its tokens would differ)
    assert dsbd["cache_hits"] == len(CACHED)
    fn = next_token_logits_fn(load_hf(setup[0]))
    with torch.no_grad():
        assert dsbd["probe_tokens"] == greedy_tokens(fn, probe, MAX_TOKENS)


def test_relayout_shrinks_the_request_and_keeps_the_beams(dsbd):
    (steps, beams, free), (steps0, beams0, free0) = dsbd["relayout"], dsbd["no_relayout"]
    _assert_same_beams([beams], [beams0])
    # re-laid out: dead slots were dropped, the beams' common prefix became linear context
    assert dsbd["relayout_dropped"] > 0 and dsbd["no_relayout_dropped"] == 0
    assert max(layout[2] for _, _, layout, _ in steps if layout) > 0
    assert all(layout[2] == 0 for _, _, layout, _ in steps0 if layout)
    # after every step the scheduler's token list, the worker's and the beams' layout agree, every slot but the last
    # token is computed (vLLM's next pass starts at the last token), and the scheduler's blocks are the worker's
    for sched, computed, layout, blocks in steps + steps0:
        if layout is not None:
            held, expected, _, worker_blocks = layout
            assert sched == held == expected
            assert computed == len(sched) - 1
            assert blocks == worker_blocks
    # the request holds fewer slots and blocks with the re-layout (its list shrank and blocks went back to the pool;
    # without it, every slot ever kept stays), and every block is back in the pool when it finishes
    assert max(len(t) for t, *_ in steps) < max(len(t) for t, *_ in steps0)
    assert len(steps[-1][0]) < len(steps0[-1][0])
    nblocks = [len(b[0]) for *_, b in steps if b[0]]
    assert any(b < a for a, b in zip(nblocks, nblocks[1:]))  # handed back during the request
    assert max(nblocks) < max(len(b[0]) for *_, b in steps0 if b[0])
    assert free[0] == free[1] and free0[0] == free0[1]


def test_bad_beam_requests_are_refused_and_the_engine_keeps_serving(dsbd, plain):
    assert len(dsbd["bad"]) == 4
    assert [t for t, _ in dsbd["after_bad"][0]] == [t for t, _ in plain["beams"][(2, 0.8)][0]]


@pytest.fixture(scope="module")
def self_draft(setup, dsbd):  # after dsbd: one engine at a time
    """DSBD full width with the target as its own draft: the draft's beam search is the target's, so (up to float
    rounding between the draft's and the target's passes) every forest layer passes."""
    folder, _, eos = setup
    # pinned (verify_budget null): the tests count full forests passing; load-aware speculation would shrink them
    with dsbd_llm(folder, max_num_seqs=8,
                  speculative_config={"method": "dsbd", "model": str(folder), "num_speculative_tokens": DEPTH,
                                      "width": WIDTH, "verify_budget": None}) as llm:
        beams = {case: _beam_search(llm, SHORT, *case) for case in CASES}
        m = {k: metric(llm, f"vllm:dsbd_beam_{k}") for k in ("target_passes", "steps", "draft_nodes", "layers_passed")}
        t1 = [_sampled_beams(llm, eos, 7) for _ in range(2)]  # the same seeds twice
        yield beams, m, t1


def test_full_width_forest_with_a_perfect_draft(self_draft, plain):
    beams, m, _ = self_draft
    for case in CASES:
        _assert_same_beams(beams[case], plain["beams"][case])
    # depth 3: up to 4 beam steps per target pass; the first step of a request (after its prefill) and the steps
    # cut short by max_tokens or EOS take more
    assert m["layers_passed"] > 0 and m["draft_nodes"] >= m["layers_passed"] * 2
    assert m["steps"] == m["target_passes"] + m["layers_passed"]
    assert m["target_passes"] / m["steps"] <= 0.5, m


def test_beam_sampling_with_a_perfect_draft(self_draft, setup):
    # T = 1, W = 4, depth 3: with Q = P (up to rounding) nearly every draft is accepted, so nearly every layer passes
    (first, c), (again, _) = self_draft[2]
    print("T = 1 beam sampling, the target as its own draft:", c)
    assert c["layers_passed"] > 0 and c["steps"] == c["target_passes"] + c["layers_passed"]
    assert c["target_passes"] / c["steps"] <= 0.5, c
    assert c["drafted_layers"] > 0 and c["width_sum"] == WIDTH * c["drafted_layers"]  # fixed width: K = W
    assert [[t for t, _ in b] for b in again] == [[t for t, _ in b] for b in first]  # seeded: repeats
    assert all(len(b) == WIDTH for b in first)
    _assert_target_logprobs(first, setup[0])


def test_beam_sampling_fixed_and_dynamic_width(dsbd, setup):
    (fixed, cf), (dynamic, cd) = dsbd["t1_fixed"], dsbd["t1_dynamic"]
    print("T = 1 beam sampling, fixed width:", cf, "dynamic width:", cd)
    for c in (cf, cd):
        assert c["steps"] == c["target_passes"] + c["layers_passed"] and c["drafted_layers"] > 0
    assert cf["width_sum"] == WIDTH * cf["drafted_layers"]  # fixed width: every drafted layer emits W pairs
    assert cd["width_sum"] < WIDTH * cd["drafted_layers"]  # dynamic width: some layers chose K < W
    assert [[t for t, _ in b] for b in fixed] != [[t for t, _ in b] for b in dynamic]
    # fixed width keeps W beams; dynamic width may end a request with fewer (a last layer of width K < W)
    assert all(len(b) == WIDTH for b in fixed)
    _assert_target_logprobs(fixed, setup[0])
    _assert_target_logprobs(dynamic, setup[0])


@pytest.fixture(scope="module")
def small_budget(setup, self_draft):  # after self_draft: one engine at a time
    """A DSBD engine whose token budget (6 per step) cannot schedule every leaf of the 5 beam requests at once:
    vLLM schedules some leaves of a request in one pass and the rest in later passes (the beam step waits)."""
    folder, draft, _ = setup
    with dsbd_llm(folder, max_num_batched_tokens=6, max_num_seqs=4,
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                      "width": WIDTH}) as llm:
        beams = {case: _beam_search(llm, SHORT, *case) for case in CASES}
        yield beams, metric(llm, "vllm:dsbd_beam_target_passes"), metric(llm, "vllm:dsbd_beam_steps")


def test_leaves_split_across_passes_give_the_same_beams(small_budget, plain):
    beams, passes, steps = small_budget
    assert passes > steps > 0  # some beam steps took more than one target pass
    for case in CASES:
        _assert_same_beams(beams[case], plain["beams"][case])
