"""KV commit / copy: the ``@triton.jit`` kernel (launch it through the wrapper).

Copies slot ``src[i]`` to slot ``dst[i]`` in every cache plane (all layers' K and V) in one launch. The planes are
addressed as ``anchor_ptr + offsets[p]``: element offsets of each cache from the first one, so the one kernel
covers vLLM's separate per-layer tensors and views of a stacked tensor alike, and the pointer stays a real Triton
argument (typed, alignment-specialised, and valid under the interpreter on CPU tensors).

Grid: (planes, element chunks of a slot, pair groups). A program owns a column (plane, element chunk) and walks its
pairs in tiles of BLOCK_P in order: load the whole tile, barrier, store the tile, barrier. Ordered mode (one pair
group) therefore applies the tiles one after the other, each as "gather its sources, then scatter": that equals
gathering every source first whenever no pair reads a slot that a pair of an *earlier tile* writes, and any overlap
inside a tile is exact. The barriers matter on the GPU: without them one warp may store a
destination that another warp of the same program has not yet read as a source.
Naming (FLA): ``i_`` program indices, ``o_`` aranges, ``m_`` masks, ``b_`` register tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_pairs"])
def kv_copy_kernel(
    anchor_ptr,  # first cache, viewed as a same-width integer type (bitwise copy)
    offsets_ptr,  # int64 [num_planes] offset of each plane from anchor_ptr, in units of OFFSET_UNIT elements
    src_ptr,  # int64 [num_pairs] source slots (negative = padding, skipped)
    dst_ptr,  # int64 [num_pairs] destination slots (negative = padding, skipped)
    num_pairs,
    stride_block,  # elements between blocks
    stride_slot,  # elements between slots of a block
    stride_head,  # elements between heads of a slot
    BLOCK_SIZE: tl.constexpr,
    SLOT_HEADS: tl.constexpr,  # a slot is [SLOT_HEADS, INNER], INNER contiguous
    INNER: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    OFFSET_UNIT: tl.constexpr,  # 16 when every plane offset is a multiple of 16 elements (tells the compiler the
    # planes are as aligned as the anchor, so copies vectorise), else 1
):
    i_plane = tl.program_id(0)
    i_e = tl.program_id(1)
    i_g = tl.program_id(2)
    num_groups = tl.num_programs(2)
    p_base = anchor_ptr + tl.load(offsets_ptr + i_plane) * OFFSET_UNIT
    o_e = (i_e * BLOCK_E + tl.arange(0, BLOCK_E)).to(tl.int64)  # [BLOCK_E] element of the slot
    m_e = o_e < SLOT_HEADS * INNER
    e_off = (o_e // INNER) * stride_head + o_e % INNER  # [BLOCK_E] its offset from the slot's start
    o_p = tl.arange(0, BLOCK_P)
    for p0 in range(i_g * BLOCK_P, num_pairs, num_groups * BLOCK_P):
        m_p = p0 + o_p < num_pairs  # [BLOCK_P]
        src = tl.load(src_ptr + p0 + o_p, mask=m_p, other=-1)  # [BLOCK_P] int64
        dst = tl.load(dst_ptr + p0 + o_p, mask=m_p, other=-1)
        m_pair = (src >= 0) & (dst >= 0)
        src_off = (src // BLOCK_SIZE) * stride_block + (src % BLOCK_SIZE) * stride_slot  # [BLOCK_P]
        dst_off = (dst // BLOCK_SIZE) * stride_block + (dst % BLOCK_SIZE) * stride_slot
        m_tile = m_pair[:, None] & m_e[None, :]  # [BLOCK_P, BLOCK_E]
        b_x = tl.load(p_base + src_off[:, None] + e_off[None, :], mask=m_tile)
        tl.debug_barrier()  # every source of the tile is read before any destination is written
        tl.store(p_base + dst_off[:, None] + e_off[None, :], b_x, mask=m_tile)
        tl.debug_barrier()  # tiles apply in order: a later tile sees this tile's writes
