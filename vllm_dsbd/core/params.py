"""Per-request settings of a batch, as tensors: every request has its own sampling settings, width and depth."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch


@dataclass(frozen=True)
class HostFacts:
    """What the core's control flow reads from a batch's settings, as host values. Reading a device tensor's value
    waits for the device (a host synchronisation), so :class:`BatchParams` computes these once, on the host before
    the settings move to the device (:meth:`BatchParams.to`), and carries them."""

    width_max: int  # the most draws per step of any request
    any_deterministic: bool
    all_deterministic: bool
    top_k_max: int  # the largest top-k among sampling requests (0: none uses top-k)
    any_top_p: bool  # some sampling request uses top-p
    any_eos_rule: bool  # some deterministic full-width request has an EOS (beam_step's EOS rule applies)

    @staticmethod
    def of(p: "BatchParams") -> "HostFacts":
        """From the tensors (one host copy if they are on a device)."""
        if not p.num_requests:
            return HostFacts(0, False, True, 0, False, False)
        det = p.deterministic
        samp = ~det
        parts = torch.stack([p.width.max(), det.any(), det.all(), torch.where(samp, p.top_k, 0).max(),
                             (samp & (p.top_p < 1.0)).any(), (det & (p.eos >= 0) & ~p.single).any()])
        w, a, al, k, tp, e = parts.tolist()
        return HostFacts(int(w), bool(a), bool(al), int(k), bool(tp), bool(e))


    @staticmethod
    def of_values(temperature: list[float], top_k: list[int], top_p: list[float], width: list[int], eos: list[int],
                  single: list[bool]) -> "HostFacts":
        """What :meth:`of` gives for params made from these per-request host values (no tensor operation): the
        comparisons are made on the values as float32, the dtype of the tensors."""
        if not temperature:
            return HostFacts(0, False, True, 0, False, False)
        det = [float(np.float32(t)) == 0.0 for t in temperature]
        samp = [not d for d in det]
        return HostFacts(max(width), any(det), all(det), max(k if s else 0 for k, s in zip(top_k, samp)),
                         any(s and float(np.float32(p)) < 1.0 for p, s in zip(top_p, samp)),
                         any(d and e >= 0 and not g for d, e, g in zip(det, eos, single)))


_FACT_FIELDS = {"temperature", "top_k", "top_p", "width", "eos", "single"}


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

    @property
    def facts(self) -> HostFacts:
        """:class:`HostFacts` of these settings: carried from the host (see :meth:`to`), else computed once (one host
        copy when the tensors are on a device)."""
        facts = self.__dict__.get("_facts")
        if facts is None:
            facts = HostFacts.of(self)
            object.__setattr__(self, "_facts", facts)
        return facts

    def _carry(self, new: "BatchParams") -> "BatchParams":
        if "_facts" in self.__dict__:
            object.__setattr__(new, "_facts", self.__dict__["_facts"])
        return new

    def select(self, rows: torch.Tensor) -> "BatchParams":
        """The params of a subset of requests (rows: index or bool mask)."""
        return replace(self, **{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def with_(self, facts: HostFacts | None = None, **kw) -> "BatchParams":
        """The params with some settings replaced; their :attr:`facts` carried when no setting they read changes, or
        ``facts`` when the caller knows the new ones (no read of the tensors)."""
        new = replace(self, **kw)
        if facts is not None:
            object.__setattr__(new, "_facts", facts)
            return new
        return new if _FACT_FIELDS & kw.keys() else self._carry(new)

    def to(self, device) -> "BatchParams":
        """The same params on ``device`` (tensors already there are kept as they are), with their :attr:`facts`
        computed before they leave the host. From the host to another device, the fields go as one tensor per dtype
        (three copies instead of twelve) and come back as row views of it."""
        if self.temperature.device.type == "cpu":
            self.facts  # noqa: B018  (computed on the host, carried)
        device = torch.device(device)
        names = [f.name for f in fields(self)]
        if device.type == "cpu" or any(getattr(self, n).device.type != "cpu" for n in names):
            new = replace(self, **{n: getattr(self, n).to(device, non_blocking=True) for n in names})
            return self._carry(new)
        by_dtype: dict[torch.dtype, list[str]] = {}
        for n in names:
            by_dtype.setdefault(getattr(self, n).dtype, []).append(n)
        moved = {}
        for dtype, group in by_dtype.items():
            packed = torch.stack([getattr(self, n) for n in group]).to(device, non_blocking=True)
            moved.update(zip(group, packed.unbind(0)))
        return self._carry(replace(self, **moved))
