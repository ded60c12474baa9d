"""The batched torch forest attention (the engine's CPU path) against the per-request reference, on the kernel
test's awkward cases (ragged requests, GQA, no context, two mask words, draft-step queries, NaN-poisoned slots outside
every request), with chunking forced, on strided cache planes, with queries that see nothing, and in bf16."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import assert_verbose_allclose  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from test_kernel_forest_attention import CASES, Case
from dsbd_kernels.forest_attention import ForestAttentionInputs, forest_attention_batched, forest_attention_ref


def _cpu(inp: ForestAttentionInputs) -> ForestAttentionInputs:
    return ForestAttentionInputs(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(inp).items()})


@pytest.mark.parametrize("max_elements", [1 << 24, 1], ids=["one-chunk", "chunk-per-request"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_reference(case: Case, max_elements: int) -> None:
    inp = _cpu(case.inputs(torch.float32, seed=3))
    out = forest_attention_batched(*inp.args(), max_elements=max_elements)
    assert not out.isnan().any()
    assert_verbose_allclose(out, forest_attention_ref(*inp.args()), 1e-5, 1e-5, what=case.id)


def test_strided_planes_and_empty_rows() -> None:
    """K and V as the halves of one packed cache (head stride 2 * head_dim); a query whose mask is cleared and that
    has no context gets zeros, as in the reference; high bits beyond a forest change nothing."""
    inp = _cpu(Case((0, 19), ("chain:3", "beam2:8"), gqa=2, head_dim=64).inputs(torch.float32))
    d = inp.q.shape[-1]
    kv = torch.cat([inp.key_cache, inp.value_cache], dim=-1)
    args = list(inp.args())
    args[1], args[2] = kv[..., :d], kv[..., d:]
    args[7] = inp.ancestor_mask.clone()
    args[7][1] = 0
    args[7][3:] |= torch.tensor(-1 << 9, dtype=torch.int64)
    out = forest_attention_batched(*args)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_verbose_allclose(out, forest_attention_ref(*args), 1e-5, 1e-5, what="strided")


def test_requests_without_queries_and_empty_batch() -> None:
    inp = _cpu(Case((4, 9), ("chain:2", "star:3"), gqa=1, head_dim=64).inputs(torch.float32))
    args = list(inp.args())
    n0 = int(inp.cu_seqlens_q[1])
    args[0], args[7] = inp.q[n0:], inp.ancestor_mask[n0:]
    args[4] = torch.tensor([0, 0, inp.q.shape[0] - n0], dtype=torch.int32)  # request 0 queries nothing
    assert_verbose_allclose(forest_attention_batched(*args), forest_attention_ref(*args), 1e-5, 1e-5, what="r0 idle")
    args[0], args[7] = inp.q[:0], inp.ancestor_mask[:0]
    args[4] = torch.zeros(3, dtype=torch.int32)
    assert forest_attention_batched(*args).shape == (0,) + tuple(inp.q.shape[1:])


@pytest.mark.parametrize("case", CASES[:6], ids=lambda c: c.id)
def test_bf16_matches_reference(case: Case) -> None:
    """bf16 queries and cache (the path computes in float32 and writes bf16): within bf16's rounding of the
    reference's outputs."""
    inp = _cpu(case.inputs(torch.float32, seed=3))
    args = list(inp.args())
    for i in (0, 1, 2):  # q, K, V
        args[i] = args[i].to(torch.bfloat16)
    out = forest_attention_batched(*args)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert_verbose_allclose(out.float(), forest_attention_ref(*args).float(), 5e-3, 5e-3, what=case.id)


def test_planes_whose_blocks_interleave() -> None:
    """Planes whose blocks are not contiguous spans (stored token-major: a block's slots lie a whole row of blocks
    apart) take the element-wise gather, with the same outputs."""
    inp = _cpu(Case((3, 17), ("chain:3", "beam2:8"), gqa=2, head_dim=64).inputs(torch.float32))
    args = list(inp.args())
    for i in (1, 2):
        args[i] = args[i].transpose(0, 1).contiguous().transpose(0, 1)  # [blocks, bs, ...] over [bs, blocks, ...]
        assert args[i].stride(0) < args[i].stride(1)
    assert_verbose_allclose(forest_attention_batched(*args), forest_attention_ref(*inp.args()), 1e-5, 1e-5,
                            what="token-major planes")
