"""Diverse beam search (``dsbd_beam`` ``num_beam_groups`` G > 1, ``diversity_penalty`` λ; T = 0): one beam step of
HF's group beam search over a beam request's rows (the story: docs/design/beams.md §3.5).

The W live beams are G groups of W / G, in group order. Each step the groups run one after another; group g's scores
are each beam row's log-probabilities minus λ x how often the token is the new token of a beam that groups 0..g-1
kept at this step (HF's ``HammingDiversityLogitsProcessor``). Within a group the step is the engine's beam step with
those scores: each live beam's 2 W / G best penalised tokens are candidates, one ending in EOS, a stop token id or a
stop string finishes, and the W / G best others by penalised cumulative score go on. The first step has one live beam
(the prompt) and every group starts from it. The penalised cumulative score ranks (it is the beam's
``sample_score``, unused otherwise at T = 0) and orders the returned beams (``Finished.rank``); the cumulative
log-probability reported is the model's.

The rows a step reads are each beam's 2W best raw tokens (``TopRows``): enough, since at most W - W/G tokens are
penalised and a penalty only lowers a token, so a row's 2 W / G best penalised tokens are among its W + W/G best raw
ones. Draft forests verify as for plain beams (``BeamRequest.verify_layers``): a layer passes when the new beams are
forest nodes, whatever rule picked them. This module imports no vLLM.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sampling import TopRows
    from .trie import BeamRequest


def group_search(req: BeamRequest, top: TopRows, eos: int | None) -> list[tuple[int, int, float, float, float]]:
    """The step's new beams ``(beam, token, cumulative log-probability, log-probability, penalised cumulative)``,
    group after group (``req.live_groups`` becomes their groups); finished beams go to ``req.finished``."""
    p = req.params
    G, lam = p.num_beam_groups, p.diversity_penalty
    Wg = p.width // G
    first = req.live_groups is None  # the prompt's step: every group extends the one live beam
    chosen: Counter = Counter()  # new tokens of the beams earlier groups kept at this step
    out, groups = [], []
    for g in range(G):
        cands = []
        for b, beam in enumerate(req.live):
            if not first and req.live_groups[b] != g:
                continue
            row = sorted(((v - lam * chosen[t], t, v) for v, t in zip(top.vals[b], top.idx[b])),
                         key=lambda r: r[0], reverse=True)  # stable: equal scores keep the row's order
            for pv, t, v in row[: 2 * Wg]:
                c = req.pair(b, t, v, beam.sample_score + pv, eos)
                if c is not None:
                    cands.append(c)
        cands = sorted(cands, key=lambda c: c[4], reverse=True)[:Wg]
        chosen.update(c[1] for c in cands)
        out += cands
        groups += [g] * len(cands)
    req.live_groups = groups
    return out
