"""DSBD in a real vLLM 0.26.0 engine on CPU: EOS, stop tokens, stop strings and max_tokens behave as in plain vLLM.

A forest can accept several tokens in one step, past an EOS, a stop token, a stop string or the token budget; vLLM
must still end the request where plain decoding would. Tiny random Llama pair of ``test_engine_greedy.py``, with the
tokenizer's EOS moved (in a copy of the target folder) to a token that greedy decoding of prompt 0 emits early, so
EOS really ends generation. Temperature 0; DSBD engine width 4, depth 3; plain vLLM as the oracle. Checked:

* width 1 (per request) equals plain vLLM in token ids, text, finish_reason and stop_reason, with EOS allowed, with
  ``stop_token_ids`` and with ``max_tokens`` 1 and 2 (less than one forest can accept), and each of those
  conditions did end its request early (so the comparison is not vacuous);
* stop strings: text, finish_reason and stop_reason equal plain vLLM's; token ids equal vLLM's own ``draft_model``
  speculation's (a third engine). vLLM 0.26 cuts the *text* at a stop string but keeps every token id of the step
  that completed it, so with any speculation the token ids may run past plain decoding's (seen here: one more);
* widths 2 and 4 with EOS allowed equal ``core.reference.dsbd_decode(eos_token_id=...)`` (mode "sample", the
  engine's default, with the engine's iteration structure), and ``max_tokens`` 1 and 2 give exactly that many tokens.
"""
from __future__ import annotations


import pytest

from engine_utils import (  # sets the CPU engine environment before vllm is imported
    dsbd_llm, greedy_tokens, metric, tiny_pair, with_eos)
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm_dsbd.core.reference import dsbd_decode  # noqa: E402
from vllm_dsbd.testing.models import load_hf, next_token_logits_fn  # noqa: E402

WIDTH, DEPTH, MAX_TOKENS = 4, 3, 24
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target, draft = tiny_pair()
    target_fn, draft_fn = next_token_logits_fn(load_hf(target)), next_token_logits_fn(load_hf(draft))
    g0 = greedy_tokens(target_fn, PROMPTS[0], 8)
    eos = next(t for i, t in enumerate(g0) if i >= 3 and t not in g0[:i])  # first new token from position 3 on
    folder = tmp_path_factory.mktemp("eos") / "target"
    with_eos(target, folder, eos)
    return folder, draft, eos, target_fn, draft_fn


def _llm(target, **kw):
    return dsbd_llm(target, max_num_seqs=8, **kw)


def _cases(stop_token, stop_str):
    """(name, prompt, SamplingParams kwargs) of every check; width is added per engine."""
    cases = [(f"eos p{i}", p, {}) for i, p in enumerate(PROMPTS)]
    cases += [("stop_token_ids", PROMPTS[1], {"stop_token_ids": [stop_token]}),
              ("stop string", PROMPTS[2], {"stop": [stop_str]}),
              ("max_tokens 1", PROMPTS[0], {"max_tokens": 1, "ignore_eos": True}),
              ("max_tokens 2", PROMPTS[1], {"max_tokens": 2, "ignore_eos": True})]
    return cases


def _run(llm, cases, width=None):
    params = []
    for _, _, kw in cases:
        kw = {"max_tokens": MAX_TOKENS, **kw}
        if width is not None:
            kw["extra_args"] = {"dsbd_width": width}
        params.append(vllm.SamplingParams(temperature=0, **kw))
    outs = llm.generate([{"prompt_token_ids": p} for _, p, _ in cases], params, use_tqdm=False)
    return {name: o.outputs[0] for (name, _, _), o in zip(cases, outs)}


@pytest.fixture(scope="module")
def runs(setup):
    folder, draft, eos, target_fn, _ = setup
    g1 = greedy_tokens(target_fn, PROMPTS[1], 10)
    stop_token = next(t for i, t in enumerate(g1) if i >= 3 and t not in g1[:i] and t != eos)
    with _llm(folder) as plain:
        probe = plain.generate([{"prompt_token_ids": PROMPTS[2]}],
                               vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].text
        stop_str = probe[len(probe) // 2 : len(probe) // 2 + 2]
        cases = _cases(stop_token, stop_str)
        plain_out = _run(plain, cases)
    with _llm(folder, speculative_config={"method": "draft_model", "model": str(draft),
                                          "num_speculative_tokens": DEPTH}) as sd:
        draft_model = _run(sd, cases)
    with _llm(folder, speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                          "width": WIDTH}) as llm:
        dsbd = {w: _run(llm, cases, w) for w in (1, 2, 4)}
        drafts = metric(llm, "vllm:spec_decode_num_drafts")
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
    return dict(plain=plain_out, draft_model=draft_model, dsbd=dsbd, stop_token=stop_token, stop_str=stop_str, drafts=drafts,
                accepted=accepted, probe=probe)


def test_conditions_end_requests_early(setup, runs):
    plain, eos = runs["plain"], setup[2]
    assert plain["eos p0"].finish_reason == "stop" and len(plain["eos p0"].token_ids) < MAX_TOKENS
    assert plain["eos p0"].token_ids[-1] == eos
    assert plain["stop_token_ids"].finish_reason == "stop" and plain["stop_token_ids"].stop_reason == runs["stop_token"]
    assert len(plain["stop_token_ids"].token_ids) < MAX_TOKENS
    assert plain["stop string"].finish_reason == "stop" and plain["stop string"].stop_reason == runs["stop_str"]
    assert len(plain["stop string"].text) < len(runs["probe"])
    assert len(plain["max_tokens 1"].token_ids) == 1 and len(plain["max_tokens 2"].token_ids) == 2
    assert runs["drafts"] > 0 and runs["accepted"] > 0  # forests were verified and accepted


def test_width1_equals_plain(runs):
    for name, p in runs["plain"].items():
        d = runs["dsbd"][1][name]
        if name == "stop string":
            assert (d.text, d.finish_reason, d.stop_reason) == (p.text, p.finish_reason, p.stop_reason)
            assert list(d.token_ids) == list(runs["draft_model"][name].token_ids)
            assert list(d.token_ids)[: len(p.token_ids)] == list(p.token_ids)
            continue
        assert (list(d.token_ids), d.text, d.finish_reason, d.stop_reason) == \
            (list(p.token_ids), p.text, p.finish_reason, p.stop_reason), name


@pytest.mark.parametrize("width", [2, 4])
def test_wider_with_eos_equals_reference(setup, runs, width):
    _, _, eos, target_fn, draft_fn = setup
    kw = dict(width=width, depth=DEPTH, temperature=0.0, mode="sample", seed=0, dynamic_width=True,
              eos_token_id=eos)
    ended = 0
    for i, p in enumerate(PROMPTS):
        first = dsbd_decode(target_fn, draft_fn, p, max_new_tokens=1, **kw).beams[0][0]
        rest = [] if first == [eos] else \
            dsbd_decode(target_fn, draft_fn, p + first, max_new_tokens=MAX_TOKENS - 1, **kw).beams[0][0]
        out = runs["dsbd"][width][f"eos p{i}"]
        assert list(out.token_ids) == first + rest, (i, list(out.token_ids), first + rest)
        ended += out.finish_reason == "stop"
    assert ended >= 1  # EOS ended at least one request early
    for n in (1, 2):
        assert len(runs["dsbd"][width][f"max_tokens {n}"].token_ids) == n
