"""Per-request settings of a batch, as tensors: every request has its own sampling settings, width and depth."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass(frozen=True)
class BatchParams:
    """Settings of R requests. All tensors are [R] on one device.

    temperature: float32, 0 means deterministic (beam search / greedy); top_k: int64, 0 = off; top_p: float32, 1 = off
    (both act on the flattened (beam, token) joint); width: int64, W, the number of draws per step; seed: int64;
    eos: int64, -1 = none. DSBD only: depth: int64, γ (0 = no draft, a plain target step); min_width: int64;
    tau: float32, threshold of the width policy; dynamic: bool, width policy on; single: bool, single-output-beam mode;
    max_k: int64, the most outputs a verified layer may have (0 = W). max_k = 1 with single = True is exact target
    sampling: each layer verifies the up to W drafts of a multi-draft forest and emits one token.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    width: torch.Tensor
    seed: torch.Tensor
    eos: torch.Tensor
    depth: torch.Tensor
    min_width: torch.Tensor
    tau: torch.Tensor
    dynamic: torch.Tensor
    single: torch.Tensor
    max_k: torch.Tensor

    @property
    def num_requests(self) -> int:
        return self.temperature.shape[0]

    @property
    def deterministic(self) -> torch.Tensor:  # [R] bool
        return self.temperature == 0

    @staticmethod
    def make(num_requests: int, *, temperature=1.0, top_k=0, top_p=1.0, width=1, seed=0, eos=-1, depth=0,
             min_width=1, tau=0.9, dynamic=False, single=False, max_k=0, device="cpu") -> "BatchParams":
        """Builds params from scalars (broadcast to every request) or per-request sequences."""
        def col(v, dtype):
            t = torch.as_tensor(v, dtype=dtype, device=device)
            return t.expand(num_requests).clone() if t.dim() == 0 else t
        return BatchParams(
            temperature=col(temperature, torch.float32), top_k=col(top_k, torch.int64),
            top_p=col(top_p, torch.float32), width=col(width, torch.int64), seed=col(seed, torch.int64),
            eos=col(eos, torch.int64), depth=col(depth, torch.int64), min_width=col(min_width, torch.int64),
            tau=col(tau, torch.float32), dynamic=col(dynamic, torch.bool), single=col(single, torch.bool),
            max_k=col(max_k, torch.int64))

    @property
    def layer_width(self) -> torch.Tensor:  # [R] int64: the most outputs of a verified layer, min(W, max_k)
        return torch.where(self.max_k > 0, torch.minimum(self.width, self.max_k), self.width)

    def select(self, rows: torch.Tensor) -> "BatchParams":
        """The params of a subset of requests (rows: index or bool mask)."""
        return replace(self, **{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def with_(self, **kw) -> "BatchParams":
        return replace(self, **kw)

    def to(self, device) -> "BatchParams":
        """The same params on ``device`` (tensors already there are kept as they are)."""
        return replace(self, **{f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)})
