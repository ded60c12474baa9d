"""Forest-attention inputs in a paged cache (one typed batch, and random ones by `make_dummy`): what the kernel tests and the kernel benchmark feed the kernel and its references."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .mask import ancestor_bitmask, num_mask_words


def beam_forest_parents(width: int, depth: int) -> list[int]:
    """DSBD's draft forest of one request: ``depth`` layers of ``width`` nodes, depth-major, each node's parent a
    node of the layer above (node k of layer d hangs off node k of layer d-1; layer 0 hangs off the context)."""
    return [-1 if d == 0 else (d - 1) * width + k for d in range(depth) for k in range(width)]


@dataclass
class ForestAttentionInputs:
    """One ragged batch of forest queries over a paged cache, with everything the kernel and its oracles need."""

    q: torch.Tensor  # [num_q_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    cu_seqlens_q: torch.Tensor  # int32 [num_reqs + 1]
    context_lens: torch.Tensor  # int32 [num_reqs]
    forest_lens: torch.Tensor  # int32 [num_reqs]
    ancestor_mask: torch.Tensor  # int64 [num_q_tokens, num_words]
    softmax_scale: float
    parents: list[list[int]]  # per request: local parent of each forest node (-1 = root)
    query_nodes: list[list[int]]  # per request: the forest node each query token stands for

    def args(self) -> tuple:
        """Positional arguments of ``forest_attention`` / ``forest_attention_ref`` (without ``out``)."""
        return (self.q, self.key_cache, self.value_cache, self.block_table, self.cu_seqlens_q, self.context_lens,
                self.forest_lens, self.ancestor_mask, self.softmax_scale)

    @classmethod
    def make_dummy(
        cls,
        context_lens: Sequence[int],
        parents: Sequence[Sequence[int]],
        *,
        num_kv_heads: int,
        queries_per_kv: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        block_size: int = 16,
        query_nodes: Sequence[Sequence[int]] | None = None,
        max_nodes: int | None = None,
        spare_blocks: int = 3,
        seed: int = 0,
    ) -> ForestAttentionInputs:
        """Random q/K/V in a cache whose physical blocks are a random permutation; every slot that the batch does
        not own (other blocks, the tail of a request's last block) holds NaN, so a kernel that reads outside the
        contract fails. Unused block-table entries point at NaN blocks too.

        ``query_nodes[r]`` lists the forest nodes of request r that are queries (default: all of them, the
        verification pass); the query of node j carries node j's ancestor-or-self mask.
        """
        device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)  # host: block tables and q
        dev_gen = torch.Generator(device=device).manual_seed(seed)  # device: the (possibly large) K/V
        num_reqs = len(context_lens)
        forest_lens = [len(p) for p in parents]
        if query_nodes is None:
            query_nodes = [list(range(n)) for n in forest_lens]
        max_nodes = max(max(forest_lens, default=1), 1) if max_nodes is None else max_nodes
        seq_lens = [c + n for c, n in zip(context_lens, forest_lens)]
        blocks_per_req = [-(-s // block_size) for s in seq_lens]
        width = max(max(blocks_per_req, default=1), 1)
        num_blocks = sum(blocks_per_req) + spare_blocks
        num_heads = num_kv_heads * queries_per_kv
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        key_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        value_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        perm = torch.randperm(num_blocks, generator=gen)
        block_table = perm[torch.randint(0, num_blocks, (num_reqs, width), generator=gen)]  # unused entries: any
        taken = 0
        for r, nb in enumerate(blocks_per_req):
            block_table[r, :nb] = perm[taken:taken + nb]
            taken += nb
            pos = torch.arange(seq_lens[r], device=device)
            blk, off = block_table[r].to(device)[pos // block_size], pos % block_size
            kv_shape = (seq_lens[r], num_kv_heads, head_dim)
            key_cache[blk, off] = torch.randn(kv_shape, generator=dev_gen, device=device).to(dtype)
            value_cache[blk, off] = torch.randn(kv_shape, generator=dev_gen, device=device).to(dtype)
        # Spare blocks never owned by a request stay NaN; so do block tails beyond each request's last position.
        flat_parents = torch.tensor([p for ps in parents for p in ps], dtype=torch.int64)
        cu_nodes = torch.tensor([0] + forest_lens).cumsum(0)
        node_masks = ancestor_bitmask(flat_parents, cu_nodes, max_nodes, validate=True)
        rows = [int(cu_nodes[r]) + j for r in range(num_reqs) for j in query_nodes[r]]
        ancestor_mask = node_masks[rows] if rows else torch.zeros(0, num_mask_words(max_nodes), dtype=torch.int64)
        num_q = [len(qn) for qn in query_nodes]
        q = torch.randn(sum(num_q), num_heads, head_dim, generator=gen).to(dtype)
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            q=q.to(device),
            key_cache=key_cache,
            value_cache=value_cache,
            block_table=block_table.to(**i32),
            cu_seqlens_q=torch.tensor([0] + num_q).cumsum(0).to(**i32),
            context_lens=torch.tensor(list(context_lens)).to(**i32),
            forest_lens=torch.tensor(forest_lens).to(**i32),
            ancestor_mask=ancestor_mask.to(device),
            softmax_scale=head_dim ** -0.5,
            parents=[list(p) for p in parents],
            query_nodes=[list(qn) for qn in query_nodes],
        )
