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

``propose`` merges both (deduplicated by token, the larger estimate kept). Each request's index is bounded in bytes
(:data:`MAX_BYTES`) and forgets the least recently written keys first. Host Python, no torch, no vLLM: the drafter
(``engine/source_drafter.py``) turns the candidates into forest nodes.
"""
from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Callable, Sequence

NMAX = 4  # the longest suffix lookup matches
RECYCLE_K = 8  # tokens a recycled row keeps
# lookup's estimated log-probability of the newest continuation of a suffix of n tokens (n >= 4 uses the last one);
# each older continuation one nat less
LOOKUP_LOGP = {1: math.log(0.25), 2: math.log(0.5), 3: math.log(0.7), 4: math.log(0.8)}
MAX_FOLLOWERS = 8  # continuations kept per lookup key (the newest)
MAX_BYTES = 4 << 20  # host memory one request's index may hold (half each structure): 1 GiB at 256 requests
# bytes one key holds at most (CPython 3.11, 64-bit; tests/unit/test_sources.py measures them with tracemalloc): a
# recycle key (its dict slot, its packed int, a row of RECYCLE_K int32 tokens and float64 log-probs, counted whole for
# each of the two keys that may share it) and a lookup key (its slot, its packed int, MAX_FOLLOWERS int32 followers)
ROW_KEY_BYTES = 256
LOOKUP_KEY_BYTES = 256


def _key(tokens: Sequence[int], n: int) -> int:
    """The last ``n`` tokens (ids < 2^32) packed in one int, the newest lowest, and ``n``: a lookup or recycle key
    (a few dozen bytes, where a tuple of Python ints takes a hundred and more)."""
    k = 0
    for t in tokens[len(tokens) - n:]:
        k = (k << 32) | t
    return (k << 3) | n


class SourceIndex:
    """The draft-free sources of one request: a recycle table and a lookup index (module docstring).

    Both are bounded in bytes (``max_bytes``, half each: :data:`ROW_KEY_BYTES`, :data:`LOOKUP_KEY_BYTES` a key) and
    evict by recency: a key written again (a recycled row replaced, a lookup key's continuations updated) moves to the
    newest end, and past the bound the least recently written quarter goes.

    Args:
        recycle: keep the target's rows (the "recycle" source).
        lookup: index the request's text (the "lookup" source).
        max_bytes: bound on the host memory of both structures together.
    """

    def __init__(self, recycle: bool = True, lookup: bool = True, max_bytes: int = MAX_BYTES):
        self.recycle, self.lookup = recycle, lookup
        self.max_rows = max(4, max_bytes // 2 // ROW_KEY_BYTES)
        self.max_keys = max(4, max_bytes // 2 // LOOKUP_KEY_BYTES)
        # packed context -> the row's tokens and log-probs (``array`` bytes: int32 ids, then float64 log-probs)
        self._rows: dict[int, bytes] = {}
        self._next: dict[int, array] = {}  # packed suffix -> next tokens, the newest last
        self.indexed = 0  # tokens of the request's own linear text indexed so far (``index_text``)

    # filling ------------------------------------------------------------------------------------------------
    def add_row(self, context: Sequence[int], ids: Sequence[int], logps: Sequence[float]) -> None:
        """A target row computed after ``context`` (its last tokens; >= 1): its best tokens and raw log-probs."""
        if not self.recycle or not context:
            return
        row = array("i", ids).tobytes() + array("d", logps).tobytes()
        rows = self._rows
        for n in (2, 1) if len(context) >= 2 else (1,):
            k = _key(context, n)
            rows.pop(k, None)  # written again: the newest
            rows[k] = row
        if len(rows) > self.max_rows:
            self._rows = _newest(rows, self.max_rows)

    def add_transitions(self, tokens: Sequence[int], start: int) -> None:
        """Indexes the transitions into ``tokens[start:]`` (each token after the up to NMAX tokens before it)."""
        if not self.lookup:
            return
        nxt_of = self._next
        for j in range(max(1, start), len(tokens)):
            t, k = tokens[j], 0
            for n in range(1, min(NMAX, j) + 1):
                k |= tokens[j - n] << (32 * (n - 1))  # _key(tokens[:j], n)
                key = (k << 3) | n
                nxt = nxt_of.pop(key, None)  # written again: the newest
                if nxt is None:
                    nxt = array("i", (t,))
                else:
                    if t in nxt:
                        nxt.remove(t)
                    nxt.append(t)
                    if len(nxt) > MAX_FOLLOWERS:
                        del nxt[0]
                nxt_of[key] = nxt
            if len(nxt_of) > self.max_keys:  # the least recently written keys go
                nxt_of = self._next = _newest(nxt_of, self.max_keys)

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
            row = self._rows.get(_key(context, 2)) if len(context) >= 2 else None
            if row is None:
                row = self._rows.get(_key(context, 1))
            if row is not None:
                cut = len(row) // 3  # int32 ids, then float64 log-probs
                ids, logps = array("i"), array("d")
                ids.frombytes(row[:cut])
                logps.frombytes(row[cut:])
                out.update(zip(ids, logps))
        if self.lookup:
            for n in range(min(NMAX, len(context)), 0, -1):
                nxt = self._next.get(_key(context, n))
                if nxt:
                    base = LOOKUP_LOGP[min(n, NMAX)]
                    for r, t in enumerate(reversed(nxt)):
                        v = base - r
                        if v > out.get(t, -math.inf):
                            out[t] = v
                    break
        return out


def _newest(d: dict, bound: int) -> dict:
    """``d`` (oldest written first) without its least recently written entries: the newest three quarters of
    ``bound`` kept (so eviction runs once per quarter of the bound)."""
    keep = bound - bound // 4
    return dict(itertools.islice(d.items(), len(d) - keep, None))
