"""Every GPU-only path has a switch back to the CPU-tested path (``vllm_dsbd/envs.py``), and with all of them set an
engine emits what the default engine emits, real vLLM 0.26.0 (CPU here; on a GPU ``check.sh`` runs it, where the
default engine takes the GPU paths: static and fused verification, static and chain drafting, the forest-attention and
KV-commit kernels).

Two engines of width 2 (tiny random Llama pair, depth 3, pinned speculation, float32 eager: ``full_cuda_graphs`` off,
the config's switch), the second started with ``VLLM_DSBD_STATIC_VERIFY=0``, ``VLLM_DSBD_FUSED_VERIFY=0``,
``VLLM_DSBD_STATIC_DRAFT=0``, ``VLLM_DSBD_KV_COMMIT=torch`` and ``VLLM_DSBD_FOREST_ATTENTION=torch``. Each generates a
width-1 batch (every forest a chain: the chain drafter's case) and a width-2 batch (forest attention, accepted paths
that need their K/V moved), seeded T = 1 and greedy. Asserted:

* the same tokens from both engines, and accepted drafts and K/V moves in both;
* the default engine drafted with the chain loop (width 1) and the static loop (width 2);
* the switched engine never did (``VLLM_DSBD_STATIC_DRAFT=0`` covers the width-1 chain drafter), verified on the row
  subsets without the fused kernel, commits K/V with the torch reference (no kernel table) and recomputes forest
  attention with the batched torch path.
"""
from __future__ import annotations

import pytest

from engine_utils import dsbd_llm, metric, runner_of  # sets the CPU engine environment before vllm is imported
import vllm  # noqa: E402  (a broken vLLM must fail the suite, never skip it)

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh

DEPTH, MAX_TOKENS = 3, 16
PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [7], [250, 3, 77, 12, 9]]
SWITCHES = {"VLLM_DSBD_STATIC_VERIFY": "0", "VLLM_DSBD_FUSED_VERIFY": "0", "VLLM_DSBD_STATIC_DRAFT": "0",
            "VLLM_DSBD_KV_COMMIT": "torch", "VLLM_DSBD_FOREST_ATTENTION": "torch"}


def _params(width: int):
    out = []
    for i, _ in enumerate(PROMPTS):
        out.append(vllm.SamplingParams(temperature=1.0, seed=300 + i, max_tokens=MAX_TOKENS, ignore_eos=True,
                                       extra_args={"dsbd_width": width}))
        out.append(vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                       extra_args={"dsbd_width": width}))
    return out


def _run(target, draft, env: dict[str, str]) -> dict:
    with pytest.MonkeyPatch.context() as mp:
        for name in SWITCHES:
            mp.delenv(name, raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        with dsbd_llm(target, max_num_seqs=2 * len(PROMPTS),
                      speculative_config={"method": "dsbd", "model": str(draft), "num_speculative_tokens": DEPTH,
                                          "width": 2, "verify_budget": None}) as llm:
            runner = runner_of(llm)
            drafter = runner.drafter
            calls = {"chains": 0, "static": 0}
            real = {"chains": drafter._draft_chains, "static": drafter._draft_static}

            def spy(name):
                def reader(*args, **kwargs):  # a reader, as the loops are (``engine/reads.py``)
                    calls[name] += 1
                    return (yield from real[name](*args, **kwargs))
                return reader

            drafter._draft_chains, drafter._draft_static = spy("chains"), spy("static")
            prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in range(2)]
            tokens = {w: [list(o.outputs[0].token_ids) for o in llm.generate(prompts, _params(w), use_tqdm=False)]
                      for w in (1, 2)}
            impls = {getattr(layer.impl, "_dsbd_forest_impl", None)
                     for layer in runner.compilation_config.static_forward_context.values() if hasattr(layer, "impl")}
            return dict(tokens=tokens, calls=calls, static=runner.dsbd_static, fused=runner.dsbd_fused,
                        tables=[p.table for p in runner._kv_planes().values()], impls=impls,
                        accepted=metric(llm, "vllm:spec_decode_num_accepted_tokens"),
                        moved=metric(llm, "vllm:dsbd_kv_commit_slots"))


@pytest.fixture(scope="module")
def runs(tiny_pair):
    target, draft = tiny_pair
    return _run(target, draft, {}), _run(target, draft, SWITCHES)


def test_switched_engine_emits_the_default_engines_tokens(runs):
    default, switched = runs
    assert switched["tokens"] == default["tokens"]
    assert len({tuple(t) for t in default["tokens"][2]}) > len(PROMPTS)  # seeds and greedy give different outputs
    for run in runs:
        assert run["accepted"] >= 2 * len(PROMPTS) and run["moved"] > 0  # drafts accepted, K/V moved


def test_the_default_engine_drafts_with_the_chain_and_static_loops(runs):
    default, _ = runs
    assert default["calls"]["chains"] >= MAX_TOKENS // (DEPTH + 1) and default["calls"]["static"] >= 1


def test_the_switches_take_the_cpu_tested_paths(runs):
    _, switched = runs
    assert switched["calls"] == {"chains": 0, "static": 0}  # STATIC_DRAFT=0 covers the width-1 chain drafter
    assert not switched["static"] and not switched["fused"]
    assert switched["tables"] and all(t is None for t in switched["tables"])  # the torch reference commits
    assert switched["impls"] == {"torch"}
