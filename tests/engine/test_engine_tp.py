"""DSBD with tensor parallelism 2 (vLLM's ``mp`` executor, two worker processes on the CPU) against the same engine
at tensor parallelism 1.

Every random number of DSBD is a hash of (seed, position, stream, index) (``core/rng.py``), and an unseeded request
gets its seed from a generator seeded by the engine's seed, in the order requests are registered, which is the order
of the scheduler's output that every rank receives; so every rank should build the same forests and make the same
decisions with no broadcast of its own. Checked:

* temperature 0, widths 1 and 2: TP = 2 emits exactly TP = 1's tokens;
* seeded temperature-1 requests: TP = 2 emits exactly TP = 1's tokens;
* beam requests inside the engine (``LLM.beam_search`` at T = 0, seeded beam sampling at T = 1): TP = 2 returns
  exactly TP = 1's beams (the finished beams travel from the rank-0 runner to the scheduler through the executor);
* unseeded temperature-1 requests finish (no hang), and the two ranks' decision digests (a hash of every forest, every
  emitted token, accepted path and width, ``DSBDWorker.dsbd_decisions``) are equal, as are their counts;
* the DSBD Prometheus counters count each decision once (rank 0 reports), equal to vLLM's own spec-decode counters;
* the checks are not vacuous: forests were verified and drafts accepted on both engines.

The models: a tiny random Llama target (3 layers, 2 attention heads: one per rank) and its first 2 layers as the
draft; the draft runs with the target's parallel layout (vLLM's draft-model path loads it with the same tensor
parallel size, so each rank holds its head shard of the draft's KV cache too).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine_utils import dsbd_llm, metric  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

from vllm.sampling_params import BeamSearchParams  # noqa: E402
from vllm_dsbd.engine.prometheus import PROMETHEUS_DIR_ENV  # noqa: E402

pytestmark = pytest.mark.slow

WIDTH, DEPTH, MAX_TOKENS = 2, 3, 16
# load-aware speculation with the same budget on both engines: 4 requests at full shape need 28 tokens, so the ranks
# must also agree on the shrunk forests ("auto" would measure each engine's own budget, and seeded T = 1 tokens depend
# on the drafts)
BUDGET = 16
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [250, 3, 77, 12, 9]]


def _greedy():
    return [({"prompt_token_ids": p}, vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                           extra_args={"dsbd_width": w}))
            for w in (1, WIDTH) for p in PROMPTS]


def _seeded():
    return [({"prompt_token_ids": p}, vllm.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                           seed=100 + i))
            for i, p in enumerate(PROMPTS * 2)]


def _unseeded():
    return [({"prompt_token_ids": p}, vllm.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True))
            for p in PROMPTS * 2]


def _tokens(llm, reqs):
    outs = llm.generate([r for r, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _run(target, draft, tp: int, backend: str | None = None, inspect=None) -> dict:
    """The engine's outputs for every workload above (``backend``: vLLM's executor, default ``mp`` for TP > 1;
    ``inspect(llm)``: a dict merged into the result while the engine runs)."""
    try:
        with dsbd_llm(target, max_num_seqs=4, tensor_parallel_size=tp,
                      distributed_executor_backend=backend or ("mp" if tp > 1 else None),
                      speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                          "width": WIDTH, "verify_budget": BUDGET}) as llm:
            out = {"greedy": _tokens(llm, _greedy()), "seeded": _tokens(llm, _seeded())}
            # beams inside the engine: deterministic (T = 0) and sampled (seeded T = 1) beam requests
            beams = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                                    BeamSearchParams(beam_width=WIDTH, max_tokens=8, length_penalty=0.9))
            out["beams"] = [[(list(s.tokens), s.cum_logprob) for s in o.sequences] for o in beams]
            sampled = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [vllm.SamplingParams(
                temperature=1.0, seed=7 + i, max_tokens=20, ignore_eos=True, detokenize=False,
                extra_args={"dsbd_beam": {"width": WIDTH, "max_tokens": 6, "ignore_eos": True}})
                for i in range(len(PROMPTS))],
                use_tqdm=False)
            out["sampled_beams"] = [[b["token_ids"] for b in o.kv_transfer_params["dsbd_beam"]] for o in sampled]
            before_ranks = llm.collective_rpc("dsbd_decisions")
            before = {k: metric(llm, k) or 0 for k in ("vllm:dsbd_iterations", "vllm:spec_decode_num_drafts",
                                                      "vllm:spec_decode_num_accepted_tokens")}
            out["unseeded"] = _tokens(llm, _unseeded())
            out["ranks"] = llm.collective_rpc("dsbd_decisions")
            out["before_ranks"] = before_ranks
            out["metrics"] = {k: (metric(llm, k) or 0) - v for k, v in before.items()}
            if inspect is not None:
                out.update(inspect(llm))
            return out
    finally:
        if tp > 1 or backend is not None:
            _clear_frontend_metrics()


def _clear_frontend_metrics() -> None:
    """The TP = 2 workers (child processes) wrote DSBD's counters into this process's multiprocess metrics directory
    (``engine/metrics.py``); the files outlive the engine and would shadow the counters of later in-process engines
    of this pytest session in ``LLM.get_metrics()``."""
    d = os.environ.get(PROMETHEUS_DIR_ENV)
    if d:
        for f in Path(d).glob("*.db"):
            f.unlink()


@pytest.fixture(scope="module")
def tp1(tiny_pair):
    return _run(*tiny_pair, tp=1)


@pytest.fixture(scope="module")
def tp2(tiny_pair, tp1):  # tp1 first: one engine at a time
    return _run(*tiny_pair, tp=2)


def test_greedy_equals_tp1(tp1, tp2):
    assert tp2["greedy"] == tp1["greedy"]


def test_beam_requests_equal_tp1(tp1, tp2):
    """Beams inside the engine under TP = 2: the runner's finished beams reach the scheduler through the
    multiprocess executor, and both ranks step the beams alike (deterministic and seeded sampled beams equal
    TP = 1's)."""
    assert [[t for t, _ in g] for g in tp2["beams"]] == [[t for t, _ in g] for g in tp1["beams"]]
    for g, e in zip(tp2["beams"], tp1["beams"]):
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(g, e))
    assert tp2["sampled_beams"] == tp1["sampled_beams"]
    assert all(len(b) == WIDTH for b in tp1["sampled_beams"])


def test_seeded_sampling_equals_tp1(tp1, tp2):
    assert tp2["seeded"] == tp1["seeded"]
    assert len({tuple(t) for t in tp1["seeded"]}) > len(PROMPTS)  # different seeds, different samples


def test_unseeded_requests_finish_and_ranks_agree(tp2):
    assert [len(t) for t in tp2["unseeded"]] == [MAX_TOKENS] * len(PROMPTS) * 2
    ranks = tp2["ranks"]
    assert sorted(r["tp_rank"] for r in ranks) == [0, 1]
    first = {k: v for k, v in ranks[0].items() if k != "tp_rank"}
    for r in ranks[1:]:
        assert {k: v for k, v in r.items() if k != "tp_rank"} == first
    assert first["decisions"] is not None  # the digest is kept with tensor parallelism
    assert first["forest_iterations"] > 0 and sum(k * n for k, n in first["layers_passed"].items()) > 0


def assert_metrics_count_forests(run) -> None:
    """The front end's DSBD and vLLM draft counters equal the forests rank 0 verified in the run (each decision
    counted once, whatever the number of ranks), and some drafts were accepted."""
    rank0 = next(r for r in run["ranks"] if r["tp_rank"] == 0)
    rank0_before = next(r for r in run["before_ranks"] if r["tp_rank"] == 0)
    forests = rank0["forest_iterations"] - rank0_before["forest_iterations"]
    m = run["metrics"]
    assert forests > 0
    assert m["vllm:dsbd_iterations"] == m["vllm:spec_decode_num_drafts"] == forests, m
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0


def test_metrics_count_each_decision_once(tp1, tp2):
    for run in (tp1, tp2):
        assert_metrics_count_forests(run)
