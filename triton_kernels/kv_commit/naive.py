"""Torch reference of the KV commit / copy: gather every source, then scatter (the semantics the kernel keeps).

Planes are any 4-D ``[num_blocks, block_size, heads, inner]`` tensors or views (see ``KVCacheTable``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def copy_kv_slots_ref(caches: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """In place, for every cache ``[num_blocks, block_size, ...]``: ``cache[dst] = old cache[src]`` slot by slot.

    Slot s is ``cache[s // block_size, s % block_size]``. Pairs with a negative slot (vLLM's PADDING_SLOT_ID = -1)
    are skipped. All sources are read before any destination is written, so any overlap is handled.
    """
    keep = (src_slots >= 0) & (dst_slots >= 0)
    src, dst = src_slots[keep].long(), dst_slots[keep].long()
    for cache in caches:
        bs = cache.shape[1]
        vals = cache[src // bs, src % bs].clone()
        cache[dst // bs, dst % bs] = vals


def copy_kv_blocks_ref(caches: Sequence[torch.Tensor], src_blocks: torch.Tensor, dst_blocks: torch.Tensor) -> None:
    """In place, for every cache: ``cache[dst_blocks[i]] = old cache[src_blocks[i]]`` (whole blocks, negative =
    skip)."""
    keep = (src_blocks >= 0) & (dst_blocks >= 0)
    src, dst = src_blocks[keep].long(), dst_blocks[keep].long()
    for cache in caches:
        vals = cache[src].clone()
        cache[dst] = vals
