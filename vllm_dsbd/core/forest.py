"""The draft forest and the layout a target pass over it needs.

The draft beam-samples ``depth`` steps from the live beams (the roots), W draws per depth; node (d, j) is the j-th draw
at depth d (1-based d, stored at index d - 1) and its parent is a slot of depth d - 1 (a root slot when d = 1).
With all roots in one request this is a forest: one tree per root that got children.

Vocabulary used everywhere: *slot* = column index of a node inside its depth (or of a root); *compact index* = the
node's index in the flattened depth-major order of a request's valid nodes (the order of the target's query tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .joint import NEG_INF
from .sampling import BeamStep


@dataclass
class Forest:
    """Forest of R requests with up to G depths and Wm nodes per depth (padded; ``valid`` tells which exist)."""

    parent: torch.Tensor  # [R, G, Wm] int64 parent slot (root slot at depth 1)
    token: torch.Tensor  # [R, G, Wm] int64
    valid: torch.Tensor  # [R, G, Wm] bool; at each depth a prefix of the slots
    score: torch.Tensor  # [R, G, Wm] float32 draft beam score of the node
    q_joint: torch.Tensor  # [R, G, S * V] float32 log Q_d, the draft joint depth d was drawn from (S = slots in)
    depth: torch.Tensor  # [R] int64 drafted depths of each request

    @property
    def max_depth(self) -> int:
        return self.parent.shape[1]

    @staticmethod
    def from_steps(steps: list[BeamStep], depth: torch.Tensor, slots: int) -> "Forest":
        """Stacks the draft's beam steps (one per depth, for every request of the batch). Depths beyond a request's
        own ``depth`` are marked invalid. ``slots`` pads every joint to the same number of parent slots."""
        R = depth.shape[0]
        wm = max(s.parent.shape[1] for s in steps) if steps else 1
        def pad(t, fill):
            return torch.nn.functional.pad(t, (0, wm - t.shape[1]), value=fill)
        def pad_joint(j):
            return torch.nn.functional.pad(j, (0, slots * steps[0].vocab - j.shape[1]), value=NEG_INF)
        if not steps:
            z = torch.zeros(R, 0, 1, dtype=torch.int64, device=depth.device)
            return Forest(z, z, z.bool(), z.float(), z.float(), depth)
        d_idx = torch.arange(len(steps), device=depth.device)
        in_depth = d_idx[None, :] < depth[:, None]  # [R, G]
        valid = torch.stack([pad(s.valid, False) for s in steps], 1) & in_depth[:, :, None]
        return Forest(parent=torch.stack([pad(s.parent, 0) for s in steps], 1),
                      token=torch.stack([pad(s.token, 0) for s in steps], 1),
                      valid=valid,
                      score=torch.stack([pad(s.score, NEG_INF) for s in steps], 1),
                      q_joint=torch.stack([pad_joint(s.joint) for s in steps], 1),
                      depth=depth)


@dataclass
class ForestLayout:
    """What one target pass over the forest needs, per request in compact depth-major node order (N = max nodes)."""

    num_nodes: torch.Tensor  # [R] int64
    valid: torch.Tensor  # [R, N] bool
    depth: torch.Tensor  # [R, N] int64, 1-based
    slot: torch.Tensor  # [R, N] int64 slot of the node in its depth
    token: torch.Tensor  # [R, N] int64
    parent: torch.Tensor  # [R, N] int64 compact index of the parent node, -1 when the parent is a root
    root: torch.Tensor  # [R, N] int64 root slot of the node's tree
    position: torch.Tensor  # [R, N] int64 = context_len + depth - 1 (0-based position of the node's token)
    ancestors: torch.Tensor  # [R, N, N] bool, [r, n, m] = m is an ancestor of n or n itself
    compact: torch.Tensor  # [R, G, Wm] int64 compact index of node (d, j), -1 when invalid

    def path(self, r: int, n: int) -> list[int]:
        """Compact indices of the nodes from depth 1 down to node n of request r."""
        out = []
        while n >= 0:
            out.append(n)
            n = int(self.parent[r, n])
        return out[::-1]


def compact_index(valid: torch.Tensor) -> torch.Tensor:
    """[R, G, Wm] int64 compact index of each node (its rank among the request's valid nodes in depth-major order),
    -1 when invalid: ``forest_layout(...).compact`` without the rest of the layout."""
    R = valid.shape[0]
    flat_valid = valid.reshape(R, -1)
    return torch.where(flat_valid, torch.cumsum(flat_valid.long(), 1) - 1, -1).reshape(valid.shape)


def forest_layout(forest: Forest, context_len: torch.Tensor) -> ForestLayout:
    """Flattens a forest for the target pass. context_len: [R] int64 tokens before the forest (each root's length)."""
    R, G, W = forest.parent.shape
    dev = forest.parent.device
    flat_valid = forest.valid.reshape(R, G * W)
    compact = compact_index(forest.valid)
    num = flat_valid.sum(1)
    N = max(int(num.max()) if R else 0, 1)
    depth_of = torch.arange(1, G + 1, device=dev)[None, :, None].expand(R, G, W)
    slot_of = torch.arange(W, device=dev)[None, None, :].expand(R, G, W)
    # parent's compact index: depth 1 -> -1, else compact[d-2, parent slot]
    prev = torch.cat([torch.full((R, 1, W), -1, device=dev, dtype=torch.int64), compact[:, :-1]], 1)
    parent_c = torch.where(depth_of > 1, prev.gather(2, forest.parent.clamp(0, W - 1)), -1)
    # scatter every per-(d, j) field into compact order
    dst = torch.where(compact >= 0, compact, N).reshape(R, G * W)  # invalid nodes go to a dump column N
    def scat(src, fill):
        out = torch.full((R, N + 1), fill, dtype=src.dtype, device=dev)
        return out.scatter(1, dst, src.reshape(R, G * W))[:, :N]
    valid = scat(flat_valid, False)
    depth = scat(depth_of, 0)
    parent = scat(parent_c, -1)
    # root slot: follow parents up, depth by depth
    root = forest.parent[:, 0].clone()  # [R, W] roots of depth-1 nodes
    roots = [root]
    for d in range(1, G):
        roots.append(roots[-1].gather(1, forest.parent[:, d].clamp(0, W - 1)))
    root_c = scat(torch.stack(roots, 1) if G else forest.parent, -1)
    ancestors = torch.eye(N, dtype=torch.bool, device=dev)[None].expand(R, N, N) & valid[:, :, None]
    for _ in range(G - 1):  # one more generation of ancestors per round
        par_rows = ancestors.gather(1, parent.clamp(min=0)[:, :, None].expand(R, N, N))
        ancestors = ancestors | (par_rows & (parent >= 0)[:, :, None] & valid[:, :, None])
    return ForestLayout(num_nodes=num, valid=valid, depth=depth, slot=scat(slot_of, 0),
                        token=scat(forest.token, 0), parent=parent, root=root_c,
                        position=torch.where(valid, context_len[:, None] + depth - 1, 0),
                        ancestors=ancestors, compact=compact)
