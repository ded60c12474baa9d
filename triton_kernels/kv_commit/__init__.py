"""KV commit / copy across every layer of a paged KV cache in one launch: the public entry points.

Two uses in DSBD: *commit* (compaction) moves the K/V of the accepted forest path into the first slots after the
context, ``dst_k = ctx + k`` from ``src_k = ctx + n_k`` with n_k >= k increasing, so sources and destinations
overlap; *fork* copies whole blocks to fresh blocks for a beam that leaves a shared block. See
``triton_kernels/README.md`` for the ordering guarantee.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

from .._utils import check_device, check_launchable, is_interpreted, require
from .kernel import kv_copy_kernel
from .naive import copy_kv_blocks_ref, copy_kv_slots_ref

__all__ = ["KVCacheTable", "copy_kv_blocks", "copy_kv_blocks_ref", "copy_kv_slots", "copy_kv_slots_ref"]

# Pairs per tile: any overlap among the pairs of one tile is exact (see kernel.py). A module constant so tests can
# shrink it and cross tile boundaries on tiny inputs.
_PAIRS_PER_TILE = 16  # a power of two
_MAX_BLOCK_E = 256  # elements of a slot per program
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, eq=False)
class KVCacheTable:
    """Every cache plane of a model, addressed by one kernel launch.

    A plane is a 4-D ``[num_blocks, block_size, heads, inner]`` tensor or view, unit stride in ``inner``, any other
    strides; all planes share shape, dtype, device and strides. vLLM 0.26 packs K and V of a layer into one tensor
    of logical shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``: pass ``kv.transpose(1, 2)`` of each
    layer (one plane holds K and V; NHD and HND layouts both work). Separate K and V tensors
    ``[num_blocks, block_size, num_kv_heads, head_size]`` are two planes each; a stacked
    ``[layers, num_blocks, ...]`` tensor is ``stacked.unbind(0)``.

    Build it once after the KV caches are allocated and keep it: it holds the planes alive and an int64 table of
    their element offsets from the first plane, on their device.
    """

    caches: tuple[torch.Tensor, ...]  # num_planes x [num_blocks, block_size, heads, inner]
    offsets: torch.Tensor  # int64 [num_planes]: offset of each plane from caches[0], in units of offset_unit
    offset_unit: int  # elements: 16 when every offset is a multiple of 16 (aligned planes), else 1
    num_blocks: int
    block_size: int
    heads: int
    inner: int
    stride_block: int  # elements
    stride_slot: int  # elements
    stride_head: int  # elements

    @classmethod
    def from_caches(cls, caches: Sequence[torch.Tensor]) -> KVCacheTable:
        caches = tuple(caches)
        require(len(caches) >= 1, "KVCacheTable needs at least one cache plane")
        first = caches[0]
        require(first.dim() == 4, f"a plane must be [num_blocks, block_size, heads, inner], got {tuple(first.shape)}")
        require(first.shape[0] >= 1 and first.shape[1] >= 1, "a plane needs at least one block of one slot")
        require(first.stride(3) == 1 or first.shape[3] == 1, "a plane must have unit stride in its last dimension")
        require(first.element_size() in _INT_OF_SIZE, f"unsupported element size {first.element_size()}")
        for i, c in enumerate(caches):
            require(c.shape == first.shape, f"plane {i} has shape {tuple(c.shape)} != {tuple(first.shape)}")
            require(c.dtype == first.dtype, f"plane {i} has dtype {c.dtype} != {first.dtype}")
            require(c.stride() == first.stride(), f"plane {i} has strides {c.stride()} != {first.stride()}")
            check_device(f"plane {i}", c, first.device)
        if first.device.type != "cpu":
            require(not is_interpreted(kv_copy_kernel), "under TRITON_INTERPRET=1 the planes must be CPU tensors: "
                    "the interpreter copies kernel arguments to the host but not memory reached through offsets")
        esize = first.element_size()
        deltas = [c.data_ptr() - first.data_ptr() for c in caches]
        require(all(d % esize == 0 for d in deltas), "plane addresses are not element-aligned to each other")
        offsets = [d // esize for d in deltas]
        unit = 16 if all(o % 16 == 0 for o in offsets) else 1
        return cls(
            caches=caches,
            offsets=torch.tensor([o // unit for o in offsets], dtype=torch.int64, device=first.device),
            offset_unit=unit,
            num_blocks=first.shape[0],
            block_size=first.shape[1],
            heads=first.shape[2],
            inner=first.shape[3],
            stride_block=first.stride(0),
            stride_slot=first.stride(1),
            stride_head=first.stride(2),
        )

    @property
    def num_planes(self) -> int:
        return len(self.caches)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def device(self) -> torch.device:
        return self.caches[0].device


def copy_kv_slots(
    table: KVCacheTable,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    may_overlap: bool = True,
    validate: bool = False,
) -> None:
    """Copy the K/V of slot ``src_slots[i]`` to slot ``dst_slots[i]`` in every plane of ``table``, one launch.

    Result: as if every source were read before any destination is written (``copy_kv_slots_ref``), provided that
    no pair reads a slot written by a pair more than a tile (16 pairs) before it; pairs inside one tile may overlap
    in any way (a swap, say). Commit compaction (dst_k = ctx + k <= src_k = ctx + n_k, n increasing) and forks into
    fresh blocks always qualify. Copies are bitwise (any dtype of 1, 2, 4 or 8 bytes); slot s of a plane is
    ``plane[s // block_size, s % block_size]``.

    Args:
        table: the model's cache planes (``KVCacheTable.from_caches``).
        src_slots: int64 ``[M]`` physical slots (block * block_size + offset); negative = padding, pair skipped.
        dst_slots: int64 ``[M]`` physical slots, distinct among non-padding pairs; negative = padding.
        may_overlap: False promises no source is another pair's destination (e.g. a fork into fresh blocks): the
            pairs are then also spread over programs, which is faster for large M.
        validate: check the slot ranges, distinct destinations and the ordering condition above (host sync).

    Raises ValueError on a broken contract. No host sync unless ``validate``.
    """
    require(isinstance(table, KVCacheTable), "table must be a KVCacheTable")
    for name, t in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        require(t.dtype == torch.int64, f"{name} must be int64, got {t.dtype}")
        require(t.dim() == 1 and t.is_contiguous(), f"{name} must be a contiguous 1-D tensor")
        check_device(name, t, table.device)
    require(src_slots.shape == dst_slots.shape, f"src_slots {tuple(src_slots.shape)} and dst_slots "
            f"{tuple(dst_slots.shape)} differ in length")
    check_launchable(kv_copy_kernel, table.device, "copy_kv_slots", "copy_kv_slots_ref")
    num_pairs = src_slots.shape[0]
    if validate:
        _validate_pairs(src_slots, dst_slots, table.num_slots, may_overlap)
    if num_pairs == 0:
        return
    anchor = table.caches[0].view(_INT_OF_SIZE[table.caches[0].element_size()])
    slot_numel = table.heads * table.inner
    block_e = min(_MAX_BLOCK_E, triton.next_power_of_2(slot_numel))
    groups = 1 if may_overlap else triton.cdiv(num_pairs, _PAIRS_PER_TILE)
    grid = (table.num_planes, triton.cdiv(slot_numel, block_e), groups)
    kv_copy_kernel[grid](
        anchor, table.offsets, src_slots, dst_slots, num_pairs, table.stride_block, table.stride_slot,
        table.stride_head,
        BLOCK_SIZE=table.block_size,
        SLOT_HEADS=table.heads,
        INNER=table.inner,
        BLOCK_P=_PAIRS_PER_TILE,
        BLOCK_E=block_e,
        OFFSET_UNIT=table.offset_unit,
    )


def copy_kv_blocks(
    table: KVCacheTable,
    src_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    *,
    may_overlap: bool = True,
    validate: bool = False,
) -> None:
    """Copy whole blocks: block ``src_blocks[i]`` to block ``dst_blocks[i]`` in every plane (a beam fork).

    Args:
        table: the model's cache planes.
        src_blocks: int32/int64 ``[B]`` physical block ids; negative = padding.
        dst_blocks: int32/int64 ``[B]`` distinct physical block ids; negative = padding.
        may_overlap, validate: as in ``copy_kv_slots`` (which this calls on the blocks' slots, block by block).
    """
    for name, t in (("src_blocks", src_blocks), ("dst_blocks", dst_blocks)):
        require(t.dtype in (torch.int32, torch.int64), f"{name} must be int32 or int64, got {t.dtype}")
        require(t.dim() == 1, f"{name} must be 1-D")
        check_device(name, t, table.device)
    require(src_blocks.shape == dst_blocks.shape, "src_blocks and dst_blocks differ in length")
    offs = torch.arange(table.block_size, device=table.device, dtype=torch.int64)

    def slots(blocks: torch.Tensor) -> torch.Tensor:
        b = blocks.to(torch.int64)[:, None]
        return torch.where(b >= 0, b * table.block_size + offs, -1).reshape(-1)

    copy_kv_slots(table, slots(src_blocks), slots(dst_blocks), may_overlap=may_overlap, validate=validate)


def _validate_pairs(src: torch.Tensor, dst: torch.Tensor, num_slots: int, may_overlap: bool) -> None:
    """The value contract of ``copy_kv_slots`` (host sync)."""
    src, dst = src.cpu(), dst.cpu()
    require(bool(((src < num_slots) & (dst < num_slots)).all()), f"a slot id is >= num_slots = {num_slots}")
    live = torch.nonzero((src >= 0) & (dst >= 0)).flatten()  # pair indices, in the kernel's numbering
    if live.numel() == 0:
        return
    live_dst = dst[live]
    require(live_dst.unique().numel() == live_dst.numel(), "dst_slots must be distinct (apart from padding)")
    sorted_dst, order = torch.sort(live_dst)
    hit = torch.searchsorted(sorted_dst, src[live]).clamp(max=sorted_dst.numel() - 1)
    found = sorted_dst[hit] == src[live]
    reader = live[found]  # pair j reads a slot that ...
    writer = live[order[hit[found]]]  # ... pair i writes
    if may_overlap:
        bad = (writer < reader) & (writer // _PAIRS_PER_TILE != reader // _PAIRS_PER_TILE)
        require(not bool(bad.any()), "a pair reads a slot written by a pair of an earlier tile: reorder the pairs "
                f"so that every slot is read before it is overwritten (tile = {_PAIRS_PER_TILE} pairs)")
    else:
        require(bool((writer == reader).all()), "may_overlap=False but a source is another pair's destination")
