"""The runner's KV commit: after verification, the kept path's K/V (target and draft, every layer) move to the slots
right after the context (``DSBDRunnerMixin`` takes these methods; ``kv.py`` holds the slot arithmetic and the kernel or
torch copy, ``VLLM_DSBD_KV_COMMIT``). Needs the runner's ``compilation_config``, ``kv_cache_config``,
``input_batch``, ``dsbd_env``, ``dsbd_stats`` and ``_dsbd_planes`` (None until first use). docs/design/step.md §3.1.
"""
from __future__ import annotations

import numpy as np
import torch

from . import kv


class KVCommitMixin:
    """The KV commit of a DSBD runner (a base of ``runner.DSBDRunnerMixin``)."""

    def _kv_planes(self) -> dict[int, kv.PlaneSet]:
        if self._dsbd_planes is None:
            ctx = self.compilation_config.static_forward_context
            planes: dict[int, list[torch.Tensor]] = {}
            for gid, group in enumerate(self.kv_cache_config.kv_cache_groups):
                for name in group.layer_names:
                    cache = getattr(ctx.get(name), "kv_cache", None)
                    if isinstance(cache, torch.Tensor) and cache.numel():
                        planes.setdefault(gid, []).extend(kv.layer_planes(cache))
            kernel = kv.commit_kernel(self.dsbd_env.kv_commit)  # VLLM_DSBD_KV_COMMIT
            self._dsbd_planes = {gid: kv.PlaneSet(p, kernel) for gid, p in planes.items()}
        return self._dsbd_planes

    def _commit_kv(self, plan, results) -> None:
        """Moves the accepted path's K/V of every layer to the first slots after the context."""
        moves = []  # (row, src positions, dst positions)
        for i, (row, res) in enumerate(zip(plan, results)):
            if row.forest is None:
                continue
            st = row.state
            acc = len(res.path)
            if any(c != k for k, c in enumerate(res.path)):
                moves.append((i, [row.context_len + c for c in res.path],
                              [row.context_len + k for k in range(acc)]))
            # draft K/V exist for the path nodes above the drafted depth (the deepest nodes are never drafted on)
            if st.draft_len == row.context_len:
                st.draft_len += min(acc, row.drafted_depth - 1)
        if not moves:
            return
        self.dsbd_stats.record_moves(sum(sum(a != b for a, b in zip(s, d)) for _, s, d in moves))
        self._move_kv(moves)

    def _move_kv(self, moves: list[tuple[int, list[int], list[int]]]) -> None:
        """Moves K/V of every layer (target and draft) within requests: (batch row, src positions, dst positions)."""
        if not moves:
            return
        rows = np.concatenate([np.full(len(s), i, dtype=np.int64) for i, s, _ in moves])
        src_pos = np.concatenate([np.asarray(s, dtype=np.int64) for _, s, _ in moves])
        dst_pos = np.concatenate([np.asarray(d, dtype=np.int64) for _, _, d in moves])
        for gid, planes in self._kv_planes().items():
            bt = self.input_batch.block_table[gid]
            table, bs = bt.block_table.np, bt.block_size
            kv.commit(planes, kv.batch_slots(table, rows, src_pos, bs), kv.batch_slots(table, rows, dst_pos, bs))
