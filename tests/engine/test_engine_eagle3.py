"""A DSBD engine drafts its forests with an EAGLE-3 head (``engine/head.py``), real vLLM 0.26.0 on CPU.

The head: a random one written in the public EAGLE-3 folder format (``vllm_dsbd.testing.heads``: ``config.json`` with
``LlamaForCausalLMEagle3`` and ``draft_vocab_size``, ``midlayer.*`` / ``fc`` / ``norm`` / ``lm_head`` / ``d2t`` /
``t2d`` weights, no embedding), its draft vocabulary 300 of the target's 400 ids (q = 0 outside it). Checked:

* it loads as vLLM's ``Eagle3LlamaForCausalLM`` through ``speculative_config={"method": "dsbd", "model": HEAD}`` and
  the target returns auxiliary hidden states; draft tokens outside the draft vocabulary are never proposed;
* the features the head's catch-up rows take are the target's: at position p, ``fc`` of the Hugging Face target's
  hidden states of the auxiliary layers at p - 1 (zeros at position 0), for every catch-up pass of the run;
* so are a beam request's (each catch-up row: the feature of its parent slot, linear or in the trie, through the
  beam steps' K/V moves);
* plain greedy decoding (widths 1, 2, 4) equals plain vLLM, and a T = 0 beam request equals vLLM's own
  ``LLM.beam_search``, with forests drafted by the head (the engine's counters);
* on a target whose law a head can match (the peaky 4-layer target with its layers silenced, a head computing that
  law from each node's token, logits x 3, 200 of 300 ids; ``testing.heads.bigram``; its aux layers given in its
  config): greedy decoding equals plain vLLM with layers passed, and the law at T = 0.9 of a plain request's first 2
  tokens (W = 4) equals plain vLLM's (two-sample chi-square, p = 1e-6, 800 requests each, as
  ``test_engine_law.py``), and the same requests with the with-replacement rule planted into the engine's
  verification are rejected by the same statistic (measured: chi2 17.1 against 72.2; planted 268 against 61.9).
"""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from engine_utils import (dsbd_llm, metric, peaky_pair, runner_of, slow_target,  # the CPU engine environment first
                          tiny_pair)
import vllm  # noqa: E402

import chisq  # noqa: E402
from planted import planted_core_layer  # noqa: E402
from vllm.sampling_params import BeamSearchParams  # noqa: E402
from vllm_dsbd.testing.heads import bigram_target, draft_ids, head_folder  # noqa: E402
from vllm_dsbd.testing.models import load_hf  # noqa: E402

pytestmark = pytest.mark.slow

DEPTH, WIDTH, MAX_TOKENS, DRAFT_VOCAB = 3, 4, 16, 300
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [250, 3, 77, 12, 9]]
BEAM = BeamSearchParams(beam_width=2, max_tokens=6)
LAW_N, LAW_TOKENS, HOT = 800, 4, 0.9
SLOW_TARGET = 0.02  # seconds added to every target pass of the user's engine (slow_target)
PLANTED = "with_replacement"  # the wrong rule planted into the engine (planted.py)
LAW_PROMPT = [(7 * i + 3) % 290 + 5 for i in range(40)]


def _greedy(llm, widths):
    reqs = [(w, p) for w in widths for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for _, p in reqs],
                        [vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                             extra_args=None if w is None else {"dsbd_width": w}) for w, _ in reqs],
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _beams(llm):
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:2]], BEAM)
    return [[list(s.tokens) for s in o.sequences] for o in outs]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return head_folder(tiny_pair()[0], tmp_path_factory.mktemp("head") / "eagle-head", DRAFT_VOCAB, seed=0)


@pytest.fixture(scope="module")
def plain():
    with dsbd_llm(tiny_pair()[0], max_num_seqs=4) as llm:
        return _greedy(llm, [None]), _beams(llm)


@pytest.fixture(scope="module")
def run(head, plain):  # after plain: one engine at a time
    with dsbd_llm(tiny_pair()[0], max_num_seqs=4,
                  speculative_config={"method": "dsbd", "model": str(head), "num_speculative_tokens": DEPTH,
                                      "width": WIDTH, "verify_budget": None}) as llm:
        runner = runner_of(llm)
        drafter = runner.drafter
        calls, real = [], drafter.forward_ragged

        def spy(input_ids, positions, *args, **kwargs):  # the catch-up passes' positions and hidden inputs
            out = real(input_ids, positions, *args, **kwargs)
            hidden = args[7] if len(args) > 7 else kwargs.get("hidden")
            if args[6] == 0 and hidden is not None:
                calls.append((np.asarray(positions).copy(), hidden.detach().cpu().clone()))
            return out

        drafter.forward_ragged = spy
        try:
            solo = [list(llm.generate([{"prompt_token_ids": PROMPTS[0]}],  # alone: every catch-up row is its own
                                      vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                                      use_tqdm=False)[0].outputs[0].token_ids)]
            solo_calls = list(calls)
        finally:
            del drafter.forward_ragged
        passes0 = drafter.forward_passes
        drafted, propose = set(), runner.propose_draft_token_ids

        def spy_propose(*args, **kwargs):  # the plain requests' draft tokens (forest nodes)
            out = propose(*args, **kwargs)
            drafted.update(t for row in out for t in row)
            return out

        runner.propose_draft_token_ids = spy_propose
        try:
            greedy = _greedy(llm, [1, 2, WIDTH])
        finally:
            del runner.propose_draft_token_ids
        beam_calls, real_bf = [], drafter.beam_features

        def spy_beam_features(st, slots):  # the beam catch-up's parent slots, the trie then, and what they got
            got = real_bf(st, slots)
            b = st.beam
            beam_calls.append((list(b.prefix), b.base, list(b.tokens), list(b.parents), list(slots), got.cpu()))
            return got

        drafter.beam_features = spy_beam_features
        try:
            one_beam = llm.beam_search([{"prompt_token_ids": PROMPTS[1]}], BeamSearchParams(beam_width=2, max_tokens=8))
        finally:
            del drafter.beam_features
        beam_ref = {}
        for prefix, base, toks, parents, slots, _ in beam_calls:  # each slot's context: linear, or its trie path
            for x in slots:
                if x < 0 or (x, tuple(toks), base) in beam_ref:
                    continue
                ctx = (PROMPTS[1] + prefix)[: x + 1] if x < base else None
                if ctx is None:
                    path, nd = [], x - base
                    while nd >= 0:
                        path.append(toks[nd])
                        nd = parents[nd]
                    ctx = PROMPTS[1] + prefix + path[::-1]
                beam_ref[(x, tuple(toks), base)] = drafter.combine(_hf_aux(ctx)[-1:]).detach().cpu()[0]
        beams = _beams(llm)
        out = dict(beam_calls=beam_calls, beam_ref=beam_ref, one_beam=one_beam,model=type(drafter.model).__name__, head=drafter.head, aux=runner.use_aux_hidden_state_outputs,
                   greedy=greedy, beams=beams, passes=drafter.forward_passes - passes0,
                   nodes=metric(llm, "vllm:dsbd_draft_nodes"), beam_nodes=metric(llm, "vllm:dsbd_beam_draft_nodes"),
                   fc=drafter.combine(_hf_aux(PROMPTS[0] + solo[0])).detach().cpu(), calls=solo_calls, solo=solo,
                   drafted=drafted)
    return out


def test_public_format_head_loads(run, head):
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] < cfg["vocab_size"]
    assert run["model"] == "Eagle3LlamaForCausalLM" and run["head"] and run["aux"]
    assert run["drafted"] and run["drafted"] <= set(draft_ids(head))  # q = 0 outside the draft vocabulary


def test_greedy_and_beam_search_equal_vllm(run, plain):
    greedy, beams = plain
    assert run["greedy"] == greedy * 3  # widths 1, 2, 4
    assert run["beams"] == beams
    print(f"head passes {run['passes']}, forest nodes {run['nodes']}, beam forest nodes {run['beam_nodes']}")
    assert run["passes"] > 0 and run["nodes"] > 0 and run["beam_nodes"] > 0


def test_catch_up_features_are_the_targets(run, head):
    """Every catch-up row of the first request's run (prompt PROMPTS[0], alone in its batch) took ``fc`` of the target's
    auxiliary hidden states one position earlier (the Hugging Face target, hidden states after 0, 1 and 2 layers: vLLM's
    default layers for 3 layers), zeros at position 0."""
    feats = run["fc"]  # the head's fc of the reference auxiliary states, one row per position of the sequence
    ref = torch.cat([torch.zeros(1, feats.shape[1]), feats])  # row p: the feature position p takes
    checked = 0
    for pos, hidden in run["calls"]:
        assert hidden.shape[0] == len(pos)
        torch.testing.assert_close(hidden, ref[torch.from_numpy(pos)], atol=2e-4, rtol=2e-4)
        checked += len(pos)
    assert checked >= len(PROMPTS[0]) + MAX_TOKENS // 2, checked


def _hf_aux(seq: list[int]) -> torch.Tensor:
    """The Hugging Face target's hidden states after 0, 1 and 2 layers at every position of ``seq``, concatenated
    (vLLM's auxiliary states for a 3-layer Llama: layers (2, 1, 0), returned in layer order)."""
    model = load_hf(tiny_pair()[0], dtype=torch.float32)
    with torch.no_grad():
        hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    return torch.cat([hs[k][0] for k in (0, 1, 2)], -1)


def test_beam_catch_up_features_are_the_targets(run):
    """Every catch-up row of a beam request (width 2, 8 steps, alone) took ``fc`` of the target's auxiliary states at
    its parent slot (the previous linear slot, or its parent in the trie: HF over that slot's own context), zeros for
    slot -1, through the forest steps' K/V moves."""
    checked = 0
    for prefix, base, toks, parents, slots, got in run["beam_calls"]:
        for x, row in zip(slots, got):
            want = torch.zeros_like(row) if x < 0 else run["beam_ref"][(x, tuple(toks), base)]
            torch.testing.assert_close(row, want, atol=2e-4, rtol=2e-4)
            checked += 1
    assert len(run["beam_calls"]) >= 3 and checked > len(PROMPTS[1]) + 4, (len(run["beam_calls"]), checked)


# ---------------------------------------------------------------------------------------------------------------------
# the law at T > 0, and a planted wrong rule
def _law_sample(llm, seed0):
    outs = llm.generate([{"prompt_token_ids": LAW_PROMPT}] * LAW_N,
                        [vllm.SamplingParams(temperature=HOT, max_tokens=LAW_TOKENS, ignore_eos=True,
                                             seed=None if seed0 is None else seed0 + i) for i in range(LAW_N)],
                        use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids[:2]) for o in outs)


def _counters(llm) -> tuple[int, int]:
    """vLLM's counters of a DSBD engine: forest nodes drafted, layers passed."""
    return tuple(int(metric(llm, f"vllm:spec_decode_num_{k}") or 0) for k in ("draft_tokens", "accepted_tokens"))


@pytest.fixture(scope="module")
def law(run, tmp_path_factory):  # after run: one engine at a time
    """The peaky target with its layers silenced (``bigram_target``: its law is its zero-layer one) and a head that
    computes that law from each node's token, its logits x 3 (a cold draft, as ``test_engine_law.py``'s: its first
    draw carries most of its mass, so the planted rule's bias shows), on 200 of the 300 ids."""
    root = tmp_path_factory.mktemp("bigram")
    target = bigram_target(peaky_pair()[0], root / "target")
    head = head_folder(target, root / "head", 200, seed=1, aux_layers=[1, 2, 3], bigram=3.0)
    with dsbd_llm(target, max_num_seqs=4) as llm:
        out = {"plain": _law_sample(llm, None), "plain_greedy": _greedy(llm, [None])}
    with dsbd_llm(target, speculative_config={"method": "dsbd", "model": str(head), "num_speculative_tokens": 2,
                                              "width": WIDTH, "verify_budget": None}) as llm:
        runner = runner_of(llm)
        before = _counters(llm)
        out["greedy"] = _greedy(llm, [WIDTH])
        out["greedy_counters"] = tuple(a - b for a, b in zip(_counters(llm), before))
        for name in ("exact", "planted"):
            with planted_core_layer(PLANTED if name == "planted" else None):
                before = _counters(llm)
                out[name] = _law_sample(llm, 70_000)
                out[name + "_counters"] = tuple(a - b for a, b in zip(_counters(llm), before))
        out["aux_layers"] = runner.model.model.aux_hidden_state_layers
    return out


def test_agreeing_head_greedy_equals_vllm_with_layers_passed(law):
    nodes, passed = law["greedy_counters"]
    print(f"greedy, agreeing head: {nodes} nodes, {passed} layers passed")
    assert law["greedy"] == law["plain_greedy"]
    assert nodes > 0 and passed > 0


def test_head_law_equals_plain_vllm_and_planted_rule_is_rejected(law):
    nodes, passed = law["exact_counters"]
    print(f"head-drafted forests: {nodes} nodes, {passed} layers passed")
    assert nodes > 0 and passed > 0
    assert tuple(law["aux_layers"]) == (1, 2, 3)  # the head's eagle_aux_hidden_state_layer_ids
    stat, df, thr = chisq.two_sample(law["exact"], law["plain"])
    chisq.report("first 2 tokens, head-drafted W=4 vs plain vLLM", stat, df, thr, n=LAW_N, two_sample=True)
    assert df >= 3 and stat < thr
    assert chisq.mde_tv(LAW_N, df, two_sample=True) <= 0.27  # measured df 24: MDE TV 0.239 (2 tokens only)
    bad, _, bad_thr = chisq.two_sample(law["planted"], law["plain"])
    chisq.report(f"  {PLANTED} rule planted (must differ)", bad, df, bad_thr)
    assert bad > bad_thr


def test_default_engine_with_a_head_serves(head, plain, law):  # after law: one engine at a time
    """The user's default settings (load-aware speculation and the cost model measured at start-up, which time the
    head's passes with a hidden input and the target's tuple output) start and decode greedily as plain vLLM. The
    target is then made ``SLOW_TARGET`` dearer per pass and the table measured again (``slow_target``): on these tiny
    models no forest pays by the table, forest work included, and the check below needs forests."""
    with dsbd_llm(tiny_pair()[0], max_num_seqs=4,
                  speculative_config={"method": "dsbd", "model": str(head), "cost_model": "auto"}) as llm:
        assert runner_of(llm).dsbd_cost.draft_step > 0  # the start-up probe timed a step's forest work
        slow_target(llm, SLOW_TARGET)
        assert _greedy(llm, [None]) == plain[0]
        assert runner_of(llm).dsbd_cost is not None
        # non-vacuous: the head drafted (with no forest the equality above is plain vLLM's own decoding)
        assert (metric(llm, "vllm:spec_decode_num_draft_tokens") or 0) > 0
