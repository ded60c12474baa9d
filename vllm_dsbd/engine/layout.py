"""Host (numpy) layout of batched draft forests in compact depth-major order, shared by the drafters."""
from __future__ import annotations

import numpy as np


def _pad_cols(a: np.ndarray, n: int, fill) -> np.ndarray:
    return a if a.shape[1] == n else np.pad(a, ((0, 0), (0, n - a.shape[1])), constant_values=fill)


def _layout_np(valid: np.ndarray, parent: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``core.forest_layout``'s compact indices [R, G, W] (-1 when invalid), node counts [R] and compact parent
    indices, here per (depth, slot) [R, G, W] (-1 at depth 1), of a forest given by its valid and parent slots
    [R, G, W]; ``parents[i][valid[i]]`` is request i's ``forest_layout(...).parent`` row (depth-major order)."""
    R, G, W = valid.shape
    flat = valid.reshape(R, G * W)
    compact = np.where(flat, np.cumsum(flat, 1) - 1, -1).reshape(R, G, W)
    prev = np.concatenate([np.full((R, 1, W), -1, dtype=np.int64), compact[:, :-1]], 1)
    parents = np.take_along_axis(prev, np.clip(parent, 0, W - 1), 2)
    parents[:, 0] = -1
    return compact, flat.sum(1), parents
