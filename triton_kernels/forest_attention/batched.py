"""Forest attention in batched torch: the CPU path (same contract as ``forest_attention``).

``forest_attention_ref`` (naive.py) loops over requests on the host, a dozen small ops each: the engine calls it in
every attention layer of every pass. Here the requests of a chunk are padded to the longest one and computed
together, in two parts:

- :func:`plan_forest_batched`, once per forward pass (the engine keeps it on the pass's ``ForestBatch``): the chunks
  (score tensors under ``max_elements``), each with its query rows and one visibility mask [requests, 1, queries,
  positions] from the context lengths and the ancestor bits. Every layer's mask is the same, so it is not rebuilt per
  layer (it was most of a layer's operations).
- :func:`forest_attention_planned`, per layer: gather the blocks the requests use (``index_select`` over the cache's
  first dimension, so a strided cache plane is not copied whole), zero K/V past each request's own length (the cache
  may hold NaN there), and one ``scaled_dot_product_attention`` with grouped K/V heads, in float32.

Measured in results/forest-attention-cpu-2026-12-06 (benchmarks/kernels/forest_attention_cpu.py). Tested against
``forest_attention_ref`` (tests/kernels/test_forest_attention_batched.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .mask import unpack_bitmask


class _Chunk(NamedTuple):
    req: torch.Tensor  # int64 [R] the chunk's requests' rows of the block table
    nblk: int  # blocks per request gathered (the longest request's)
    length: int  # positions attended (the longest request's length)
    live: torch.Tensor  # bool [R, nblk] blocks a request owns (the others read block 0, then masked)
    pad: tuple[torch.Tensor, torch.Tensor] | None  # (gathered block, slot in it) of positions past a request's length
    qidx: torch.Tensor  # int64 [R, Qm] query rows, padded per request (padding reads row 0)
    qvalid: torch.Tensor  # bool [R, Qm]
    rows: torch.Tensor  # int64 [n] the chunk's query rows (``qidx[qvalid]``)
    mask: torch.Tensor  # bool [R, 1, Qm, length] what each query sees
    blind: torch.Tensor | None  # bool [n] queries that see nothing (their output is zeros)


class BatchedPlan(NamedTuple):
    """What every layer of a forward pass shares (:func:`plan_forest_batched`)."""

    block_size: int
    chunks: tuple[_Chunk, ...]

    def to(self, device: torch.device) -> BatchedPlan:
        """This plan's tensors on ``device`` (non-blocking copies; planned on the host, run where the layers run)."""
        def move(x):
            if isinstance(x, tuple):
                return tuple(move(y) for y in x)
            return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x

        return BatchedPlan(self.block_size, tuple(_Chunk(*(move(x) for x in c)) for c in self.chunks))


def plan_forest_batched(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, forest_lens: torch.Tensor,
                        ancestor_mask: torch.Tensor, block_size: int, num_heads: int, *,
                        max_elements: int = 1 << 24, token_index: torch.Tensor | None = None,
                        req_rows: torch.Tensor | None = None) -> BatchedPlan:
    """The chunks and masks of a pass (arguments as ``forest_attention``'s; on the device the layers run on).
    ``token_index``: where the forest queries sit among the rows of the ``q`` and ``out`` the layers pass (the engine:
    the pass's query tokens); by default ``q`` holds the forest queries only. ``req_rows``: likewise each request's row
    of the block table (by default request r's is row r)."""
    cu = cu_seqlens_q.tolist()
    ctx, n = context_lens.tolist(), forest_lens.tolist()
    reqs = [r for r in range(len(ctx)) if cu[r + 1] > cu[r]]
    chunks: list[_Chunk] = []
    chunk: list[int] = []
    for r in reqs:
        grown = chunk + [r]
        size = len(grown) * num_heads * max(cu[i + 1] - cu[i] for i in grown) * max(ctx[i] + n[i] for i in grown)
        if chunk and size > max_elements:
            chunks.append(_plan_chunk(cu, ctx, n, ancestor_mask, block_size, chunk, token_index, req_rows))
            grown = [r]
        chunk = grown
    if chunk:
        chunks.append(_plan_chunk(cu, ctx, n, ancestor_mask, block_size, chunk, token_index, req_rows))
    return BatchedPlan(block_size, tuple(chunks))


def _plan_chunk(cu, ctx, n, ancestor_mask, bs, reqs, token_index, req_rows) -> _Chunk:
    dev = ancestor_mask.device
    R = len(reqs)
    lens = [ctx[r] + n[r] for r in reqs]
    Qm, Nm = max(cu[r + 1] - cu[r] for r in reqs), max(n[r] for r in reqs)
    nblk = max(1, -(-max(lens) // bs))
    L = nblk * bs
    ctx_t = torch.tensor([ctx[r] for r in reqs], device=dev)[:, None]  # [R, 1]
    len_t = torch.tensor(lens, device=dev)[:, None]
    live = torch.arange(nblk, device=dev)[None, :] * bs < len_t
    pos = torch.arange(L, device=dev)[None, :]  # [1, L]
    length = max(1, max(lens))
    pad_r, pad_l = ((pos >= len_t) & (pos < length)).nonzero(as_tuple=True)
    pad = (pad_r * nblk + pad_l // bs, pad_l % bs)
    start = torch.tensor([cu[r] for r in reqs], device=dev)[:, None]
    qlen = torch.tensor([cu[r + 1] - cu[r] for r in reqs], device=dev)[:, None]
    qcol = torch.arange(Qm, device=dev)[None, :]
    qvalid = qcol < qlen  # [R, Qm]
    qidx = torch.where(qvalid, start + qcol, 0)
    # visibility: the context, and forest node j (position ctx + j) when bit j of the query's mask is set
    visible = (pos < ctx_t)[:, None, :].expand(R, Qm, L)
    if Nm:
        bits = unpack_bitmask(ancestor_mask[qidx.flatten()], Nm).view(R, Qm, Nm)
        j = pos - ctx_t  # [R, L]
        in_forest = (j >= 0) & (pos < len_t)
        seen = bits.gather(2, j.clamp(0, Nm - 1)[:, None, :].expand(R, Qm, L)) & in_forest[:, None, :]
        visible = visible | seen
    blind = ~visible.any(dim=-1)  # [R, Qm]: padding rows, and queries whose mask and context are empty
    visible = visible.contiguous()  # writable (an expanded view where no request has forest nodes)
    visible[..., 0] |= blind  # they see position 0 (its K/V zeroed or real): no NaN, output dropped or zeroed
    blind_q = blind[qvalid]
    rows = qidx[qvalid]
    if token_index is not None:
        qidx, rows = token_index[qidx], token_index[rows]
    req = torch.tensor(reqs, dtype=torch.int64, device=dev)
    if req_rows is not None:
        req = req_rows[req]
    return _Chunk(req, nblk, length, live, pad if pad_r.numel() else None,
                  qidx, qvalid, rows, visible[:, None, :, :length], blind_q if bool(blind_q.any()) else None)


def _gather_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor,
                   blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``blocks`` of both planes, as planes of those blocks (views of fresh copies). Each block's elements of a
    plane lie in one span of its first-dimension stride (every layout of ``kv.py``), so whole spans are gathered with
    one row copy each (``index_select`` of a strided plane copies element by element: slow on a CPU_ATTN cache, whose
    K is transposed in its block); K and V from one span where they interleave in one cache."""
    spans = [_span(p) for p in (key_cache, value_cache)]
    if None in spans:
        return key_cache.index_select(0, blocks), value_cache.index_select(0, blocks)
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    if (key_cache.untyped_storage().data_ptr() == value_cache.untyped_storage().data_ptr()
            and value_cache.stride(0) == key_cache.stride(0) and hi - lo <= key_cache.stride(0)):
        groups = [((key_cache, value_cache), lo, hi)]
    else:
        groups = [((p,), p_lo, p_hi) for p, (p_lo, p_hi) in zip((key_cache, value_cache), spans)]
    out = []
    for planes, g_lo, g_hi in groups:
        first = planes[0]
        rows = first.as_strided((first.shape[0], g_hi - g_lo), (first.stride(0), 1), g_lo).index_select(0, blocks)
        for p in planes:
            out.append(rows.as_strided((rows.shape[0],) + tuple(p.shape[1:]), (g_hi - g_lo,) + p.stride()[1:],
                                       rows.storage_offset() + p.storage_offset() - g_lo))
    return out[0], out[1]


def _span(plane: torch.Tensor) -> tuple[int, int] | None:
    """[lo, hi): where block 0 of ``plane`` lies in its storage, or None where a block's span is not within the
    stride of its first dimension (blocks overlap or strides are negative)."""
    if plane.dim() < 2 or any(s < 0 for s in plane.stride()) or plane.numel() == 0:
        return None
    extent = 1 + sum((n - 1) * s for n, s in zip(plane.shape[1:], plane.stride()[1:]))
    if extent > plane.stride(0) and plane.shape[0] > 1:
        return None
    lo = plane.storage_offset()
    return lo, lo + extent


def forest_attention_planned(plan: BatchedPlan, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             block_table: torch.Tensor, softmax_scale: float,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's forest attention from ``plan`` (arguments as ``forest_attention``'s; ``q`` [rows, H, D] as the plan
    was made for); written into ``out`` (the forest queries' rows; the others untouched) or a new zeroed tensor."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, bs = key_cache.shape[2], plan.block_size
    if out is None:
        out = torch.zeros(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for c in plan.chunks:
        R, L = c.req.numel(), c.nblk * bs
        blocks = torch.where(c.live, block_table[c.req, :c.nblk].long(), 0).flatten()
        kv = []
        for x in _gather_blocks(key_cache, value_cache, blocks):  # [R * nblk, bs, kv heads, D] each
            if c.pad is not None:  # past a request's length (the cache may hold NaN there): K only meets masked
                x[c.pad] = 0.0  # scores, V p = 0
            kv.append(x.view(R, c.nblk, bs, num_kv_heads, head_dim).permute(0, 3, 1, 2, 4).reshape(
                R, num_kv_heads, L, head_dim)[:, :, :c.length].float())  # a copy
        qq = q[c.qidx].transpose(1, 2).float()  # [R, H, Qm, D]
        o = F.scaled_dot_product_attention(qq, kv[0], kv[1], attn_mask=c.mask, scale=softmax_scale,
                                           enable_gqa=num_kv_heads != num_heads)
        o = o.transpose(1, 2)[c.qvalid]  # [n, H, D]
        if c.blind is not None:
            o[c.blind] = 0.0
        out[c.rows] = o.to(out.dtype)
    return out


def forest_attention_batched(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    forest_lens: torch.Tensor,
    ancestor_mask: torch.Tensor,
    softmax_scale: float,
    *,
    max_elements: int = 1 << 24,
) -> torch.Tensor:
    """Same contract as ``dsbd_kernels.forest_attention.forest_attention`` (see there); returns a new tensor."""
    plan = plan_forest_batched(cu_seqlens_q, context_lens, forest_lens, ancestor_mask, key_cache.shape[1], q.shape[1],
                               max_elements=max_elements)
    return forest_attention_planned(plan, q, key_cache, value_cache, block_table, softmax_scale)
