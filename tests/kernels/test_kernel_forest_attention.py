"""Forest attention kernel vs its torch reference and vs the chain oracle, on ragged, paged, NaN-poisoned inputs.

Runs compiled on a GPU and under Triton's interpreter on CPU (tiny shapes; bf16 on GPU only). Every cache slot the
batch does not own holds NaN and every output starts as NaN, so a read outside the contract or a missed write fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernel_utils import (  # sets TRITON_INTERPRET=1 without a GPU, before dsbd_kernels is imported
    DEVICE,
    TOLERANCES,
    assert_verbose_allclose,
    depth_of,
    dtype_param,
    forest_parents,
    root_path,
)
import dsbd_kernels.forest_attention as fa
from dsbd_kernels.forest_attention import (
    ForestAttentionInputs,
    ancestor_bitmask,
    forest_attention,
    forest_attention_ref,
    num_mask_words,
    unpack_bitmask,
)

# Triton's interpreter (with numpy < 2.4) warns on every scalar index it converts; not ours to fix.
pytestmark = [pytest.mark.gpu,  # also run compiled on a GPU by benchmarks/gpu/check.sh
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")]

DTYPES = [dtype_param(torch.float32), dtype_param(torch.float16), dtype_param(torch.bfloat16)]


@dataclass(frozen=True)
class Case:
    ctx: tuple[int, ...]  # context length per request
    forests: tuple[str, ...]  # "kind:n" per request (see kernel_utils.forest_parents)
    gqa: int  # query heads per kv head
    head_dim: int
    kv_heads: int = 2
    block_size: int = 16
    mode: str = "verify"  # verify: all nodes query; draft: the deepest layer queries; decode: one node

    @property
    def id(self) -> str:
        return (f"{self.mode}-ctx{'_'.join(map(str, self.ctx))}-{'_'.join(f.replace(':', '') for f in self.forests)}"
                f"-g{self.gqa}-kv{self.kv_heads}-d{self.head_dim}-bs{self.block_size}")

    def parents(self) -> list[list[int]]:
        out = []
        for r, f in enumerate(self.forests):
            kind, n = f.split(":")
            out.append(forest_parents(kind, int(n), seed=r))
        return out

    def query_nodes(self, parents: list[list[int]]) -> list[list[int]] | None:
        if self.mode == "verify":
            return None
        if self.mode == "decode":
            return [[0] for _ in parents]
        deepest = []
        for ps in parents:  # draft beam step: the newest layer queries, masks over the forest so far
            depths = [depth_of(ps, j) for j in range(len(ps))]
            deepest.append([j for j, d in enumerate(depths) if d == max(depths)])
        return deepest

    def inputs(self, dtype: torch.dtype, seed: int = 0) -> ForestAttentionInputs:
        parents = self.parents()
        return ForestAttentionInputs.make_dummy(
            self.ctx, parents, num_kv_heads=self.kv_heads, queries_per_kv=self.gqa, head_dim=self.head_dim,
            dtype=dtype, device=DEVICE, block_size=self.block_size, query_nodes=self.query_nodes(parents), seed=seed)


CASES = [
    Case((1, 7, 33, 100), ("single:1",) * 4, gqa=1, head_dim=64, mode="decode"),
    Case((0, 5), ("single:1",) * 2, gqa=8, head_dim=128, kv_heads=1, mode="decode"),
    Case((7,), ("chain:9",), gqa=2, head_dim=64),
    Case((33, 1), ("star:12", "chain:5"), gqa=4, head_dim=128, kv_heads=1),
    Case((100, 7, 0), ("random:20", "multi:17", "shuffled:11"), gqa=1, head_dim=64),
    Case((1, 33), ("beam4:16", "beam3:12"), gqa=8, head_dim=64, kv_heads=1),
    Case((5,), ("random:70",), gqa=1, head_dim=64, block_size=8),  # two mask words
    Case((0, 0), ("multi:9", "chain:3"), gqa=2, head_dim=128),  # no context at all
    Case((17, 64, 3), ("single:1", "chain:16", "random:33"), gqa=8, head_dim=128, block_size=32),
    Case((12, 2), ("random:7", "beam3:9"), gqa=3, head_dim=64),  # group not a power of two (16 rows = 5 queries x 3)
    Case((33, 7), ("beam4:16", "beam2:6"), gqa=4, head_dim=64, mode="draft"),
    Case((100,), ("random:24",), gqa=2, head_dim=128, mode="draft"),
]


def run_kernel(inp: ForestAttentionInputs) -> torch.Tensor:
    out = torch.full_like(inp.q, float("nan"))  # poisoned: an unwritten element fails the comparison
    return forest_attention(*inp.args(), out, validate=True)


def chain_oracle(inp: ForestAttentionInputs) -> torch.Tensor:
    """Each query node's output = dense attention of its query over [context, root-to-node path] laid out
    contiguously (the node itself last, so causal attention sees all of it), gathered from the paged cache."""
    q = inp.q.float().cpu()
    kc, vc = inp.key_cache.float().cpu(), inp.value_cache.float().cpu()
    bt = inp.block_table.long().cpu()
    bs, kvh = kc.shape[1], kc.shape[2]
    group = q.shape[1] // kvh
    out = torch.empty_like(q)
    t = 0
    for r, (ctx, parents) in enumerate(zip(inp.context_lens.tolist(), inp.parents)):
        for node in inp.query_nodes[r]:
            pos = torch.tensor(list(range(ctx)) + [ctx + j for j in root_path(parents, node)])
            blk, off = bt[r, pos // bs], pos % bs
            k = kc[blk, off].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
            v = vc[blk, off].repeat_interleave(group, dim=1).transpose(0, 1)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[t][:, None, :], k, v, is_causal=False, scale=inp.softmax_scale)  # [H, 1, D]
            out[t] = o[:, 0]
            t += 1
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_reference(case: Case, dtype: torch.dtype) -> None:
    inp = case.inputs(dtype)
    out = run_kernel(inp)
    ref = forest_attention_ref(*inp.args())
    atol, rtol = TOLERANCES[dtype]
    assert_verbose_allclose(out, ref, atol, rtol, what=f"forest attention {case.id} {dtype}")


# Several tree shapes in one batch, DSBD's beam forests with GQA 8, and a draft beam step.
ORACLE_CASES = [CASES[4], CASES[5], next(c for c in CASES if c.mode == "draft")]


@pytest.mark.parametrize("dtype", DTYPES[:2])
@pytest.mark.parametrize("case", ORACLE_CASES, ids=lambda c: c.id)
def test_matches_chain_oracle(case: Case, dtype: torch.dtype) -> None:
    """Decompose the forest into root-to-node chains (vLLM test_tree_attention's oracle)."""
    inp = case.inputs(dtype, seed=1)
    out = run_kernel(inp)
    atol, rtol = TOLERANCES[dtype]
    assert_verbose_allclose(out, chain_oracle(inp), atol, rtol, what=f"forest attention vs chains {case.id}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_matches_chain_oracle(case: Case) -> None:
    """The reference itself (mask encoding included) against the chains, in fp32 on the CPU (no kernel)."""
    inp = case.inputs(torch.float32, seed=2)
    inp = ForestAttentionInputs(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(inp).items()})
    assert_verbose_allclose(forest_attention_ref(*inp.args()), chain_oracle(inp), 1e-5, 1e-5, what=case.id)


def test_other_tilings(monkeypatch) -> None:
    """Force other tile sizes: a forest tile of a whole word, context tiles smaller than a block."""
    monkeypatch.setattr(fa, "_TILE_F", 64)
    monkeypatch.setattr(fa, "_TILE_N", 16)
    inp = Case((45, 3), ("random:70", "multi:66"), gqa=2, head_dim=64, block_size=32).inputs(torch.float32)
    assert_verbose_allclose(run_kernel(inp), forest_attention_ref(*inp.args()), *TOLERANCES[torch.float32])


def test_strided_views() -> None:
    """q and out as head slices of wider buffers; K and V as the two halves of vLLM 0.26's packed cache
    (memory [num_blocks, block_size, kv_heads, 2 * head_dim]), so their head stride is 2 * head_dim."""
    inp = Case((19, 40), ("random:13", "beam2:8"), gqa=2, head_dim=64).inputs(torch.float32)
    t, h, d = inp.q.shape
    qkv = torch.randn(t, 3 * h, d, device=DEVICE)
    qkv[:, :h] = inp.q
    kv = torch.cat([inp.key_cache, inp.value_cache], dim=-1)  # [num_blocks, block_size, kv_heads, 2 * d]
    wide_out = torch.full((t, h + 3, d), float("nan"), device=DEVICE)
    out = forest_attention(qkv[:, :h], kv[..., :d], kv[..., d:], *inp.args()[3:], wide_out[:, 1:h + 1],
                           validate=True)
    assert out.data_ptr() == wide_out[:, 1:].data_ptr()
    assert_verbose_allclose(out, forest_attention_ref(*inp.args()), *TOLERANCES[torch.float32])
    assert wide_out[:, 0].isnan().all() and wide_out[:, h + 1:].isnan().all(), "wrote outside out's view"


def test_bits_beyond_forest_are_ignored_and_empty_rows_are_zero() -> None:
    inp = Case((0, 9), ("chain:3", "star:5"), gqa=1, head_dim=64).inputs(torch.float32)
    clean = run_kernel(inp)
    inp.ancestor_mask |= torch.tensor(-1 << 5, dtype=torch.int64)  # set every bit >= 5 (beyond both forests)
    assert_verbose_allclose(run_kernel(inp), clean, 0.0, 0.0, what="high bits changed the output")
    inp.ancestor_mask[1] = 0  # request 0 has no context: its node 1 now sees nothing
    out = run_kernel(inp)
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1]).cpu())
    assert torch.equal(forest_attention_ref(*inp.args())[1].cpu(), torch.zeros_like(out[1]).cpu())


def test_empty_batch() -> None:
    inp = Case((4,), ("chain:2",), gqa=1, head_dim=64).inputs(torch.float32)
    args = list(inp.args())
    args[0] = inp.q[:0]
    args[4] = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    args[7] = inp.ancestor_mask[:0]
    out = torch.empty_like(args[0])
    assert forest_attention(*args, out) is out


# ---- contracts --------------------------------------------------------------------------------------------------

def _broken(name: str):
    inp = Case((9, 3), ("chain:4", "star:3"), gqa=2, head_dim=64).inputs(torch.float32)
    a = dict(zip(["q", "key_cache", "value_cache", "block_table", "cu_seqlens_q", "context_lens", "forest_lens",
                  "ancestor_mask", "softmax_scale"], inp.args()))
    a["out"] = torch.empty_like(inp.q)
    validate = name.startswith("value-")
    if name == "q-2d":
        a["q"] = a["q"][:, 0]
    elif name == "cache-dtype":
        a["key_cache"] = a["key_cache"].half()
    elif name == "heads-not-multiple":
        a["q"] = a["q"][:, :3]
        a["out"] = a["out"][:, :3]
    elif name == "head-dim":
        a["q"] = a["q"][..., :32]
    elif name == "block-table-int64":
        a["block_table"] = a["block_table"].long()
    elif name == "cu-length":
        a["cu_seqlens_q"] = a["cu_seqlens_q"][:-1]
    elif name == "mask-int32":
        a["ancestor_mask"] = a["ancestor_mask"].int()
    elif name == "mask-rows":
        a["ancestor_mask"] = a["ancestor_mask"][:-1]
    elif name == "out-strided-d":
        a["out"] = torch.empty(*inp.q.shape[:2], 2 * inp.q.shape[2], device=DEVICE)[..., ::2]
    elif name == "value-forest-too-big":
        a["forest_lens"] = torch.tensor([65, 3], dtype=torch.int32, device=DEVICE)
    elif name == "value-block-table-narrow":
        a["context_lens"] = torch.tensor([9, 1000], dtype=torch.int32, device=DEVICE)
    elif name == "value-cu-end":
        a["cu_seqlens_q"] = torch.tensor([0, 4, 6], dtype=torch.int32, device=DEVICE)
    elif name == "value-block-id":
        a["block_table"] = a["block_table"].clone()
        a["block_table"][0, 0] = 10_000
    else:
        raise AssertionError(name)
    return a, validate


BROKEN = ["q-2d", "cache-dtype", "heads-not-multiple", "head-dim", "block-table-int64", "cu-length", "mask-int32",
          "mask-rows", "out-strided-d", "value-forest-too-big", "value-block-table-narrow", "value-cu-end",
          "value-block-id"]


@pytest.mark.parametrize("name", BROKEN)
def test_contract_errors(name: str) -> None:
    a, validate = _broken(name)
    with pytest.raises(ValueError):
        forest_attention(**a, validate=validate)


# ---- the bitmask helper (pure torch) ------------------------------------------------------------------------------

def _oracle_masks(parents: list[int], words: int) -> list[set[int]]:
    return [set(root_path(parents, j)) for j in range(len(parents))]


@pytest.mark.parametrize("kind,n", [("single", 1), ("chain", 64), ("chain", 65), ("star", 9), ("random", 130),
                                    ("multi", 40), ("shuffled", 77), ("beam4", 32)],
                         ids=lambda v: str(v))
def test_ancestor_bitmask(kind: str, n: int) -> None:
    parents = forest_parents(kind, n, seed=n)
    mask = ancestor_bitmask(torch.tensor(parents), validate=True)
    assert mask.shape == (n, num_mask_words(n)) and mask.dtype == torch.int64
    bits = unpack_bitmask(mask, n)
    for j, want in enumerate(_oracle_masks(parents, mask.shape[1])):
        assert set(torch.nonzero(bits[j]).flatten().tolist()) == want, f"node {j}"


def test_ancestor_bitmask_ragged() -> None:
    forests = [forest_parents("random", 5, 1), forest_parents("chain", 70, 2), [-1], forest_parents("multi", 12, 3)]
    flat = torch.tensor([p for f in forests for p in f])
    cu = torch.tensor([0] + [len(f) for f in forests]).cumsum(0)
    mask = ancestor_bitmask(flat, cu, max_nodes=70, validate=True)
    assert mask.shape == (flat.numel(), 2)
    for r, f in enumerate(forests):
        bits = unpack_bitmask(mask[int(cu[r]):int(cu[r + 1])], 128)
        for j, want in enumerate(_oracle_masks(f, 2)):
            assert set(torch.nonzero(bits[j]).flatten().tolist()) == want, f"request {r} node {j}"


@pytest.mark.parametrize("parents,cu,max_nodes", [
    ([-1, 2, 1], None, None),  # cycle 1 <-> 2
    ([-1, 3], None, None),  # parent out of range
    ([-1, -2], None, None),  # below -1
    ([-1, 0, 0], [0, 3], 2),  # forest larger than max_nodes
], ids=["cycle", "parent-out-of-range", "parent-below-minus-one", "max-nodes-too-small"])
def test_ancestor_bitmask_rejects(parents, cu, max_nodes) -> None:
    with pytest.raises(ValueError):
        ancestor_bitmask(torch.tensor(parents), None if cu is None else torch.tensor(cu), max_nodes, validate=True)
