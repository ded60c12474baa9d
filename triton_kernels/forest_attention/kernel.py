"""Forest attention over a paged KV cache: the ``@triton.jit`` kernel (launch it through the wrapper).

Grid: (q blocks, kv heads). A q block is BLOCK_Q query tokens of one request times the QUERIES_PER_KV query heads
that share a kv head, packed into BLOCK_M rows (vLLM's unified-attention layout, so GQA reads each K/V tile once per
group). Each program runs one online softmax (base 2) over two phases:
  1. context: logical positions [0, ctx) in tiles of TILE_N, every row sees every position;
  2. forest:  positions ctx + j, j in [0, n) in tiles of TILE_F, row t sees j iff bit j of its ancestor mask is set.
Naming (FLA): ``i_`` program indices, ``o_`` aranges, ``m_`` masks, ``p_`` pointers, ``b_`` register tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

WORD_BITS: tl.constexpr = tl.constexpr(64)


@triton.jit
def _find_request(cu_seqlens_q_ptr, i_qb, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest r with cu[r] // BLOCK_Q + r <= i_qb: request r owns q blocks [cu[r] // BLOCK_Q + r, ...).

    That numbering gives every request ceil-ish(q_len / BLOCK_Q) + 1 >= its real count of blocks, so the grid
    ``num_q_tokens // BLOCK_Q + num_reqs`` covers all requests without reading lengths on the host.
    """
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_block <= i_qb:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_kv_tile(
    cache_ptr,
    p_block_row,  # block_table row of this request
    pos,  # [TILE] logical positions
    m_pos,  # [TILE] which positions exist
    i_kvh,  # int64 kv head
    o_d,  # [HEAD_DIM_PAD]
    m_d,  # [HEAD_DIM_PAD]
    stride_b,
    stride_s,
    stride_h,
    BLOCK_SIZE: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """K or V of a tile of logical positions through the block table: [HEAD_DIM_PAD, TILE] if TRANSPOSED else
    [TILE, HEAD_DIM_PAD]; missing positions read as 0 (never touching memory, which may hold NaN)."""
    block = tl.load(p_block_row + pos // BLOCK_SIZE, mask=m_pos, other=0).to(tl.int64)
    slot_off = block * stride_b + (pos % BLOCK_SIZE).to(tl.int64) * stride_s + i_kvh * stride_h  # [TILE]
    if TRANSPOSED:
        b_x = tl.load(cache_ptr + slot_off[None, :] + o_d[:, None], mask=m_d[:, None] & m_pos[None, :], other=0.0)
    else:
        b_x = tl.load(cache_ptr + slot_off[:, None] + o_d[None, :], mask=m_pos[:, None] & m_d[None, :], other=0.0)
    return b_x


@triton.jit
def _online_softmax_step(b_s, b_v, b_m, b_l, b_acc, DOT_PRECISION: tl.constexpr):
    """Fold one tile into the running (max, sum, acc). b_s: [BLOCK_M, TILE] scores in log2 units, -inf = hidden."""
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))  # [BLOCK_M]
    # A row that has seen nothing yet keeps max -inf; shift it by 0 so exp2 gives 0, not NaN.
    b_m_ref = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_p = tl.exp2(b_s - b_m_ref[:, None])  # [BLOCK_M, TILE]
    b_alpha = tl.exp2(b_m - b_m_ref)  # [BLOCK_M]
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
    return b_m_new, b_l, b_acc


@triton.jit(do_not_specialize=["num_reqs"])
def forest_attention_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, KVH, D]
    block_table_ptr,  # int32 [R, max_blocks]
    cu_seqlens_q_ptr,  # int32 [R + 1]
    context_lens_ptr,  # int32 [R]
    forest_lens_ptr,  # int32 [R]
    mask_ptr,  # int64 [T, num_words]
    qk_scale,  # softmax_scale * log2(e)
    num_reqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_mt,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    TILE_F: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tl.static_assert(WORD_BITS % TILE_F == 0, "a forest tile must lie inside one mask word")
    i_qb = tl.program_id(0)
    i_kvh = tl.program_id(1).to(tl.int64)
    i_r = _find_request(cu_seqlens_q_ptr, i_qb, num_reqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + i_r)
    q_len = tl.load(cu_seqlens_q_ptr + i_r + 1) - q_start
    i_qb_local = i_qb - (q_start // BLOCK_Q + i_r)
    if i_qb_local * BLOCK_Q >= q_len:
        return
    ctx = tl.load(context_lens_ptr + i_r)
    n_nodes = tl.load(forest_lens_ptr + i_r)

    o_m = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, HEAD_DIM_PAD)
    m_d = o_d < HEAD_DIM
    q_idx = i_qb_local * BLOCK_Q + o_m // QUERIES_PER_KV  # [BLOCK_M] query index within the request
    m_row = (o_m < BLOCK_Q * QUERIES_PER_KV) & (q_idx < q_len)  # [BLOCK_M]
    tok = (q_start + q_idx).to(tl.int64)  # [BLOCK_M] query token in the batch
    head = i_kvh * QUERIES_PER_KV + (o_m % QUERIES_PER_KV).to(tl.int64)  # [BLOCK_M] query head
    p_q = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]

    p_block_row = block_table_ptr + i_r.to(tl.int64) * stride_bt
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    # Phase 1: the context, visible to every query.
    o_n = tl.arange(0, TILE_N)
    for n0 in range(0, ctx, TILE_N):
        pos = n0 + o_n  # [TILE_N]
        m_pos = pos < ctx
        b_kt = _load_kv_tile(k_cache_ptr, p_block_row, pos, m_pos, i_kvh, o_d, m_d,
                             stride_kb, stride_ks, stride_kh, BLOCK_SIZE, True)  # [HEAD_DIM_PAD, TILE_N]
        b_v = _load_kv_tile(v_cache_ptr, p_block_row, pos, m_pos, i_kvh, o_d, m_d,
                            stride_vb, stride_vs, stride_vh, BLOCK_SIZE, False)  # [TILE_N, HEAD_DIM_PAD]
        b_s = tl.dot(b_q, b_kt, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        b_s = tl.where(m_row[:, None] & m_pos[None, :], b_s, float("-inf"))
        b_m, b_l, b_acc = _online_softmax_step(b_s, b_v, b_m, b_l, b_acc, DOT_PRECISION)

    # Phase 2: the forest, node j at position ctx + j, visible through bit j of the row's ancestor mask.
    o_f = tl.arange(0, TILE_F)
    p_mask_row = mask_ptr + tok * stride_mt  # [BLOCK_M]
    for f0 in range(0, n_nodes, TILE_F):
        node = f0 + o_f  # [TILE_F]
        m_node = node < n_nodes
        pos = ctx + node
        b_kt = _load_kv_tile(k_cache_ptr, p_block_row, pos, m_node, i_kvh, o_d, m_d,
                             stride_kb, stride_ks, stride_kh, BLOCK_SIZE, True)  # [HEAD_DIM_PAD, TILE_F]
        b_v = _load_kv_tile(v_cache_ptr, p_block_row, pos, m_node, i_kvh, o_d, m_d,
                            stride_vb, stride_vs, stride_vh, BLOCK_SIZE, False)  # [TILE_F, HEAD_DIM_PAD]
        b_word = tl.load(p_mask_row + f0 // WORD_BITS, mask=m_row, other=0)  # [BLOCK_M] int64
        b_bit = (b_word[:, None] >> (node % WORD_BITS).to(tl.int64)[None, :]) & 1  # [BLOCK_M, TILE_F]
        b_s = tl.dot(b_q, b_kt, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_F]
        b_s = tl.where((b_bit != 0) & m_row[:, None] & m_node[None, :], b_s, float("-inf"))
        b_m, b_l, b_acc = _online_softmax_step(b_s, b_v, b_m, b_l, b_acc, DOT_PRECISION)

    # A row that saw nothing (no context, no bit) has l = 0 and acc = 0: it is written as zeros.
    b_o = b_acc / tl.where(b_l == 0.0, 1.0, b_l)[:, None]
    p_o = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])
