"""Over-drafted beam forests (N > W draft nodes per depth, ``beam_nodes`` / ``dsbd_beam.nodes``) inside the DSBD
engine at temperature 0, real vLLM 0.26.0 on CPU.

The tiny random Llama target of ``test_engine_beams.py`` (EOS moved to a token greedy decoding emits early, so beams
finish on EOS) with its first 2 of 3 layers as the draft. Oracle: vLLM's own ``LLM.beam_search`` on a plain engine
with the same float32 weights. One DSBD engine (width 4, depth 3, ``beam_nodes`` 16, speculation pinned) serves:

* ``LLM.beam_search`` W = 4 (the engine's N = 16 = 4W) and W = 2 (N = 16 = 8W);
* ``dsbd_beam`` requests with the draft depth pinned to 3 (every step drafts: no back-off after failed forests, so
  the runs at different N draft at the same steps) at N = W, 2W, 4W for W = 4 and N = W, 4W for W = 2.

Checked: every run returns exactly the plain engine's beams (tokens in order, cumulative log-probabilities to 1e-4);
the engine's counters show forests drafted with more nodes as N grows, layers passed, every beam step either a target
pass's own or a passed layer; and at N > W at least as many layers pass as at N = W on the same requests.
"""
from __future__ import annotations

import random

import pytest

from engine_utils import dsbd_llm, greedy_tokens, metric, tiny_pair, with_eos  # sets the CPU engine environment
import vllm  # noqa: E402,F401  (a broken vLLM must fail the suite, never skip it)

from vllm.sampling_params import BeamSearchParams  # noqa: E402
from vllm_dsbd.patches.beam_search_route import beam_outputs, beam_request_params  # noqa: E402
from vllm_dsbd.testing.models import load_hf, next_token_logits_fn  # noqa: E402

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh (engine_tests)

WIDTH, DEPTH, MAX_TOKENS, BEAM_NODES = 4, 3, 8, 16
_rng = random.Random(7)
PROMPTS = ([[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [7], [250, 3, 77, 12, 9]]
           + [[_rng.randrange(3, 400) for _ in range(_rng.randrange(2, 12))] for _ in range(5)])
CASES = {4: 1.3, 2: 0.8}  # beam width -> length penalty
NODES = {4: (4, 8, 16), 2: (2, 8)}  # beam width -> N of the pinned-depth runs: W, 2W, 4W (W = 2: W, 4W)
COUNTERS = ("target_passes", "steps", "draft_nodes", "layers_passed")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target, draft = tiny_pair()
    g0 = greedy_tokens(next_token_logits_fn(load_hf(target)), PROMPTS[0], 8)
    eos = next(t for i, t in enumerate(g0) if i >= 1 and t not in g0[:i])  # the second greedy token
    folder = tmp_path_factory.mktemp("overdraft") / "target"
    with_eos(target, folder, eos)
    return folder, draft, eos


def _sequences(outs):
    return [[(list(s.tokens), s.cum_logprob) for s in o.sequences] for o in outs]


def _beam_search(llm, width):
    bp = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, length_penalty=CASES[width])
    return _sequences(llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], bp))


def _counters(llm) -> dict:
    return {k: int(metric(llm, f"vllm:dsbd_beam_{k}") or 0) for k in COUNTERS}


def _counted(llm, run):
    """``run()``'s result and the engine's beam counters over it."""
    before = _counters(llm)
    out = run()
    after = _counters(llm)
    return out, {k: after[k] - before[k] for k in COUNTERS}


def _pinned(llm, width, nodes, eos):
    """The beam search of ``width`` as ``dsbd_beam`` requests with ``nodes`` draft nodes per depth, depth pinned."""
    bp = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, length_penalty=CASES[width])
    params = []
    for p in PROMPTS:
        sp = beam_request_params(bp, eos, len(p), 256, WIDTH)
        sp.extra_args["dsbd_beam"].update(nodes=nodes, depth=DEPTH)
        params.append(sp)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tok = llm.get_tokenizer()
    return _sequences([beam_outputs({"type": "token", "prompt_token_ids": p}, o, tok) for p, o in zip(PROMPTS, outs)])


@pytest.fixture(scope="module")
def plain(setup):
    folder, _, _ = setup
    with dsbd_llm(folder, max_num_seqs=16) as llm:
        yield {w: _beam_search(llm, w) for w in CASES}


@pytest.fixture(scope="module")
def dsbd(setup, plain):  # after plain: one engine at a time
    folder, draft, eos = setup
    with dsbd_llm(folder, max_num_seqs=16,
                  speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                      "width": WIDTH, "beam_nodes": BEAM_NODES, "verify_budget": None}) as llm:
        out = {("beam_search", w): _counted(llm, lambda w=w: _beam_search(llm, w)) for w in CASES}
        for w, ns in NODES.items():
            for n in ns:
                out[(w, n)] = _counted(llm, lambda w=w, n=n: _pinned(llm, w, n, eos))
        yield out


def _assert_same_beams(got, expected):
    assert len(got) == len(expected) == len(PROMPTS)
    for g, e in zip(got, expected):
        assert [t for t, _ in g] == [t for t, _ in e]
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(g, e))


@pytest.mark.parametrize("width", list(CASES))
def test_beam_search_with_over_drafted_forests_equals_vllm(dsbd, plain, setup, width):
    """``LLM.beam_search`` on the engine (N = beam_nodes = 16) and ``dsbd_beam`` at every N: vLLM's beams."""
    beams, c = dsbd[("beam_search", width)]
    print(f"LLM.beam_search W = {width}, N = {BEAM_NODES}:", c)
    _assert_same_beams(beams, plain[width])
    assert c["draft_nodes"] > 0 and c["layers_passed"] > 0
    for n in NODES[width]:
        _assert_same_beams(dsbd[(width, n)][0], plain[width])
    eos = setup[2]
    assert eos in [t[-1] for g in plain[width] for t, _ in g]  # the EOS rule was exercised


@pytest.mark.parametrize("width", list(CASES))
def test_more_nodes_draft_more_and_pass_at_least_as_many_layers(dsbd, width):
    counts = {n: dsbd[(width, n)][1] for n in NODES[width]}
    for n, c in counts.items():
        print(f"W = {width}, N = {n}: {c}, target passes per beam step {c['target_passes'] / c['steps']:.3f}")
        # every beam step was a target pass's own step or a passed layer (no leaves split across passes here)
        assert c["steps"] == c["target_passes"] + c["layers_passed"], c
    ns = sorted(counts)
    assert all(counts[a]["draft_nodes"] < counts[b]["draft_nodes"] for a, b in zip(ns, ns[1:])), counts
    assert counts[ns[-1]]["layers_passed"] > 0
    assert all(counts[n]["layers_passed"] >= counts[width]["layers_passed"] for n in ns), counts
    # the same beams at every N: the same beam steps
    assert len({c["steps"] for c in counts.values()}) == 1, counts
