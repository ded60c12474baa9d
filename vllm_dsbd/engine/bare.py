"""A step that verifies nothing is vLLM's own step (issue "On vLLM's fast path", item 2).

When no request of the batch has a forest or a beam step this step, and every request samples as vLLM's sampler
samples (:func:`vllm_samples`: a plain request without the penalties, logits rules or grammar DSBD applies itself, and
greedy or unseeded), the runner hands its logits to vLLM's own ``_sample`` (``runner._sample``). What DSBD needs from
such a step waits on the device until it is needed, so the step reads nothing vLLM does not:

* the emitted tokens (:class:`BareTokens`): the next drafting hook reads them from vLLM's host lists (drafters that run
  after vLLM's bookkeeping) or, for a draft model, from the sampler's tensor once, only if some request drafts;
* the recycle source's rows (:class:`LateRows`): each root row's best tokens and their log-probabilities are computed
  on the device now (a ``log_softmax`` and its ``topk``) and enter the request's table when the drafter next reads
  the tables, or every ``LATE_STEPS`` steps. A row harvested here is keyed by the context before this step's token,
  which the drafter's next root never looks up, so the late intake drafts what the immediate one would; exactness does
  not depend on it (the table is a function of the past whenever it is read).

Why vLLM's sampler is the same law: a request of this kind is one draw from the target's row (DSBD's depth-0
iteration), with vLLM's own top-k / top-p / temperature; greedy is vLLM's argmax of the raw row. Seeded requests at
T > 0 keep DSBD's keyed draws (their outputs then depend on the seed alone, as with forests).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_dsbd.core.sources import RECYCLE_K

from . import reads

if TYPE_CHECKING:
    from .state import RequestState

LATE_STEPS = 16  # the most bare steps whose recycle rows wait on the device


def vllm_samples(st: "RequestState") -> bool:
    """Whether vLLM's sampler draws ``st``'s token exactly as DSBD's depth-0 iteration would (module docstring)."""
    return (st.beam is None and st.penalties is None and st.rules is None and st.grammar is None
            and not st.structured and (st.temperature <= 0.0 or not st.seeded))


def recycle_roots(plan: list, token_ids, discard) -> list[tuple["RequestState", int, list[int]]]:
    """A bare step's rows for the recycle source: (state, logits row, the root's last two tokens) of each request
    with sources (``token_ids``: the input batch's host token ids, row i = plan entry i)."""
    out = []
    for i, row in enumerate(plan):
        if not discard[i] and row.state.sources is not None:
            L = row.context_len
            out.append((row.state, row.first_row, token_ids[i, max(0, L - 2):L].tolist()))
    return out


class BareRow:
    """A bare step's result of one request, as ``sampler.RowResult`` reads (no forest: no path, no layer passed)."""

    __slots__ = ("_src", "_i")
    path: list[int] = []
    passed = 0
    widths: list[int] = []

    def __init__(self, src: "BareTokens", i: int):
        self._src, self._i = src, i

    @property
    def tokens(self) -> list[int]:
        return self._src.row(self._i)


class BareTokens:
    """The tokens vLLM's sampler emitted in a bare step, read on the host at most once (``sampled``: the sampler's
    [R, 1] tensor), or given as vLLM's host lists (:meth:`with_host`)."""

    def __init__(self, sampled: torch.Tensor):
        self._dev, self._host = sampled, None

    def with_host(self, host) -> "BareTokens":
        if isinstance(host, list):
            self._host = host
        return self

    def row(self, i: int) -> list[int]:
        if self._host is None:
            self._host = self._dev.tolist()
        return list(self._host[i])

    def __getitem__(self, i: int) -> BareRow:
        return BareRow(self, i)

    def __len__(self) -> int:
        return int(self._dev.shape[0])


def emitted(res) -> int:
    """How many tokens a step's result emitted, without reading a bare row's token (a bare step emits one)."""
    return 1 if isinstance(res, BareRow) else len(res.tokens)


class LateRows:
    """Recycle rows computed on the device in bare steps, put into their requests' tables when :meth:`drain` runs
    (one host read for every waiting step)."""

    def __init__(self):
        self._parts: list[tuple[list, torch.Tensor, torch.Tensor]] = []  # (rows, log-probabilities, token ids)

    def add(self, logits: torch.Tensor, rows: list[tuple["RequestState", int, list[int]]]) -> bool:
        """Queues ``rows`` ((state, logits row, last tokens)): the ``RECYCLE_K`` best tokens of every row of ``logits``
        (a bare step's: one per request) and their log-probabilities; True when ``LATE_STEPS`` steps wait (drain
        then)."""
        if rows:  # log_softmax, then its top-k (a CPU's log_softmax costs half of logsumexp)
            logp = torch.log_softmax(logits if logits.dtype == torch.float32 else logits.float(), dim=-1)
            vals, ids = torch.topk(logp, RECYCLE_K, dim=-1)
            self._parts.append((rows, vals, ids))
        return len(self._parts) >= LATE_STEPS

    def __len__(self) -> int:
        return len(self._parts)

    def drain(self) -> None:
        """Every waiting row into its request's table, oldest step first (the newest row of a key wins); one host copy
        for all of them (``reads.fetch``)."""
        parts, self._parts = self._parts, []
        host = reads.fetch([x for _, vals, ids in parts for x in (vals.double(), ids)])  # one copy
        for k, (rows, _, _) in enumerate(parts):
            v, t = (x.tolist() for x in host[2 * k : 2 * k + 2])
            for st, r, ctx in rows:
                if st.sources is not None:
                    st.sources.add_row(ctx, t[r], v[r])
