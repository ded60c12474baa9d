"""Draft-free forest sources of one request: what the target's own rows and the request's text say comes next.

A forest without a draft model needs, at every node, candidate next tokens with an estimated log-probability. Two
sources give them, per request, from what is already known (so every output law stays exact: they are functions of
the past only):

* **recycle** (Token Recycling, Luo et al. ACL'25, kept per request): every logits row the target computes for the
  request (each plain root, each live beam, each forest node of the pass, verified or not) leaves its ``k`` best
  tokens and their raw log-probabilities in a table keyed by the row's last two tokens (and, as a fallback, its last
  token); the newest row of a key wins. A node whose last tokens are a key gets that row's tokens as children.
  Which rows are kept depends on earlier forests' draft draws (they chose the nodes); that is exact because each
  forest draws fresh numbers (``rng.forest_position``), never those that shaped its rows.
* **lookup** (prompt lookup / SuffixDecoding's per-request structure): every transition of the request's text (its
  prompt, its own output, every beam's tokens) is indexed by the up to ``NMAX`` tokens before it; a node gets the
  tokens that followed the longest of its suffixes found (newest first), with a fixed estimate per match length.

``propose`` merges both (deduplicated by token, the larger estimate kept). Host Python, no torch, no vLLM: the
drafter (``engine/source_drafter.py``) turns the candidates into forest nodes.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

NMAX = 4  # the longest suffix lookup matches
RECYCLE_K = 8  # tokens a recycled row keeps
# lookup's estimated log-probability of the newest continuation of a suffix of n tokens (n >= 4 uses the last one);
# each older continuation one nat less
LOOKUP_LOGP = {1: math.log(0.25), 2: math.log(0.5), 3: math.log(0.7), 4: math.log(0.8)}
MAX_FOLLOWERS = 8  # continuations kept per lookup key (the newest)


class SourceIndex:
    """The draft-free sources of one request: a recycle table and a lookup index (module docstring).

    Args:
        recycle: keep the target's rows (the "recycle" source).
        lookup: index the request's text (the "lookup" source).
        max_keys: bound on each structure's keys (the oldest half is dropped when it is passed).
    """

    def __init__(self, recycle: bool = True, lookup: bool = True, max_keys: int = 1 << 16):
        self.recycle, self.lookup = recycle, lookup
        self.max_keys = max_keys
        self._rows: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}
        self._next: dict[tuple[int, ...], dict[int, int]] = {}  # suffix -> {next token: when last seen}
        self._clock = 0
        self.indexed = 0  # tokens of the request's own linear text indexed so far (``index_text``)

    # filling ------------------------------------------------------------------------------------------------
    def add_row(self, context: Sequence[int], ids: Sequence[int], logps: Sequence[float]) -> None:
        """A target row computed after ``context`` (its last tokens; >= 1): its best tokens and raw log-probs."""
        if not self.recycle or not context:
            return
        row = (list(ids), list(logps))
        if len(context) >= 2:
            self._rows[(context[-2], context[-1])] = row
        self._rows[(context[-1],)] = row
        if len(self._rows) > self.max_keys:
            self._rows = dict(list(self._rows.items())[len(self._rows) // 2:])

    def add_transitions(self, tokens: Sequence[int], start: int) -> None:
        """Indexes the transitions into ``tokens[start:]`` (each token after the up to NMAX tokens before it)."""
        if not self.lookup:
            return
        for j in range(max(1, start), len(tokens)):
            self._clock += 1
            t = tokens[j]
            for n in range(1, min(NMAX, j) + 1):
                key = tuple(tokens[j - n : j])
                nxt = self._next.get(key)
                if nxt is None:
                    nxt = self._next[key] = {}
                nxt[t] = self._clock
                if len(nxt) > MAX_FOLLOWERS:
                    del nxt[min(nxt, key=nxt.get)]
            if len(self._next) > self.max_keys:  # the oldest keys go
                self._next = dict(list(self._next.items())[len(self._next) // 2:])

    def index_text(self, tokens: Sequence[int]) -> None:
        """Indexes the request's linear text (prompt + output) from where the last call stopped."""
        self.index_new(lambda lo: tokens[lo:], len(tokens))

    def index_new(self, get: Callable[[int], Sequence[int]], n: int) -> None:
        """:meth:`index_text` of a text of ``n`` tokens given as ``get(lo)``, its tokens from ``lo`` on: only those
        not indexed yet and the ``NMAX`` before them are asked for (a caller need not build the whole text)."""
        if n < self.indexed:  # shorter (a resumed or re-laid out request): index it again
            self.indexed = 0
        lo = max(0, self.indexed - NMAX)
        self.add_transitions(get(lo), self.indexed - lo)
        self.indexed = n

    # proposing ----------------------------------------------------------------------------------------------
    def propose(self, context: Sequence[int]) -> dict[int, float]:
        """Candidate next tokens after ``context`` (its last NMAX tokens suffice) -> estimated log-probability."""
        out: dict[int, float] = {}
        if not context:
            return out
        if self.recycle:
            row = self._rows.get(tuple(context[-2:])) if len(context) >= 2 else None
            if row is None:
                row = self._rows.get((context[-1],))
            if row is not None:
                out.update(zip(*row))
        if self.lookup:
            for n in range(min(NMAX, len(context)), 0, -1):
                nxt = self._next.get(tuple(context[-n:]))
                if nxt:
                    base = LOOKUP_LOGP[min(n, NMAX)]
                    for r, t in enumerate(sorted(nxt, key=nxt.get, reverse=True)):
                        v = base - r
                        if v > out.get(t, -math.inf):
                            out[t] = v
                    break
        return out
