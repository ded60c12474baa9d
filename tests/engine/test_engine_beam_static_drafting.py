"""Beam requests' static draft loop (``beam_drafter._draft_static``: one host copy for all depths, on the bet that
each depth's draws fill every request's width) drafts the forests the general loop (``beam_drafter._draft_loop``)
drafts, real vLLM 0.26.0 on CPU.

One engine of width 3 (tiny random Llama pair, depth 3, pinned speculation, ``beam_nodes`` 5) serves one batch of
beam requests (``extra_args["dsbd_beam"]``) mixing beam search (T = 0) and seeded beam sampling (T = 1, fixed and
dynamic width) at widths 2 and 3, with N = W or N = 5 draft nodes per depth (over-drafted), some ending at an EOS
token the model draws often. Checked:

* every drafting call the static loop answers is drafted again by the general loop on the same inputs (its passes
  rewrite the same draft K/V), and every forest is the same: tokens, parents, depths, drafted flags, forest depths,
  parent slots, and the draft joints Q (T > 0) on every entry the verification reads;
* the static loop answered every call of the batch (its bet held), and the beams equal those of the same batch with
  static drafting off (``drafter.static_drafting = False``: the loop, one host copy per depth), whose drafts were
  verified (forest nodes and passed layers counted by the engine);
* a beam sampling request whose support is narrower than its width (top-k 1 at width 2: one draw per depth) breaks
  the bet: the call falls back to the loop (``beam_static_misses``), and the beams are still the loop's;
* the target's side of the same batch: a step's verified layers of T > 0 requests all in one device call and read
  (the runner's ``dsbd_static_layers``, ``beam_sampling.verify_forests``: whether a layer passed is decided on the device) give
  the beams, forest nodes verified and layers passed of one ``beam_sampling.verify`` call per layer.
"""
from __future__ import annotations

import pytest
import torch

from engine_utils import (  # sets the CPU engine environment before vllm is imported
    dsbd_llm, metric, runner_of, tiny_pair)
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm_dsbd.engine.beams import drafter as beam_drafter  # noqa: E402

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh

STEPS, EOS, NODES = 8, 166, 5  # NODES: the engine's beam_nodes, and N of every third prompt's requests
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [7], [250, 3, 77, 12, 9], [42, 43]]


def _params(narrow: bool = False):
    out = []
    for i, _ in enumerate(PROMPTS):
        w = 2 + i % 2
        stop = {"ignore_eos": False, "eos_token_id": EOS} if i % 3 == 0 else {"ignore_eos": True}
        beam = {"width": w, "max_tokens": STEPS, "nodes": NODES if i % 3 == 1 else w, **stop}
        n = STEPS * (w + 1) + 2
        out.append(vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False,
                                       extra_args={"dsbd_beam": beam}))
        out.append(vllm.SamplingParams(temperature=1.0, seed=10 + i, max_tokens=n, ignore_eos=True, detokenize=False,
                                       extra_args={"dsbd_beam": {**beam, "dynamic_width": i % 2 == 1}}))
    if narrow:
        out[1] = vllm.SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=STEPS * 3 + 2, ignore_eos=True,
                                     detokenize=False, extra_args={"dsbd_beam": {"width": 2, "max_tokens": STEPS}})
    return out


def _same_forest(a, b) -> bool:
    fields = ("tokens", "parents", "depths", "drafted", "layers", "slots")
    if any(getattr(a, f) != getattr(b, f) for f in fields) or len(a.q) != len(b.q):
        return False
    for qa, qb in zip(a.q, b.q):  # rows of calls padded to their widest request: compare the shorter's entries
        n = min(qa.shape[0], qb.shape[0])
        if not torch.equal(qa[:n], qb[:n]) or torch.isfinite(qa[n:]).any() or torch.isfinite(qb[n:]).any():
            return False
    return True


@pytest.fixture(scope="module")
def runs():
    target, draft = tiny_pair()
    with dsbd_llm(target, max_model_len=512, max_num_seqs=len(PROMPTS) * 2,
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": 3,
                                      "width": 3, "beam_nodes": NODES, "verify_budget": None}) as llm:
        drafter = runner_of(llm).drafter
        static, loop = beam_drafter._draft_static, beam_drafter._draft_loop
        seen = {"answered": 0, "compared": 0, "same": 0, "forests": 0, "loop_calls": 0}

        def count_loop(*args):  # the engine's own calls of the loop (not this test's comparisons)
            seen["loop_calls"] += 1
            return loop(*args)

        def check(*args):  # a reader, as the static loop is (``engine/reads.py``)
            got = yield from static(*args)
            if got is not None:
                seen["answered"] += 1
                again = loop(*args)
                seen["compared"] += 1
                seen["same"] += all(_same_forest(a, b) for a, b in zip(got, again))
                seen["forests"] += sum(bool(f.tokens) for f in got)
            return got

        prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in range(2)]

        def gen(params):
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [[(b["token_ids"], b["cum_logprob"]) for b in o.kv_transfer_params["dsbd_beam"]] for o in outs]

        out = {}
        try:
            beam_drafter._draft_static, beam_drafter._draft_loop = check, count_loop
            for name, narrow in (("mixed", False), ("narrow", True)):
                drafter.static_drafting, drafter.beam_static_skip, drafter.beam_static_backoff = True, 0, 0
                m0, nodes0 = drafter.beam_static_misses, metric(llm, "vllm:dsbd_beam_draft_nodes") or 0
                out[name] = gen(_params(narrow))
                out[name + "_misses"] = drafter.beam_static_misses - m0
                out[name + "_seen"] = dict(seen)
                drafter.static_drafting = False
                nodes1 = metric(llm, "vllm:dsbd_beam_draft_nodes")
                passed1 = metric(llm, "vllm:dsbd_beam_layers_passed") or 0
                out[name + "_loop"] = gen(_params(narrow))
                out[name + "_loop_counts"] = (nodes1 - nodes0, metric(llm, "vllm:dsbd_beam_draft_nodes") - nodes1,
                                              metric(llm, "vllm:dsbd_beam_layers_passed") - passed1)
                for k in seen:
                    seen[k] = 0
            drafter.static_drafting = True
            counts = ("vllm:dsbd_beam_draft_nodes", "vllm:dsbd_beam_layers_passed")
            for layers in (True, False):  # the mixed batch again, all layers in one read, then one read per layer
                drafter.runner.dsbd_static_layers = layers
                before = [metric(llm, c) for c in counts]
                out[f"layers_{layers}"] = (gen(_params()), [metric(llm, c) - b for c, b in zip(counts, before)])
        finally:
            beam_drafter._draft_static, beam_drafter._draft_loop = static, loop
        return out


def test_static_forests_equal_the_loops(runs):
    seen = runs["mixed_seen"]
    assert seen["compared"] >= STEPS // 2 and seen["same"] == seen["compared"], seen
    assert seen["forests"] >= 2 * len(PROMPTS)


def test_static_loop_answers_every_call_and_gives_the_loops_beams(runs):
    assert runs["mixed_misses"] == 0 and runs["mixed_seen"]["answered"] > 0
    assert runs["mixed_seen"]["loop_calls"] == 0  # no call of the batch went to the loop
    assert runs["mixed"] == runs["mixed_loop"]
    static_nodes, loop_nodes, loop_passed = runs["mixed_loop_counts"]
    assert static_nodes == loop_nodes > 0 and loop_passed > 0  # the same drafts, verified, some layers passed


def test_a_failed_bet_falls_back_to_the_loop(runs):
    assert runs["narrow_misses"] >= 1 and runs["narrow_seen"]["loop_calls"] >= runs["narrow_misses"]
    assert runs["narrow_seen"]["same"] == runs["narrow_seen"]["compared"]
    assert runs["narrow"] == runs["narrow_loop"]


def test_all_layers_in_one_read_equal_one_read_per_layer(runs):
    (one, counts), (per_layer, per_counts) = runs["layers_True"], runs["layers_False"]
    assert one == per_layer and counts == per_counts
    assert counts[0] > 0 and counts[1] > 0  # forests were verified and some layers passed
    assert one == runs["mixed"]  # the default (both static) again
