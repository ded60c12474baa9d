"""Structured outputs on beam requests: vLLM's beam search under a grammar, step for step (T = 0, no forest).

vLLM 0.26's ``LLM.beam_search`` with ``structured_outputs`` (``entrypoints/generate/beam_search/offline.py``,
``_build_beam_sampling_params`` and ``_beam_search_step``), per step and live beam: the grammar replayed over the beam's
generated tokens; a beam whose grammar is terminated or allows no token is completed as it is (when it generated any
token) and not extended; otherwise its one-token request (``allowed_token_ids`` = the allowed set when it holds at most
:data:`MAX_ALLOWED` tokens) returns the raw row's 2W best log-probabilities plus its sampled token (at T = 0 the best
allowed token when the set is under the cap, the row's best otherwise), in that order, and the candidates are those
of them the grammar allows, scored by raw log-probabilities. Here one matcher per request (``engine.grammar.
RequestGrammar``, advanced with the beams' common prefix) is rolled forward along each live beam's trie path for its
bitmask (:meth:`BeamGrammar.masks`); the row's 2W best and best allowed token are read in one copy
(:func:`structured_tops`), the best allowed token first as vLLM's logprobs dict has it; ``BeamRequest.search`` asks
:meth:`BeamGrammar.ended` and :meth:`BeamGrammar.allows`. Structured beam requests draft no forest. Imports no vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import reads
from .sampling import TopRows
from .trie import Finished

__all__ = ["MAX_ALLOWED", "BeamGrammar", "structured_tops"]

MAX_ALLOWED = 1024  # vLLM's _MAX_NUM_ALLOWED_TOKEN_IDS (beam_search/offline.py), the engine's allowed_token_ids cap


@dataclass
class LeafMask:
    """One live beam's grammar state this step: its bitmask words (Python ints; None: ended, i.e. terminated or
    nothing allowed) and whether the allowed set is at most :data:`MAX_ALLOWED` tokens (vLLM then samples its best
    allowed token, which joins the candidates)."""

    words: list[int] | None
    capped: bool = False


def _unpack(bitmask: torch.Tensor, vocab: int, width: int) -> torch.Tensor:
    """bool [n, width]: token t allowed by its row of the int32 ``bitmask`` (xgrammar's packing) and below ``vocab``
    (vLLM's allowed set is ``_bitmask_to_token_ids`` over the model's vocabulary)."""
    n = bitmask.shape[0]
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((bitmask[:, :, None] >> shifts) & 1).reshape(n, -1).bool()
    out = torch.zeros(n, width, dtype=torch.bool)
    m = min(width, vocab, bits.shape[1])
    out[:, :m] = bits[:, :m]
    return out


class BeamGrammar:
    """A beam request's grammar: one ``engine.grammar.RequestGrammar`` (its matcher), each live beam's state read by
    rolling it forward along the beam's trie path after the linear prefix and back."""

    def __init__(self, grammar):
        self.grammar = grammar
        self.vocab = int(grammar.vocab)
        self.leaves: dict[int, LeafMask] = {}  # live beam index -> its state, set when its row is computed

    def masks(self, beam, first: int, count: int, width: int) -> torch.Tensor:
        """Live beams ``first .. first + count - 1`` of ``beam`` (a ``BeamRequest``): their states (kept for the
        search) and their allowed tokens, bool [count, width] (all False where ended)."""
        g = self.grammar
        g.sync(beam.prefix)
        m = g.grammar
        bm = g._allocate(count)
        ended = []
        for i in range(count):
            node, path = beam.live[first + i].node, []
            while node >= 0:
                path.append(beam.tokens[node])
                node = beam.parents[node]
            done, k = g.broken or m.is_terminated(), 0
            for t in reversed(path):  # vLLM's replay; a candidate is always allowed, so a rejection never happens
                if done or not 0 <= t < self.vocab or len(m.validate_tokens([t])) != 1:
                    done = True
                    break
                m.accept_tokens(g.req_id, [t])
                k += 1
                done = m.is_terminated()
            if not done:
                m.fill_bitmask(bm, i)
            ended.append(done)
            if k:
                m.rollback(k)
        allowed = _unpack(bm, self.vocab, width)
        counts = allowed.sum(1).tolist()
        for i in range(count):
            done = ended[i] or counts[i] == 0
            self.leaves[first + i] = LeafMask(None if done else bm[i].tolist(), not done and counts[i] <= MAX_ALLOWED)
            if done:
                allowed[i] = False
        return allowed

    def ended(self, beam, b: int) -> bool:
        """Whether live beam b's grammar is terminated or allows nothing; then vLLM completes it as it is (when it
        generated a token: never the prompt alone), and so does this (``beam.finished``, finish reason "stop")."""
        if self.leaves[b].words is not None:
            return False
        live = beam.live[b]
        if live.node >= 0 or beam.prefix:
            toks, lps, tops = beam._path(live.node)
            beam.finished.append(Finished(toks, live.score, lps, "stop", tops, None))
        return True

    def allows(self, b: int, t: int) -> bool:
        """Whether live beam b's grammar allows token t (vLLM's filter of the one-token request's logprobs)."""
        words = self.leaves[b].words
        return 0 <= t < self.vocab and (words[t >> 5] >> (t & 31)) & 1 == 1


def structured_tops(rows: torch.Tensor, groups: list) -> reads.Reader[list[TopRows]]:
    """The :class:`TopRows` of structured beam requests' leaf rows ([sum m, V] float32, any device), a reader:
    ``groups`` = (beam request, m) each, its next m leaves' rows in order. Each row: the 2W best raw log-probabilities
    (as ``sampling.top_rows``), with the best allowed token in front (once) where the allowed set is under the cap, as
    vLLM's one-token request returns them; the beams' grammar states are kept for the search. One copy."""
    dev, V = rows.device, rows.shape[-1]
    allowed, capped = [], []
    for beam, m in groups:
        g = beam.grammar
        first = sum(len(r) for r in beam.leaf_rows)
        allowed.append(g.masks(beam, first, m, V))
        capped += [g.leaves[first + j].capped for j in range(m)]
    mask = torch.cat(allowed).to(dev)
    logp = torch.log_softmax(rows.float(), dim=-1)
    kk = min(max(2 * beam.params.width for beam, _ in groups), V)
    vals, idx = torch.topk(logp, kk, dim=-1)
    best = rows.float().masked_fill(~mask, float("-inf")).argmax(dim=-1)  # vLLM's greedy sample under the mask
    best_lp = logp.gather(1, best[:, None])[:, 0]
    host, = yield [torch.cat([vals.double(), idx.double(), best[:, None].double(), best_lp[:, None].double()], 1)]
    host = host.tolist()
    out, at = [], 0
    for beam, m in groups:
        k = min(2 * beam.params.width, V)
        vs, ids = [], []
        for r in range(at, at + m):
            v, i = host[r][:k], [int(x) for x in host[r][kk : kk + k]]
            if capped[r]:
                t = int(host[r][2 * kk])
                keep = [j for j, x in enumerate(i) if x != t]
                v, i = [host[r][2 * kk + 1]] + [v[j] for j in keep], [t] + [i[j] for j in keep]
            vs.append(v)
            ids.append(i)
        out.append(TopRows(vs, ids))
        at += m
    return out
