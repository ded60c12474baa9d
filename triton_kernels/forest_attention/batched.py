"""Forest attention in batched torch: the CPU path (same contract as ``forest_attention``).

``forest_attention_ref`` (naive.py) loops over requests on the host, a dozen small ops each: the engine calls it in
every attention layer of every pass, so on CPU its per-request overhead added up to about a third of a beam
request's step. Here the requests of a chunk are padded to the longest one and computed together: gather the blocks
they use (indexing the cache's first dimension, so a strided cache plane is not copied whole), one visibility mask
[requests, queries, positions] from the context lengths and the ancestor bits, one masked softmax. Positions past a
request's own length are masked and their K/V zeroed (the cache may hold NaN there). Chunks keep the score tensor
under ``max_elements``. Tested against ``forest_attention_ref`` (tests/kernels/test_forest_attention_batched.py).
"""

from __future__ import annotations

import torch

from .mask import unpack_bitmask


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
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    ctx, n = context_lens.tolist(), forest_lens.tolist()
    reqs = [r for r in range(len(ctx)) if cu[r + 1] > cu[r]]
    chunk: list[int] = []
    for r in reqs:
        grown = chunk + [r]
        size = len(grown) * num_heads * max(cu[i + 1] - cu[i] for i in grown) * max(ctx[i] + n[i] for i in grown)
        if chunk and size > max_elements:
            _chunk(q, key_cache, value_cache, block_table, cu, ctx, n, ancestor_mask, softmax_scale, chunk, out,
                   num_kv_heads)
            grown = [r]
        chunk = grown
    if chunk:
        _chunk(q, key_cache, value_cache, block_table, cu, ctx, n, ancestor_mask, softmax_scale, chunk, out,
               num_kv_heads)
    return out


def _chunk(q, key_cache, value_cache, block_table, cu, ctx, n, ancestor_mask, scale, reqs, out, num_kv_heads):
    dev = q.device
    R = len(reqs)
    _, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    bs = key_cache.shape[1]
    idx = torch.tensor(reqs, dtype=torch.int64, device=dev)
    lens = [ctx[r] + n[r] for r in reqs]
    L, Qm, Nm = max(lens), max(cu[r + 1] - cu[r] for r in reqs), max(n[r] for r in reqs)
    ctx_t = torch.tensor([ctx[r] for r in reqs], device=dev)[:, None]  # [R, 1]
    len_t = torch.tensor(lens, device=dev)[:, None]
    # K/V of positions [0, L) of every request (blocks past a request's own length read block 0, then masked)
    nblk = -(-L // bs)
    col = torch.arange(nblk, device=dev)[None, :]
    blocks = torch.where(col * bs < len_t, block_table[idx, :nblk].long(), 0)
    pos = torch.arange(L, device=dev)[None, :]  # [1, L]
    k = key_cache[blocks].reshape(R, nblk * bs, num_kv_heads, head_dim)[:, :L].float()  # a fresh copy
    v = value_cache[blocks].reshape(R, nblk * bs, num_kv_heads, head_dim)[:, :L].float()
    v.masked_fill_((pos >= len_t)[:, :, None, None], 0.0)  # K there only meets masked scores; V meets p = 0
    # queries padded to Qm per request
    start = torch.tensor([cu[r] for r in reqs], device=dev)[:, None]
    qlen = torch.tensor([cu[r + 1] - cu[r] for r in reqs], device=dev)[:, None]
    qcol = torch.arange(Qm, device=dev)[None, :]
    qvalid = qcol < qlen  # [R, Qm]
    qidx = torch.where(qvalid, start + qcol, 0)
    qq = q[qidx].float()  # [R, Qm, H, D]
    # visibility: the context, and forest node j (position ctx + j) when bit j of the query's mask is set
    visible = (pos < ctx_t)[:, None, :].expand(R, Qm, L)
    if Nm:
        bits = unpack_bitmask(ancestor_mask[qidx.flatten()], Nm).view(R, Qm, Nm)
        j = pos - ctx_t  # [R, L]
        in_forest = (j >= 0) & (pos < len_t)
        seen = bits.gather(2, j.clamp(0, Nm - 1)[:, None, :].expand(R, Qm, L)) & in_forest[:, None, :]
        visible = visible | seen
    visible = visible & qvalid[:, :, None]
    # scores [R, kv head, group * Qm, L]: one batched matmul per kv head group
    qh = qq.view(R, Qm, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(R, num_kv_heads, group * Qm,
                                                                                       head_dim)
    s = torch.matmul(qh, k.permute(0, 2, 3, 1)) * scale
    vis = visible[:, None, None].expand(R, 1, group, Qm, L).reshape(R, 1, group * Qm, L)
    s.masked_fill_(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.where(vis.any(dim=-1, keepdim=True), p, 0.0)  # a query that sees nothing gets zeros, not NaN
    o = torch.matmul(p, v.permute(0, 2, 1, 3))  # [R, kv head, group * Qm, D]
    o = o.view(R, num_kv_heads, group, Qm, head_dim).permute(0, 3, 1, 2, 4).reshape(R, Qm, num_heads, head_dim)
    out[qidx[qvalid]] = o[qvalid].to(out.dtype)
