"""Paged KV cache access for DSBD: logical position -> slot, per-layer cache planes, and the commit (compaction).

A *slot* is the physical row ``block_table[r, t // block_size] * block_size + t % block_size``; a *plane* a 4-D
``[num_blocks, block_size, num_kv_heads, head_size]`` view of one layer's K or V. Layouts (vLLM 0.26.0) a maintainer
must keep: on the CPU (``CPU_ATTN``) each (block, head) holds K **transposed** (``[head_size, block_size]``) then V, so
:func:`cpu_planes` gives strided views only the torch references take; on the GPU backends K and V of a token sit side
by side in the last dimension (:func:`gpu_planes`, unit stride: the Triton kernels take them as they are). Details:
docs/design/attention.md §3.5; tested by ``tests/unit/test_engine_units.py``.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from dsbd_kernels.kv_commit import copy_kv_slots_ref


def slots_of(block_row: np.ndarray | torch.Tensor, positions: Sequence[int] | np.ndarray, block_size: int,
             num_blocks: int | None = None) -> np.ndarray:
    """Slots of logical ``positions`` of one request whose block-table row is ``block_row`` (int64 numpy).
    ``num_blocks``: blocks the request owns; a position beyond them raises (it would write another request's KV)."""
    pos = np.asarray(positions, dtype=np.int64)
    row = block_row.numpy() if isinstance(block_row, torch.Tensor) else np.asarray(block_row)
    if num_blocks is not None and pos.size and int(pos.max()) // block_size >= num_blocks:
        raise RuntimeError(f"DSBD: position {int(pos.max())} is beyond the request's {num_blocks} KV blocks")
    return row[pos // block_size].astype(np.int64) * block_size + pos % block_size


def batch_slots(brow: np.ndarray, req: np.ndarray, pos: np.ndarray, block_size: int,
                owned: np.ndarray | None = None) -> np.ndarray:
    """:func:`slots_of` for many requests at once: slot of position ``pos[k]`` of request ``req[k]`` (its block-table
    row ``brow[req[k]]``; ``owned[req[k]]`` blocks owned, a position beyond them raises; None: not checked)."""
    blk = pos // block_size
    if owned is not None and blk.size and (blk >= owned[req]).any():
        k = int(np.argmax(blk >= owned[req]))
        raise RuntimeError(f"DSBD: position {int(pos[k])} is beyond the request's {int(owned[req[k]])} KV blocks")
    return brow[req, blk].astype(np.int64) * block_size + pos % block_size


def cpu_planes(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) planes ``[num_blocks, block_size, num_kv_heads, head_size]`` of a CPU_ATTN layer cache (views, no copy).

    ``kv_cache``: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` as vLLM allocates it (contiguous)."""
    nb, kvh, bs, d2 = kv_cache.shape
    d = d2 // 2
    if not kv_cache.is_contiguous():
        raise ValueError("expected a contiguous CPU_ATTN KV cache")
    s_block, s_head = kv_cache.stride(0), kv_cache.stride(1)
    off = kv_cache.storage_offset()
    # K^T: element (block, head, dim, token) at dim * bs + token; as a plane (block, token, head, dim)
    k = kv_cache.as_strided((nb, bs, kvh, d), (s_block, 1, s_head, bs), off)
    # V: element (block, head, token, dim) at bs * d + token * d + dim
    v = kv_cache.as_strided((nb, bs, kvh, d), (s_block, d, s_head, 1), off + bs * d)
    return k, v


def gpu_planes(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) planes of a vLLM 0.26 GPU layer cache, logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
    (any memory order): the views FlashAttention / Triton / FlexAttention read, ``kv.transpose(1, 2).split(d, -1)``."""
    k, v = kv_cache.transpose(1, 2).split(kv_cache.shape[-1] // 2, dim=-1)
    return k, v


def layer_planes(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) planes of one attention layer's cache, for the layouts this engine knows (see the module docstring)."""
    if kv_cache.device.type == "cpu" and kv_cache.dim() == 4:
        return cpu_planes(kv_cache)
    if kv_cache.dim() == 4 and kv_cache.shape[-1] % 2 == 0:
        return gpu_planes(kv_cache)
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:
        k, v = kv_cache.unbind(0)
        return k, v
    raise NotImplementedError(f"DSBD: unknown KV cache layout {tuple(kv_cache.shape)} on {kv_cache.device}")


class PlaneSet:
    """The K/V planes of one KV-cache group, with the kernel's table of them built once. ``kernel``: None (the
    engine's default) on CUDA when the planes share one geometry; False never (``VLLM_DSBD_KV_COMMIT=torch``: the
    torch reference); True always (tests: the kernel under Triton's interpreter on CPU planes with unit stride)."""

    def __init__(self, planes: Sequence[torch.Tensor], kernel: bool | None = None):
        self.planes = list(planes)
        self.table = None
        if kernel is None:
            kernel = bool(self.planes) and self.planes[0].is_cuda and _same_geometry(self.planes)
        if kernel:
            from dsbd_kernels.kv_commit import KVCacheTable

            self.table = KVCacheTable.from_caches(self.planes)


def commit_kernel(setting: str) -> bool | None:
    """:class:`PlaneSet`'s ``kernel`` for ``VLLM_DSBD_KV_COMMIT``'s value (``envs.Env.kv_commit``): "torch" never,
    "auto" the default (the kernel on CUDA)."""
    return False if setting == "torch" else None


def _same_geometry(planes: Sequence[torch.Tensor]) -> bool:
    first = planes[0]
    return all(p.shape == first.shape and p.stride() == first.stride() and p.dtype == first.dtype for p in planes)


def commit(planes: "PlaneSet | Iterable[torch.Tensor]", src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
    """Copies every plane's rows ``src_slots`` to ``dst_slots`` (all sources read before any write; pairs with src ==
    dst dropped). With the kernel's table (a :class:`PlaneSet` on CUDA, unless ``VLLM_DSBD_KV_COMMIT=torch``) one
    launch of ``copy_kv_slots``, whose ordering condition commit pairs satisfy (destinations ``ctx + k`` from sources
    ``ctx + n_k``, n increasing); otherwise its torch reference."""
    keep = src_slots != dst_slots
    if not keep.any():
        return
    src = torch.from_numpy(np.ascontiguousarray(src_slots[keep]))
    dst = torch.from_numpy(np.ascontiguousarray(dst_slots[keep]))
    if isinstance(planes, PlaneSet) and planes.table is not None:
        from dsbd_kernels.kv_commit import copy_kv_slots

        dev = planes.table.device
        copy_kv_slots(planes.table, src.to(dev, non_blocking=True), dst.to(dev, non_blocking=True))
        return
    plane_list = planes.planes if isinstance(planes, PlaneSet) else list(planes)
    dev = plane_list[0].device
    copy_kv_slots_ref(plane_list, src.to(dev), dst.to(dev))
