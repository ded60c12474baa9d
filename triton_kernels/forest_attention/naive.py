"""Torch reference of forest attention: the test oracle, the CPU path and the benchmark's correctness gate."""

from __future__ import annotations

import torch

from .mask import unpack_bitmask


def forest_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    forest_lens: torch.Tensor,
    ancestor_mask: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Same contract as ``dsbd_kernels.forest_attention.forest_attention`` (see there); returns a new tensor.

    Per request: gather the K/V of logical positions [0, ctx + n) through the block table, let each query see
    all of [0, ctx) and the forest positions ctx + j whose mask bit j is set, softmax in fp32. A query that sees
    nothing (no context, no bit) gets zeros. Loops over requests on the host (reads lengths with ``.tolist()``).
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    for r, (ctx, n) in enumerate(zip(context_lens.tolist(), forest_lens.tolist())):
        q0, q1 = cu[r], cu[r + 1]
        if q1 == q0:
            continue
        pos = torch.arange(ctx + n, device=q.device)
        slots = block_table[r, pos // block_size].long() * block_size + pos % block_size
        k = key_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = value_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        visible = torch.ones(q1 - q0, ctx + n, dtype=torch.bool, device=q.device)  # [Tq, L]
        visible[:, ctx:] = unpack_bitmask(ancestor_mask[q0:q1], n)
        s = torch.einsum("thd,lhd->htl", q[q0:q1].float(), k) * softmax_scale  # [H, Tq, L]
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1)
        p = torch.where(visible.any(dim=-1, keepdim=True), p, 0.0)  # rows that see nothing -> 0, not NaN
        out[q0:q1] = torch.einsum("htl,lhd->thd", p, v).to(q.dtype)
    return out
