"""GPU only: full CUDA graphs over DSBD target passes without forest attention (setting ``full_cuda_graphs``) give the
tokens of the same engine run eagerly, real vLLM 0.26.0 (skipped without CUDA; ``benchmarks/gpu/check.sh`` runs it).

Two engines per width, float32 (greedy decoding of a tiny random model is then free of bf16 near-ties): one with
vLLM's default graph mode (FULL_AND_PIECEWISE; attention split out of the pieces) and ``full_cuda_graphs``, one with
``enforce_eager``. Width 1: every forest is a chain, so decode passes have no forest batch and replay full graphs;
the dispatcher must have answered FULL for some passes. Width 2: the decode passes with a forest batch must never
get FULL. In both, the greedy tokens must equal the eager engine's, and drafts must have been accepted.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("full CUDA graphs need a GPU", allow_module_level=True)

from engine_utils import dsbd_llm, metric, runner_of, tiny_pair  # noqa: E402
import vllm  # noqa: E402
from vllm.config.compilation import CUDAGraphMode  # noqa: E402

pytestmark = pytest.mark.gpu  # benchmarks/gpu/check.sh runs it (step full_graphs)

PROMPTS = [[5, 6, 7, 8], [10, 20, 30], [100, 101, 102, 103, 104, 105], [42, 43]]
MAX_TOKENS = 24


def _run(width: int, graphs: bool):
    target, draft = tiny_pair()
    spec = {"method": "dsbd", "model": str(draft), "num_speculative_tokens": 3, "width": width,
            "verify_budget": None, "full_cuda_graphs": graphs}
    with dsbd_llm(target, enforce_eager=not graphs, max_num_seqs=len(PROMPTS), gpu_memory_utilization=0.3,
                  speculative_config=spec,
                  compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]} if graphs else None) as llm:
        runner = runner_of(llm)
        dispatcher = runner.cudagraph_dispatcher
        dispatch = dispatcher.dispatch
        modes: list[tuple[bool, CUDAGraphMode]] = []  # (the pass has a forest batch, the mode vLLM replays)

        def spy(*args, **kwargs):
            mode, desc = dispatch(*args, **kwargs)
            modes.append((runner._dsbd_forest is not None, mode))
            return mode, desc

        try:
            mode = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
            dispatcher.dispatch = spy
            sp = vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
            accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
        finally:
            dispatcher.dispatch = dispatch
    return [list(o.outputs[0].token_ids) for o in outs], modes, accepted, mode


@pytest.mark.parametrize("width", [1, 2])
def test_full_graphs_give_the_eager_tokens(width):
    tokens, modes, accepted, mode = _run(width, graphs=True)
    eager, _, _, eager_mode = _run(width, graphs=False)
    print(f"width {width}: {mode.name}; dispatch: {[(f, m.name) for f, m in modes]}")
    assert mode.has_full_cudagraphs() and eager_mode == CUDAGraphMode.NONE
    assert tokens == eager
    assert accepted >= len(PROMPTS)
    assert not any(forest and m == CUDAGraphMode.FULL for forest, m in modes)
    if width == 1:
        assert not any(forest for forest, _ in modes)
        assert sum(m == CUDAGraphMode.FULL for _, m in modes) >= MAX_TOKENS // 4
    else:
        assert any(forest for forest, _ in modes)
