"""Diverse (group) beam search written out in plain torch: the oracle of ``test_engine_beam_groups.py``, sharing no
code with ``vllm_dsbd``.

HF's group beam search with the engine's beam step inside each group (docs/design/beams.md §3.5): W beams in G groups
of W / G, all groups start from the prompt; per step the groups go in order, and group g scores every token x of a
beam's log-softmax row as ``log p(x) - penalty * (how many beams kept by groups < g at this step end in x)``
(``HammingDiversityLogitsProcessor``); each beam of the group offers its 2 W / G best penalised tokens, a token in
``ends`` (EOS, stop ids) finishes that hypothesis, and the W / G best others by penalised cumulative score are the
group's next beams. After ``steps`` steps (or no live beam) the finished and live hypotheses of all groups are ranked
by penalised cumulative score / (prompt + generated - 1 if it ended on an ``ends`` token) ** length_penalty.
"""
from __future__ import annotations

import torch


def group_beam_search(fn, prompt: list[int], width: int, groups: int, penalty: float, steps: int,
                      ends: tuple[int, ...] = (), length_penalty: float = 1.0):
    """``fn(ids [1, L]) -> logits [1, V]``. Returns the ``width`` best as [(tokens, cum_logprob, finish_reason)]."""
    size = width // groups
    live = [[([], 0.0, 0.0)] for _ in range(groups)]  # per group: (generated tokens, cum log p, penalised cum)
    done = []
    for _ in range(steps):
        chosen = None
        for g in range(groups):
            cands = []
            for toks, cum, sc in live[g]:
                with torch.no_grad():
                    row = torch.log_softmax(fn(torch.tensor([prompt + toks]))[0].double(), -1)
                if chosen is None:
                    chosen = torch.zeros_like(row)
                pen = row - penalty * chosen
                vals, idx = pen.topk(2 * size)
                for pv, t in zip(vals.tolist(), idx.tolist()):
                    hyp = (toks + [t], cum + float(row[t]), sc + pv)
                    (done.append((*hyp, "stop")) if t in ends else cands.append(hyp))
            live[g] = sorted(cands, key=lambda c: c[2], reverse=True)[:size]
            for toks, _, _ in live[g]:
                chosen[toks[-1]] += 1
        if not any(live):
            break
    done += [(*h, "length") for grp in live for h in grp]

    def score(h):
        n = len(prompt) + len(h[0]) - (1 if h[3] == "stop" else 0)
        return h[2] / n ** length_penalty

    return [(t, c, r) for t, c, _, r in sorted(done, key=score, reverse=True)[:width]]
