"""Ancestor-or-self bitmasks over a request's forest nodes (pure torch, any device, no host sync).

Encoding: query token t may see forest node j of its own request iff bit ``j % 64`` of word ``j // 64`` of
``mask[t]`` is set; ``mask`` is int64 ``[num_q_tokens, num_words]`` and bit 63 is the sign bit (its value is a
bit pattern, not a number). ``num_words * 64`` is the largest forest the mask can describe.
"""

from __future__ import annotations

import math

import torch

from .._utils import require

WORD_BITS = 64


def num_mask_words(max_nodes: int) -> int:
    """Words per mask row for forests of up to ``max_nodes`` nodes (at least one word)."""
    require(max_nodes >= 0, f"max_nodes must be >= 0, got {max_nodes}")
    return max(1, -(-max_nodes // WORD_BITS))


def _bit_values(bit_index: torch.Tensor) -> torch.Tensor:
    """int64 ``1 << bit_index`` for bit indices in [0, 64), with bit 63 as the sign bit."""
    one = torch.ones_like(bit_index, dtype=torch.int64)
    return torch.where(
        bit_index == WORD_BITS - 1,
        torch.full_like(one, torch.iinfo(torch.int64).min),
        one << bit_index.clamp(max=WORD_BITS - 2),
    )


def ancestor_bitmask(
    parents: torch.Tensor,
    cu_nodes: torch.Tensor | None = None,
    max_nodes: int | None = None,
    *,
    validate: bool = False,
) -> torch.Tensor:
    """Ancestor-or-self bitmask of every forest node, from parent arrays.

    Args:
        parents: integer ``[num_nodes]``. ``parents[i]`` is the index of node i's parent *within its own forest*
            (local index), or -1 when node i hangs off the context (a root). Forests of all requests are concatenated.
        cu_nodes: int ``[num_reqs + 1]`` offsets of each request's forest in ``parents``; ``None`` = one forest.
        max_nodes: upper bound on any one forest's size (sets the word count); default ``parents.numel()``.
        validate: check parents are in range and acyclic (a host sync; for tests and debugging).

    Returns:
        int64 ``[num_nodes, num_mask_words(max_nodes)]``: row i has the bits of i and of all its ancestors, in local
        indices. Select rows to get the mask of a subset of query nodes (e.g. the newest depth of a beam step).

    Pointer doubling: after round k a row holds the 2**k nearest nodes of its root path, so ceil(log2(max_nodes))
    rounds of vectorised gathers suffice, whatever the forest's shape and node order.
    """
    require(parents.dim() == 1, f"parents must be 1-D, got shape {tuple(parents.shape)}")
    require(not parents.is_floating_point(), f"parents must be an integer tensor, got {parents.dtype}")
    n = parents.numel()
    max_nodes = n if max_nodes is None else max_nodes
    num_words = num_mask_words(max_nodes)
    parents = parents.to(torch.int64)
    # every tensor derives from ``parents`` (no device argument): the mask is built wherever the parents are
    idx = torch.ones_like(parents).cumsum(0) - 1
    if cu_nodes is None:
        start = torch.zeros_like(idx)
        size = torch.full_like(idx, n)
    else:
        require(cu_nodes.dim() == 1 and cu_nodes.numel() >= 1, "cu_nodes must be 1-D [num_reqs + 1]")
        cu = cu_nodes.to(parents)
        req = torch.searchsorted(cu[1:], idx, right=True).clamp(max=cu.numel() - 2)
        start = cu[req]
        size = cu[req + 1] - start
    local = idx - start
    if validate:
        require(cu_nodes is None or int(cu_nodes[-1]) == n, "cu_nodes[-1] must equal parents.numel()")
        require(bool((size <= max_nodes).all()), f"a forest has more than max_nodes={max_nodes} nodes")
        require(bool(((parents >= -1) & (parents < size)).all()), "parents must be -1 or a local index in the forest")
    has_parent = parents >= 0
    jump = torch.where(has_parent, parents + start, -1)  # [n] global index of the 2**k-th ancestor
    mask = parents.new_zeros(n, num_words)
    mask.scatter_(1, (local // WORD_BITS)[:, None], _bit_values(local % WORD_BITS)[:, None])
    for _ in range(max(0, math.ceil(math.log2(max(max_nodes, 1))))):
        has = jump >= 0
        safe = jump.clamp(min=0)
        mask = mask | torch.where(has[:, None], mask[safe], 0)
        jump = torch.where(has, jump[safe], -1)
    if validate:
        require(not bool((jump >= 0).any()), "parents contain a cycle (or max_nodes is smaller than a root path)")
    return mask


def unpack_bitmask(mask: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """bool ``[rows, num_nodes]`` view of int64 bitmask rows ``[rows, num_words]`` (bits >= num_nodes dropped)."""
    require(mask.dtype == torch.int64 and mask.dim() == 2, "mask must be int64 [rows, num_words]")
    require(num_nodes <= mask.shape[1] * WORD_BITS, f"{num_nodes} nodes do not fit in {mask.shape[1]} words")
    j = torch.arange(num_nodes, device=mask.device)
    return ((mask[:, j // WORD_BITS] >> (j % WORD_BITS)) & 1).bool()
