"""Forest attention over a paged KV cache: the public entry point (thin wrapper over ``kernel.py``).

One kernel serves every attention pass of DSBD: the target's verification of a whole forest (queries = all n nodes,
each masked to its ancestors and itself), the draft's beam steps (queries = the newest depth's nodes, masks over the
forest so far) and plain decode (one node whose mask is bit 0). See ``triton_kernels/README.md`` for the math.
"""

from __future__ import annotations

import math

import torch
import triton

from .._utils import check_device, check_launchable, require
from .batched import forest_attention_batched
from .inputs import ForestAttentionInputs, beam_forest_parents
from .kernel import forest_attention_kernel
from .mask import WORD_BITS, ancestor_bitmask, num_mask_words, unpack_bitmask
from .naive import forest_attention_ref

__all__ = [
    "ForestAttentionInputs",
    "WORD_BITS",
    "ancestor_bitmask",
    "beam_forest_parents",
    "forest_attention",
    "forest_attention_batched",
    "forest_attention_ref",
    "num_mask_words",
    "unpack_bitmask",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Tile sizes (positions per K/V tile). Module constants so tests can force rare paths (e.g. several tiles per word).
_TILE_N = 32  # context tile
_TILE_F = 16  # forest tile; must divide 64 so that a tile lies inside one mask word


def _check_index(name: str, t: torch.Tensor, dim: int, dtype: torch.dtype) -> None:
    require(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    require(t.dim() == dim, f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    require(t.stride(-1) == 1, f"{name} must have unit stride in its last dimension")


def forest_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    forest_lens: torch.Tensor,
    ancestor_mask: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor,
    *,
    validate: bool = False,
) -> torch.Tensor:
    """Attention of a ragged batch of forest query tokens over a paged KV cache; writes and returns ``out``.

    Request r owns query tokens ``q[cu_seqlens_q[r]:cu_seqlens_q[r+1]]``, ``context_lens[r]`` tokens of context at
    logical positions [0, ctx) and a forest of ``forest_lens[r]`` nodes whose K/V are already in the cache at
    logical positions ctx + j. A query token sees every context position and the forest node j iff bit j of its
    mask row is set; a query that sees nothing gets zeros. Logical position t of request r lives in the cache slot
    ``block_table[r, t // block_size] * block_size + t % block_size``.

    Args:
        q: ``[num_q_tokens, num_heads, head_dim]`` fp16/bf16/fp32 (fp32 or fp16 under the interpreter).
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype; unit stride in head_dim.
        value_cache: same shape and dtype as ``key_cache`` (strides may differ, e.g. views of one KV tensor).
        block_table: int32 ``[num_reqs, max_blocks_per_req]``; must cover ctx + forest_lens positions.
        cu_seqlens_q: int32 ``[num_reqs + 1]``, non-decreasing, from 0 to num_q_tokens.
        context_lens: int32 ``[num_reqs]``, >= 0 (0 = the forest alone).
        forest_lens: int32 ``[num_reqs]``, in [0, 64 * num_words]; bits at or above it are ignored.
        ancestor_mask: int64 ``[num_q_tokens, num_words]``; bit j % 64 of word j // 64 = node j is visible
            (``ancestor_bitmask`` builds it from parent arrays).
        softmax_scale: scale of q.k before the softmax (usually head_dim ** -0.5).
        out: ``[num_q_tokens, num_heads, head_dim]``, q's dtype; unit stride in head_dim.
        validate: also check values (lengths, block ids): reads them on the host, so only for tests and debugging.

    Raises ValueError on a broken contract. No host sync unless ``validate``; grid and compiled variants depend only
    on shapes, so it is CUDA-graph friendly (num_reqs is not specialised on).
    """
    require(q.dim() == 3, f"q must be [num_q_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    require(q.dtype in _DTYPES, f"q dtype must be one of {_DTYPES}, got {q.dtype}")
    num_tokens, num_heads, head_dim = q.shape
    require(key_cache.dim() == 4, f"key_cache must be [num_blocks, block_size, kv_heads, head_dim], got "
            f"{tuple(key_cache.shape)}")
    require(value_cache.shape == key_cache.shape, f"value_cache shape {tuple(value_cache.shape)} != key_cache shape "
            f"{tuple(key_cache.shape)}")
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    require(cache_head_dim == head_dim, f"cache head_dim {cache_head_dim} != q head_dim {head_dim}")
    require(num_kv_heads > 0 and num_heads % num_kv_heads == 0,
            f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        require(t.dtype == q.dtype, f"{name} dtype {t.dtype} != q dtype {q.dtype}")
    require(out.shape == q.shape, f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        require(t.stride(-1) == 1, f"{name} must have unit stride in head_dim")
    _check_index("block_table", block_table, 2, torch.int32)
    _check_index("cu_seqlens_q", cu_seqlens_q, 1, torch.int32)
    _check_index("context_lens", context_lens, 1, torch.int32)
    _check_index("forest_lens", forest_lens, 1, torch.int32)
    _check_index("ancestor_mask", ancestor_mask, 2, torch.int64)
    num_reqs = context_lens.shape[0]
    require(cu_seqlens_q.shape[0] == num_reqs + 1, f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries, expected "
            f"num_reqs + 1 = {num_reqs + 1}")
    require(forest_lens.shape[0] == num_reqs, f"forest_lens has {forest_lens.shape[0]} entries, expected {num_reqs}")
    require(block_table.shape[0] >= num_reqs, f"block_table has {block_table.shape[0]} rows < num_reqs {num_reqs}")
    require(ancestor_mask.shape[0] == num_tokens, f"ancestor_mask has {ancestor_mask.shape[0]} rows, expected "
            f"num_q_tokens = {num_tokens}")
    require(ancestor_mask.shape[1] >= 1, "ancestor_mask needs at least one word per row")
    device = q.device
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("out", out),
                    ("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q), ("context_lens", context_lens),
                    ("forest_lens", forest_lens), ("ancestor_mask", ancestor_mask)):
        check_device(name, t, device)
    check_launchable(forest_attention_kernel, device, "forest_attention", "forest_attention_ref")
    if validate:
        _validate_values(block_table, cu_seqlens_q, context_lens, forest_lens, num_tokens,
                         ancestor_mask.shape[1], num_blocks, block_size)
    if num_tokens == 0 or num_reqs == 0:
        return out

    group = num_heads // num_kv_heads
    block_m = 16 if group <= 16 else triton.next_power_of_2(group)  # tl.dot wants >= 16 rows
    block_q = block_m // group
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    forest_attention_kernel[grid](
        out, q, key_cache, value_cache, block_table, cu_seqlens_q, context_lens, forest_lens, ancestor_mask,
        softmax_scale * math.log2(math.e),
        num_reqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), ancestor_mask.stride(0),
        QUERIES_PER_KV=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=_TILE_N,
        TILE_F=_TILE_F,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


def _validate_values(block_table, cu_seqlens_q, context_lens, forest_lens, num_tokens, num_words, num_blocks,
                     block_size) -> None:
    """Value checks of the contract (host sync)."""
    cu = cu_seqlens_q.long().cpu()
    require(int(cu[0]) == 0 and int(cu[-1]) == num_tokens, f"cu_seqlens_q must run from 0 to {num_tokens}")
    require(bool((cu[1:] >= cu[:-1]).all()), "cu_seqlens_q must be non-decreasing")
    ctx, n = context_lens.long().cpu(), forest_lens.long().cpu()
    require(bool((ctx >= 0).all()), "context_lens must be >= 0")
    require(bool(((n >= 0) & (n <= WORD_BITS * num_words)).all()),
            f"forest_lens must be in [0, {WORD_BITS * num_words}] (64 * ancestor_mask words)")
    used_blocks = -(-(ctx + n) // block_size)
    require(bool((used_blocks <= block_table.shape[1]).all()), "block_table is too narrow for ctx + forest_lens")
    bt = block_table.long().cpu()
    for r, nb in enumerate(used_blocks.tolist()):
        ids = bt[r, :nb]
        require(bool(((ids >= 0) & (ids < num_blocks)).all()), f"block_table row {r} has a block id out of range")
