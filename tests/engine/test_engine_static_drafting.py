"""The drafter's static depth loop (``DSBDDrafter._draft_static``: one host copy for all depths at any width, on the
bet that every request's draws fill its width) drafts what the general depth loop drafts, real vLLM 0.26.0 on CPU.

One engine of width 3 (tiny random Llama pair, depth 3, pinned speculation, an EOS token the model draws often)
generates each batch twice, the static drafter on (the default) and off (``drafter.static_drafting = False``: one
host copy per depth), and the tokens and vLLM's accepted-draft counts must be equal:

* batch A mixes request widths 1, 2 and 3 in one call (per-request layouts), seeded T = 1, T = 0.8 with top-k /
  top-p, greedy requests, and requests that stop at EOS (drafts ending in EOS cut a forest): every call's bet holds
  (no miss), so the static drafter drafted every wider call;
* batch B adds a request whose support is narrower than its width (top-k 2 at width 3: two draws at depth 1, not
  three): the bet fails, the call is drafted again by the loop (``static_misses`` counts it), and the tokens are
  still the loop's.
"""
from __future__ import annotations

import pytest

from engine_utils import (  # sets the CPU engine environment before vllm is imported
    eos_pair_engine, metric, runner_of, shutdown)
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh

DEPTH, MAX_TOKENS, EOS = 3, 24, 166
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [7], [250, 3, 77, 12, 9], [42, 43]]


def _batch_a():
    out = []
    for i, _ in enumerate(PROMPTS):
        w = 1 + i % 3
        out.append(vllm.SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=i % 2 == 0,
                                       extra_args={"dsbd_width": w}))
        out.append(vllm.SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=200 + i, max_tokens=MAX_TOKENS,
                                       ignore_eos=True, extra_args={"dsbd_width": 3 - i % 3}))
        out.append(vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=i % 2 == 1,
                                       extra_args={"dsbd_width": w}))
    return out


def _batch_b():
    out = _batch_a()
    out[0] = vllm.SamplingParams(temperature=1.0, top_k=2, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True,
                                 extra_args={"dsbd_width": 3})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    llm = eos_pair_engine(tmp_path_factory.mktemp("eos") / "target", EOS, width=3, depth=DEPTH,
                          max_num_seqs=len(PROMPTS) * 3)
    drafter = runner_of(llm).drafter
    static = drafter._draft_static
    held = []

    def spy(*args, **kwargs):  # a reader, as the static loop is (``engine/reads.py``)
        got = yield from static(*args, **kwargs)
        held.append(got is not None)
        return got

    prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in range(3)]

    def gen(params):
        before = metric(llm, "vllm:spec_decode_num_accepted_tokens") or 0
        toks = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        return toks, metric(llm, "vllm:spec_decode_num_accepted_tokens") - before

    out = {}
    try:
        drafter._draft_static = spy
        for name, params in (("a", _batch_a), ("b", _batch_b)):
            drafter.static_drafting, drafter._static_skip, drafter._static_backoff = True, 0, 0
            n0, m0 = len(held), drafter.static_misses
            out[name] = gen(params())
            out[name + "_static"] = (held[n0:], drafter.static_misses - m0)
            drafter.static_drafting = False
            n0 = len(held)
            out[name + "_loop"] = gen(params())
            out[name + "_loop_calls"] = len(held) - n0
    finally:
        drafter._draft_static = static
        shutdown(llm)
    return out


def test_static_drafter_drafts_what_the_loop_drafts(runs):
    toks, accepted = runs["a"]
    assert (toks, accepted) == runs["a_loop"]
    assert accepted >= 2 * len(PROMPTS)  # drafts were made and accepted
    assert any(t[-1] == EOS and len(t) < MAX_TOKENS for t in toks)  # EOS ended some requests
    assert len({tuple(t) for t in toks}) > len(PROMPTS)


def test_the_static_drafter_drafted_every_wider_call(runs):
    held, misses = runs["a_static"]
    assert len(held) >= MAX_TOKENS // (DEPTH + 1) and all(held) and misses == 0
    assert runs["a_loop_calls"] == 0  # switched off, it is never called


def test_a_failed_bet_falls_back_to_the_loop(runs):
    held, misses = runs["b_static"]
    assert misses >= 1 and misses == held.count(False)
    assert runs["b"] == runs["b_loop"]


def test_the_setting(monkeypatch):
    """``VLLM_DSBD_STATIC_DRAFT``: 1 (default) or 0 (the general loops); anything else is refused (at start-up:
    ``test_startup_refusals``)."""
    from vllm_dsbd.engine.drafter import static_draft_default

    monkeypatch.delenv("VLLM_DSBD_STATIC_DRAFT", raising=False)
    assert static_draft_default()
    for value, want in (("1", True), ("0", False), ("off", False)):
        monkeypatch.setenv("VLLM_DSBD_STATIC_DRAFT", value)
        assert static_draft_default() is want
    monkeypatch.setenv("VLLM_DSBD_STATIC_DRAFT", "sometimes")
    with pytest.raises(ValueError, match="VLLM_DSBD_STATIC_DRAFT must be 1 or 0"):
        static_draft_default()
