"""The user's default configuration, checked against plain vLLM in that same configuration.

On a GPU (``benchmarks/gpu/check.sh``, step ``default_config``) both engines run as a user gets them: bfloat16,
vLLM's default compilation (torch.compile with piecewise CUDA graphs), and DSBD's defaults on CUDA (static
verification, the fused verify kernel); the test asserts that those paths were really taken. On CPU the same checks
run on float32 eager engines, where they are exact. Tiny random Llama pair with peaky laws (``peaky_pair``), two DSBD
engines of width 4, depth 2: ``default``, exactly as a user starts it (no override: the cost model measured at
start-up, its step clock, load-aware speculation), and ``pinned`` (cost model off, every step drafts depth 2), which
makes the forest checks below never vacuous. Checked on both:

* greedy plain requests at widths 1 and 4 equal plain greedy vLLM. In bfloat16 the forest's attention rounds
  differently from a decode pass, so two near-tied tokens may swap: each request is compared up to its first
  difference, where plain vLLM's own log-probabilities of the two tokens must be within ``TIE`` (0 in float32: any
  difference fails); at most a quarter of the requests may differ at all;
* ``LLM.beam_search`` (W = 4) gives plain vLLM's beams (float32: the same sequences and cumulative log-probabilities
  to 1e-4; bfloat16: the best beam's cumulative log-probability within ``TIE`` and most prompts' beams identical);
* the law of the first 4 tokens of T = 0.6 plain requests at W = 4 equals plain vLLM's (two-sample chi-square,
  threshold at p = 1e-6; 800 requests per sample: minimum detectable effect TV 0.25); power: the same statistic
  rejects plain vLLM at T = 0.9, and rejects the DSBD sample against it;
* not vacuous: on ``pinned`` vLLM's counters show drafts made and accepted, the DSBD counters layers passed and beam
  steps; on ``default`` the start-up probe measured a cost table (with a forest step's own work: drafting, forest
  attention, verification), the step clock timed decode steps and the cost
  model chose a depth for every decoding request (the depths it chose are printed: drafting nothing is its right
  where a forest does not pay, and then the equalities above hold trivially for that engine).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine_utils import dsbd_llm, metric, peaky_pair, runner_of  # sets the CPU engine environment before vllm
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm.config import CompilationMode, CUDAGraphMode  # noqa: E402
from vllm.sampling_params import BeamSearchParams  # noqa: E402

import chisq  # noqa: E402

pytestmark = pytest.mark.gpu  # the point of this file is the GPU run (benchmarks/gpu/check.sh)

CUDA = torch.cuda.is_available()
# the user's default on a GPU: bfloat16, vLLM's default compilation (enforce_eager False) and prefix caching (None:
# vLLM's default, on); float32 eager on CPU
DEFAULT = (dict(dtype="bfloat16", enforce_eager=False, enable_prefix_caching=None, max_num_seqs=64) if CUDA
           else dict(max_num_seqs=64))
TIE = 0.25 if CUDA else 0.0  # nats: the log-probability gap a bfloat16 rounding difference may swap
WIDTH, DEPTH, TOKENS = 4, 2, 24
PROMPTS = [[(13 * i + 7 * k) % 290 + 5 for k in range(4 + i % 5)] for i in range(12)]
N_LAW, LAW_TOKENS, TEMP, HOT = 800, 4, 0.6, 0.9
LAW_PROMPT = [(7 * i + 3) % 290 + 5 for i in range(40)]
BEAM = BeamSearchParams(beam_width=WIDTH, max_tokens=8)


def _greedy(llm, width=None):
    extra = {"dsbd_width": width} if width else None
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        vllm.SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=5,
                                            extra_args=extra), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def _beams(llm):
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:6]], BEAM)
    return [[(list(s.tokens), s.cum_logprob) for s in o.sequences] for o in outs]


def _law(llm, temperature, width=None):
    extra = {"dsbd_width": width} if width else None
    outs = llm.generate([{"prompt_token_ids": LAW_PROMPT}] * N_LAW,
                        vllm.SamplingParams(temperature=temperature, max_tokens=LAW_TOKENS, ignore_eos=True,
                                            extra_args=extra), use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids) for o in outs)


def _counters(llm):
    names = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "dsbd_layers_passed",
             "dsbd_beam_steps")
    values = {n: metric(llm, f"vllm:{n}") for n in names}
    return {n: getattr(v, "sum", v) or 0 for n, v in values.items()}  # a histogram counts by its sum


def _paths(llm):
    cfg = llm.llm_engine.vllm_config
    return {"dtype": str(cfg.model_config.dtype), "compilation": CompilationMode(cfg.compilation_config.mode).name,
            "cudagraph_mode": CUDAGraphMode(cfg.compilation_config.cudagraph_mode).name}


@pytest.fixture(scope="module")
def plain():
    with dsbd_llm(peaky_pair()[0], **DEFAULT) as llm:
        return {"greedy": _greedy(llm), "beams": _beams(llm), "law": _law(llm, TEMP), "hot": _law(llm, HOT),
                "paths": _paths(llm)}


def _run_dsbd(spec):
    target, draft = peaky_pair()
    spec = {"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH, "width": WIDTH, **spec}
    with dsbd_llm(target, speculative_config=spec, **DEFAULT) as llm:
        runner = runner_of(llm)
        out = {"paths": _paths(llm), "static": runner.dsbd_static, "fused": runner.dsbd_fused}
        c0 = _counters(llm)
        out["greedy"] = {w: _greedy(llm, w) for w in (1, WIDTH)}
        c1 = _counters(llm)
        out["beams"] = _beams(llm)
        c2 = _counters(llm)
        out["law"] = _law(llm, TEMP, WIDTH)
        c3 = _counters(llm)
        out["delta"] = {"greedy": {k: c1[k] - c0[k] for k in c0}, "beams": {k: c2[k] - c1[k] for k in c0},
                        "law": {k: c3[k] - c2[k] for k in c0}}
        clock = runner._dsbd_clock
        out["cost"] = {"table": runner._dsbd_cost_base, "corrected": runner.dsbd_cost,
                       "clock": None if clock is None else clock.summary(),
                       "depths": dict(runner.dsbd_stats.draft_depths),
                       "beam_nodes": dict(runner.dsbd_stats.beam_nodes_chosen)}
    return out


@pytest.fixture(scope="module")
def default(plain):  # after plain: one engine at a time. The user's engine: no override of DSBD's defaults
    return _run_dsbd({"cost_model": "auto"})  # "auto" is the default; named so engine_utils does not turn it off


@pytest.fixture(scope="module")
def pinned(default):  # cost model and load-aware speculation off: every step drafts a forest of depth DEPTH
    return _run_dsbd({"cost_model": None, "verify_budget": None})


ENGINES = ("default", "pinned")


@pytest.fixture(params=ENGINES)
def dsbd(request):
    return request.param, request.getfixturevalue(request.param)


def test_the_default_paths_were_taken(plain, dsbd):
    name, dsbd = dsbd
    print(name, "plain:", plain["paths"], "dsbd:", dsbd["paths"], "static:", dsbd["static"], "fused:", dsbd["fused"])
    assert dsbd["paths"]["dtype"] == plain["paths"]["dtype"]
    if CUDA:
        assert dsbd["paths"]["dtype"] == "torch.bfloat16"
        assert dsbd["paths"]["compilation"] != "NONE" and dsbd["paths"]["cudagraph_mode"] != "NONE"
        assert dsbd["static"] and dsbd["fused"]


def _first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.parametrize("width", [1, WIDTH])
def test_greedy_equals_plain_vllm(plain, dsbd, width):
    name, dsbd = dsbd
    differing = 0
    for (want, lps), (got, _) in zip(plain["greedy"], dsbd["greedy"][width]):
        assert len(got) == len(want) == TOKENS
        i = _first_difference(want, got)
        if i is None:
            continue
        differing += 1
        gap = lps[i][want[i]].logprob - (lps[i][got[i]].logprob if got[i] in lps[i] else -float("inf"))
        print(f"W={width}: first difference at token {i}: {want[i]} vs {got[i]}, plain log-prob gap {gap:.4f}")
        assert gap <= TIE, "a difference that is not a near-tie"
    print(f"{name} W={width}: {differing} of {len(PROMPTS)} requests differ; counters (widths 1 and 4) "
          f"{dsbd['delta']['greedy']}")
    assert differing <= len(PROMPTS) // 4
    if name == "pinned":
        assert dsbd["delta"]["greedy"]["spec_decode_num_accepted_tokens"] > 0
        assert dsbd["delta"]["greedy"]["dsbd_layers_passed"] > 0


def test_beam_search_equals_plain_vllm(plain, dsbd):
    name, dsbd = dsbd
    same = 0
    for want, got in zip(plain["beams"], dsbd["beams"]):
        if [t for t, _ in want] == [t for t, _ in got]:
            same += 1
            assert all(abs(a - b) <= 1e-4 + TIE for (_, a), (_, b) in zip(want, got))
        else:
            print("beams differ:", want[0][1], got[0][1])
            assert abs(want[0][1] - got[0][1]) <= TIE
    print(f"{name}: {same} of {len(plain['beams'])} prompts with identical beams; counters {dsbd['delta']['beams']}")
    assert same == len(plain["beams"]) if not CUDA else same >= len(plain["beams"]) // 2
    assert dsbd["delta"]["beams"]["dsbd_beam_steps"] > 0


def test_plain_request_law_equals_plain_vllm(plain, dsbd):
    name, dsbd = dsbd
    stat, df, thr = chisq.two_sample(dsbd["law"], plain["law"])
    chisq.report(f"first {LAW_TOKENS} tokens, DSBD ({name}) W={WIDTH} vs plain vLLM", stat, df, thr, n=N_LAW,
                 two_sample=True)
    assert df >= 3 and stat < thr
    for who, sample in (("plain vLLM", plain["law"]), ("DSBD", dsbd["law"])):
        s, d, t = chisq.two_sample(sample, plain["hot"])
        chisq.report(f"  {who} T={TEMP} vs plain vLLM T={HOT} (must differ)", s, d, t)
        assert s > t
    print(name, "counters:", dsbd["delta"]["law"])
    if name == "pinned":
        assert dsbd["delta"]["law"]["spec_decode_num_accepted_tokens"] > 0


def test_the_default_engine_measured_its_costs(default):
    """The cost model of the user's engine ran: a table measured at start-up (target and draft passes timed at
    several token counts), decode steps timed by the step clock, a depth chosen for the decoding requests."""
    cost = default["cost"]
    table = cost["table"]
    print("default engine: start-up table target", table.target if table else None, "draft",
          table.draft if table else None, "step", table.step if table else None, "forest work",
          (table.draft_step, table.node) if table else None)
    print("corrected draft_step", cost["corrected"].draft_step if cost["corrected"] else None,
          "clock (median surplus s and windows by kind)", cost["clock"])
    print("depths chosen (depth: requests x steps)", cost["depths"], "beam N chosen", cost["beam_nodes"])
    print("counters", default["delta"])
    assert table is not None and len(table.target) >= 2 and all(s > 0 for _, s in table.target)
    assert len(table.draft) >= 1 and all(s > 0 for _, s in table.draft)
    assert table.draft_step > 0  # the forest work of a step timed at start-up (forest_probe.py), beside the passes
    assert cost["clock"] is not None and cost["clock"]["steps"] > 0
    assert sum(cost["depths"].values()) > 0
