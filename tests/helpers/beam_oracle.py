"""The exact law of target beam sampling, by enumeration (a test oracle that shares no code with ``vllm_dsbd.core``);
``plain_sampling_law``: the exact law of a plain request's first k tokens, over the pruned prefix tree.

Written from the definition (docs/design/algorithm.md §1; docs/deviations.md), in plain Python floats:
  - a model is ``next_probs(context) -> list of V probabilities`` (for the synthetic table LMs: the table row);
  - temperature T: p_T(x | b) = p(x | b) ** (1 / T), renormalised over x;
  - each step forms the joint weight w(b, x) = exp(s_b) * p_T(x | b) over the live beams b, where exp(s_b) is the
    product of p_T along the beam (a shared constant would not change the law, so normalised and cumulative scores
    give the same process);
  - top-k on the flattened joint keeps the pairs whose weight is >= the k-th largest; top-p then keeps the smallest
    set of largest pairs whose normalised mass reaches top_p (the pair that crosses top_p is kept); the kept weights
    are renormalised into P;
  - min(W, support of P) pairs are drawn from P without replacement: an ordered tuple (z_1, .., z_k) has probability
    prod_i P(z_i) / (1 - P(z_1) - .. - P(z_{i-1}));
  - a drawn pair whose token is EOS finishes (leaves the live set); the others are the new live beams;
  - decoding stops when no beam is live or after ``max_new_tokens`` steps.
The outcome of a run is the set of every candidate at the end (finished and live beams, generated tokens only), as a
sorted tuple of token tuples: it is what the decoders return with ``num_beams_out`` large, and it fixes the best beam
(up to exact score ties, which the oracle does not need to break).

Pair decisions at a top-k / top-p boundary that are within a relative 1e-6 of a tie raise: there, float32 arithmetic
in a decoder could decide differently from this float64 enumeration, so such a configuration is not a fair test.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

NextProbs = Callable[[list], Sequence[float]]

_TIE = 1e-6


def tempered(probs: Sequence[float], temperature: float) -> list[float]:
    """p ** (1 / T), renormalised (zeros stay zero)."""
    w = [float(p) ** (1.0 / temperature) if p > 0 else 0.0 for p in probs]
    tot = sum(w)
    return [x / tot for x in w]


def truncate(weights: dict, top_k: int | None, top_p: float | None) -> dict:
    """Top-k, then top-p, on a dict pair -> weight (> 0); returns the kept pairs, renormalised."""
    items = sorted(((w, z) for z, w in weights.items() if w > 0), key=lambda t: -t[0])
    if top_k is not None and top_k < len(items):
        kth, nxt = items[top_k - 1][0], items[top_k][0]
        if kth - nxt <= _TIE * kth:
            raise ValueError(f"top-k boundary is a near-tie ({kth!r} vs {nxt!r}): choose another configuration")
        items = items[:top_k]
    if top_p is not None and top_p < 1.0:
        tot = sum(w for w, _ in items)
        kept, before = [], 0.0
        for w, z in items:
            if abs(before - top_p) <= _TIE:
                raise ValueError("top-p boundary is a near-tie: choose another configuration")
            if before >= top_p:
                if kept and kept[-1][0] - w <= _TIE * kept[-1][0]:
                    raise ValueError("top-p threshold weight is tied: choose another configuration")
                break
            kept.append((w, z))
            before += w / tot
        items = kept
    tot = sum(w for w, _ in items)
    return {z: w / tot for w, z in items}


def subsets_without_replacement(p: dict, k: int) -> dict:
    """Law of the SET of k sequential draws without replacement from p (pair -> probability): frozenset -> prob."""
    out = defaultdict(float)
    keys = list(p)

    def rec(chosen, mass, left):
        if len(chosen) == k:
            out[frozenset(chosen)] += mass
            return
        for z in keys:
            if z not in chosen:
                rec(chosen + [z], mass * p[z] / left, left - p[z])

    rec([], 1.0, 1.0)
    return dict(out)


def beam_sampling_law(next_probs: NextProbs, prompt: list, *, width: int, max_new_tokens: int,
                      temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                      eos: int | None = None, stop_ids: Sequence[int] = ()) -> dict:
    """Exact law of the outcome (sorted tuple of all final candidates) of target beam sampling of width ``width``.
    ``stop_ids``: more tokens that finish a beam as EOS does (a beam request's stop token ids).

    Returns {outcome: probability}; the probabilities sum to 1."""
    ends = set(stop_ids) | ({eos} if eos is not None else set())
    assert temperature > 0, "the oracle is for sampling (temperature > 0)"
    cache = {}

    def cond(seq):  # p_T(. | prompt + seq)
        if seq not in cache:
            cache[seq] = tempered(next_probs(list(prompt) + list(seq)), temperature)
        return cache[seq]

    # state: (live beams: sorted tuple of (tokens, probability of the beam), finished beams: sorted tuple) -> its mass
    states = {((((), 1.0),), ()): 1.0}
    out = defaultdict(float)
    for _ in range(max_new_tokens):
        nxt = defaultdict(float)
        for (live, fin), mass in states.items():
            weights, beam_prob = {}, dict(live)
            for seq, pb in live:
                for x, px in enumerate(cond(seq)):
                    if px > 0:
                        weights[(seq, x)] = pb * px
            law = truncate(weights, top_k, top_p)
            k = min(width, len(law))
            for chosen, pr in subsets_without_replacement(law, k).items():
                new_live, new_fin = [], list(fin)
                for seq, x in chosen:
                    pb = beam_prob[seq] * cond(seq)[x]
                    (new_fin if x in ends else new_live).append((seq + (x,), pb))
                key = (tuple(sorted(new_live)), tuple(sorted(new_fin)))
                if new_live:
                    nxt[key] += mass * pr
                else:
                    out[tuple(sorted(s for s, _ in new_fin))] += mass * pr
        states = nxt
    for (live, fin), mass in states.items():
        out[tuple(sorted([s for s, _ in live] + [s for s, _ in fin]))] += mass
    return dict(out)


def returned_law(law: dict, next_probs: NextProbs, prompt: list, width: int, ends: Sequence[int] = (),
                 length_penalty: float = 1.0) -> dict:
    """The law of the ``width`` beams a request returns, from ``beam_sampling_law``'s law of all final candidates:
    each outcome's candidates ranked by vLLM's ``get_beam_search_score`` (cumulative log-probability under the model
    over (prompt + generated tokens, one less when the last token is in ``ends``) ** length_penalty), the best
    ``width`` kept, as a sorted tuple. {returned set: probability}."""
    import math

    cache: dict = {}

    def score(seq):
        if seq not in cache:
            lp = sum(math.log(next_probs(list(prompt) + list(seq[:i]))[seq[i]]) for i in range(len(seq)))
            n = len(prompt) + len(seq) - (1 if seq and seq[-1] in ends else 0)
            cache[seq] = lp / n ** length_penalty
        return cache[seq]

    out = defaultdict(float)
    for outcome, pr in law.items():
        out[tuple(sorted(sorted(outcome, key=score, reverse=True)[:width]))] += pr
    return dict(out)


def sampling_law(next_probs: NextProbs, prompt: list, n: int, eos: int | None, temperature: float = 1.0) -> dict:
    """Exact law of plain sampling (one sequence) for up to n tokens, stopping at EOS: {tokens tuple: prob}."""
    out = {}

    def rec(seq, mass):
        if len(seq) == n or (seq and seq[-1] == eos):
            out[tuple(seq)] = mass
            return
        for x, px in enumerate(tempered(next_probs(list(prompt) + seq), temperature)):
            if px > 0:
                rec(seq + [x], mass * px)

    rec([], 1.0)
    return out


def hf_next_probs(folder) -> NextProbs:
    """``next_probs`` of a Hugging Face causal LM folder (float64 softmax of its next-token logits, no KV cache)."""
    import torch

    from vllm_dsbd.testing.models import load_hf, next_token_logits_fn

    fn = next_token_logits_fn(load_hf(folder))

    def next_probs(ctx):
        with torch.no_grad():
            return torch.softmax(fn(torch.tensor([list(ctx)])).double()[0], -1).tolist()

    return next_probs


REST = "rest"  # the bin of every sequence the pruned plain-sampling law does not list


def plain_sampling_law(next_probs: NextProbs, prompt: list, k: int, *, temperature: float, min_mass: float,
                       top_k: int | None = None, top_p: float | None = None) -> dict:
    """Exact law of the first ``k`` tokens of one plain sampled request (EOS ignored), pruned over the prefix tree.

    Walks the tree of token prefixes from the prompt: p_T(x | prompt + prefix) (``tempered``, then top-k / top-p by
    ``truncate`` on the tempered probabilities, vLLM's order), products in float64. A prefix of probability below
    ``min_mass`` is not expanded: its whole subtree goes into the :data:`REST` bin with that exact mass (summed from
    the pruned prefixes, never as 1 - the rest). Every listed k-token sequence has probability >= ``min_mass``.

    With ``min_mass`` = 5 / N this is the full law as ``chisq.goodness_of_fit`` sees it at N draws: a sequence below
    the cut has expected count < 5 and would be merged into its tail bin anyway (so would every sequence under a pruned
    prefix). Returns {tokens tuple: prob, REST: prob}; bin a sample with :func:`binned`."""
    assert temperature > 0, "the oracle is for sampling (temperature > 0)"
    out, rest = {}, 0.0

    def rec(seq, mass):
        nonlocal rest
        if mass < min_mass:
            rest += mass
            return
        if len(seq) == k:
            out[tuple(seq)] = mass
            return
        law = truncate(dict(enumerate(tempered(next_probs(list(prompt) + seq), temperature))), top_k, top_p)
        for x, px in sorted(law.items()):
            rec(seq + [x], mass * px)

    rec([], 1.0)
    out[REST] = rest
    return out


def binned(counts, law: dict):
    """A Counter of k-token sequences with each sequence the pruned ``law`` does not list counted in :data:`REST`."""
    from collections import Counter

    out = Counter()
    for seq, c in counts.items():
        out[tuple(seq) if tuple(seq) in law else REST] += c
    return out
