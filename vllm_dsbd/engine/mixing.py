"""A draft model's (or EAGLE-3 head's) forests mixed with the draft-free sources, node by node
(``"sources": ["model", "recycle", "lookup"]``, or any of the two with "model").

At every frontier node the draft's row of logits becomes the log of the mixture
``(1 - LAMBDA) * softmax(draft row) + LAMBDA * softmax(sources' row)``, the sources' row being their candidates with
their estimated log-probabilities (``core/sources.py``; -inf elsewhere), where the sources have candidates at that
node's context; the draft's row alone (as its log-softmax) where they have none. The engine's draft steps then run on
the mixed rows as on any draft's: T = 0 the best (beam, token) pairs by score + log Q, T > 0 draws from Q at the
request's temperature, Q told to the verification. Both parts are functions of the past only, so Q is, and each draw
is a real draw from it: every output law stays exact. A head's draws outside its vocabulary come only from the
sources; the next depth runs the draft on whatever was drawn, as for its own draws.

Used by the general depth loops (``drafter.DSBDDrafter.propose_forests``, ``beams.drafter._draft_loop``): they read
each depth's draws on the host, which the contexts of the next depth's nodes need (the static and chain loops, which
read once per call, are skipped on a mixed engine).
"""
from __future__ import annotations

import math

import torch

from vllm_dsbd.core.sources import NMAX

LAMBDA = 0.5  # the sources' weight in a mixed row (where they have candidates)


def mix(logits: torch.Tensor, props: list[dict[int, float] | None]) -> torch.Tensor:
    """Rows ``[S, V]`` of the draft's logits -> rows of log Q (float32), row s mixed with the candidates
    ``props[s]`` when they exist (``None`` or empty: the draft's log-softmax)."""
    S, V = logits.shape
    lq = torch.log_softmax(logits.float(), dim=-1)
    r_i, t_i, v_i = [], [], []
    for s, p in enumerate(props):
        for t, v in (p or {}).items():
            if 0 <= t < V:
                r_i.append(s), t_i.append(t), v_i.append(v)
    if not r_i:
        return lq
    dev = logits.device
    rows = sorted(set(r_i))
    at = {r: k for k, r in enumerate(rows)}
    src = torch.full((len(rows), V), -math.inf, device=dev)
    src[torch.tensor([at[r] for r in r_i], device=dev), torch.tensor(t_i, device=dev)] = torch.tensor(
        v_i, dtype=torch.float32, device=dev)
    rows_t = torch.tensor(rows, device=dev)
    mixed = torch.logaddexp(lq[rows_t] + math.log1p(-LAMBDA), torch.log_softmax(src, dim=-1) + math.log(LAMBDA))
    return lq.index_copy(0, rows_t, mixed)


def beam_tail(beam, linear: list[int], node: int, n: int) -> list[int]:
    """The last ``n`` tokens of a beam request's sequence ending at trie node ``node`` (-1: the linear context)."""
    path = []
    while node >= 0 and len(path) < n:
        path.append(beam.tokens[node])
        node = beam.parents[node]
    path.reverse()
    if len(path) < n:
        path = list(linear[max(0, len(linear) - (n - len(path))):]) + path
    return path[-n:]


def index_live_beams(src, beam, linear: list[int], depth: int) -> list[list[int]]:
    """Indexes each live beam's newest tokens for lookup (its last ``NMAX + depth + 1``: what a forest of ``depth``
    drafted from it may match); returns each live beam's last ``NMAX`` tokens (its context)."""
    out = []
    for b in beam.live:
        tail = beam_tail(beam, linear, b.node, NMAX + depth + 1)
        src.add_transitions(tail, min(NMAX, len(tail)))
        out.append(tail[-NMAX:])
    return out


def text_tail(beam, linear: list[int], nodes: list[int], parents: list[int], node: int, n: int = NMAX) -> list[int]:
    """The last ``n`` tokens of the sequence ending at ``node`` of a beam request's trie extended by a forest
    (``nodes``/``parents``: the forest's tokens and parents, numbered after the trie's ``len(beam.tokens)`` nodes;
    ``linear``: the linear context's last tokens)."""
    k = len(beam.tokens)
    path = []
    while node >= k and len(path) < n:
        path.append(nodes[node - k])
        node = parents[node - k]
    path.reverse()
    if len(path) >= n:
        return path[-n:]
    return beam_tail(beam, linear, node, n - len(path)) + path


def plain_tail(src, ids_row, n_before: int, new: list[int]) -> list[int]:
    """A plain request's text (``ids_row[:n_before]`` then the step's ``new`` tokens) indexed for lookup; returns its
    last ``NMAX`` tokens (the root's context)."""
    src.index_new(lambda lo: ids_row[lo:n_before].tolist() + list(new), n_before + len(new))
    return (ids_row[max(0, n_before - NMAX):n_before].tolist() + list(new))[-NMAX:]


LINEAR_TAIL = 16  # linear tokens a beam job keeps for its nodes' contexts (>= NMAX + the deepest forest + 1)


def beam_linear(src, ids_row, P: int, prefix: list[int]) -> list[int]:
    """A beam request's linear text (its ``P`` prompt tokens, then the beams' common ``prefix``) indexed for lookup;
    returns its last ``LINEAR_TAIL`` tokens."""
    def get(lo: int) -> list[int]:
        return ids_row[lo:P].tolist() + list(prefix) if lo < P else list(prefix[lo - P:])

    src.index_new(get, P + len(prefix))
    return get(max(0, P + len(prefix) - LINEAR_TAIL))
