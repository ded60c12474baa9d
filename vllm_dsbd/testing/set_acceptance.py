"""BENCHMARK ONLY: makes a DSBD engine's accepted-path lengths follow a set per-layer acceptance rate instead of
DSBD's verification, so the system's speed can be measured at realistic model sizes with random weights (whose real
acceptance would be near zero). The output is NOT DSBD's law and is meaningless as text.

It lives in ``vllm_dsbd.testing`` (tooling of the benchmarks, here ``benchmarks/gpu/large_model.py`` and
``step_profile.py``, and of the tests) and acts only when a benchmark calls :func:`install` in the process that runs
the engine (in-process engine: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); nothing in the engine or the plugin imports
it, so the serving path cannot reach it.

What stays real: the draft passes, the target's forest pass, DSBD's verification itself (it still runs, so its cost
is counted), the KV commit of the accepted path and vLLM's rollback. What is replaced: which path is accepted. Per
forest, layer d is accepted with probability ``rate`` independently, stopping at the first rejection; the accepted
path is a prefix of the path to the first deepest node; the emitted tokens are that path's
draft tokens plus the real verification's last token.

Beam requests at temperature 0 (``BeamRequest.verify_layers``): after the real beam step on the leaves, each forest
layer passes with probability ``rate`` (stopping at the first failure); a passing layer makes the forest's nodes under
the live beams the new beams (as many as the target's candidates, in the forest's order, each with its candidate's
raw log-probability) and the next beam step runs on their logits from the same target pass, as a real pass does.

Beam requests at temperature T > 0 (``beam_sampling.verify_forests``, every layer of every request in one call,
the default; or ``beam_sampling.verify``, one call per layer for every request verifying): the real layers run
(their cost counted); then each request's layer passes with probability ``rate``: its outputs become its first K
drafts (the layer's forest nodes in draw order, log-probability and score 0: the text is meaningless), so the next
layer runs on their logits. Otherwise it fails: the real outputs stay, except that when they are all forest nodes
(a real pass) the last one becomes a pair outside the forest (with ``verify_forests``, a layer the real run did not
reach gets one such pair).
"""
from __future__ import annotations

import random

_STATE = {"rate": None, "rng": random.Random(0), "orig": None, "orig_beam": None, "orig_beam_sample": None,
          "orig_beam_forests": None}


def set_rate(rate: float) -> None:
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    _STATE["rate"] = rate


def _targets():
    """(state key, owner, attribute, replacement) of every function this module replaces."""
    from vllm_dsbd.engine import sampler
    from vllm_dsbd.engine.beams import sampling as beam_sampling
    from vllm_dsbd.engine.beams.trie import BeamRequest

    return (("orig", sampler, "verify", _verify_at_set_rate),
            ("orig_beam", BeamRequest, "verify_layers", _beam_layers_at_set_rate),
            ("orig_beam_sample", beam_sampling, "verify", _beam_sampling_at_set_rate),
            ("orig_beam_forests", beam_sampling, "verify_forests", _beam_forests_at_set_rate))


def install(rate: float, seed: int = 0) -> None:
    """Replaces ``vllm_dsbd.engine.sampler.verify``, ``BeamRequest.verify_layers``, ``beam_sampling.verify`` and
    ``beam_sampling.verify_forests`` in this process (idempotent; :func:`uninstall` restores them)."""
    set_rate(rate)
    _STATE["rng"] = random.Random(seed)
    for key, owner, name, replacement in _targets():
        if _STATE[key] is None:
            _STATE[key] = getattr(owner, name)
            setattr(owner, name, replacement)


def reseed(seed: int = 0) -> None:
    """Restarts the acceptance draws at ``seed``: a benchmark row that calls it first draws the same numbers whatever
    earlier rows drew (their forests, chosen by a cost model from measured timings, vary from run to run)."""
    _STATE["rng"] = random.Random(seed)


def uninstall() -> None:
    for key, owner, name, _ in _targets():
        if _STATE[key] is not None:
            setattr(owner, name, _STATE[key])
            _STATE[key] = None


def chain(parents: list[int], depths: list[int]) -> list[int]:
    """Compact indices of a root-to-leaf path of greatest depth: the ancestors of the first deepest node."""
    if not depths:
        return []
    c = depths.index(max(depths))
    path = []
    while c >= 0:
        path.append(c)
        c = parents[c]
    return path[::-1]


def _verify_at_set_rate(logits, rows, cfg, **kw):
    """``sampler.verify`` (a reader, as the real one: ``engine/reads.py``) with paths passing at the set rate."""
    from vllm_dsbd.engine.sampler import RowResult

    real = yield from _STATE["orig"](logits, rows, cfg, **kw)
    rng, rate = _STATE["rng"], _STATE["rate"]
    out = []
    for row, res in zip(rows, real):
        pf = row.forest
        if pf is None:
            out.append(res)
            continue
        full = chain(pf.parents, pf.depths)
        k = 0
        while k < len(full) and rng.random() < rate:
            k += 1
        path = full[:k]
        out.append(RowResult(tokens=[pf.tokens[c] for c in path] + [res.tokens[-1]], path=path, passed=k,
                             widths=res.widths))
    return out


def _beam_layers_at_set_rate(self, cands, forest, top, eos, trace=None):
    """``BeamRequest.verify_layers`` (T = 0) with layers passing at the set rate (see the module's docstring).
    ``top``: the forest rows' ``beams.TopRows`` (their best tokens, as the real method gets them)."""
    from vllm_dsbd.engine.beams.trie import LiveBeam

    F = len(top)
    n0 = self.graft(forest, F)
    kids: dict[int, list[int]] = {}
    for c in range(F):
        kids.setdefault(forest.parents[c], []).append(c)
    rng, rate = _STATE["rng"], _STATE["rate"]
    passed = 0
    while cands and self.steps < self.params.max_tokens and rng.random() < rate:
        picks = [(b, c) for b, beam in enumerate(self.live) for c in kids.get(beam.node, [])][: len(cands)]
        if len(picks) < len(cands):
            break
        nodes = [n0 + c for _, c in picks]
        if trace is not None:
            trace.append([c for _, c in picks])
        for nd, (_, _, _, v, _) in zip(nodes, cands):
            self.logprobs[nd] = v
        self.live = [LiveBeam(nd, self.live[b].score + v, ss) for nd, (b, _), (_, _, _, v, ss) in zip(nodes, picks, cands)]
        cands = self.search(top.pick([nd - n0 for nd in nodes]), eos)
        self.steps += 1
        passed += 1
    return cands, passed


def _beam_sampling_at_set_rate(layers, params, fused=None):
    """``beam_sampling.verify`` (T > 0 beam requests; a reader, as the real one) with layers passing at the set rate
    (see the module's docstring)."""
    from vllm_dsbd.engine.beams.sampling import Pair

    pairs, ks = yield from _STATE["orig_beam_sample"](layers, params, fused)
    rng, rate = _STATE["rng"], _STATE["rate"]
    out = []
    for ly, ps, k in zip(layers, pairs, ks):
        V = ly.logits.shape[-1]
        if ly.drafts and len(ly.drafts) >= k and rng.random() < rate:
            ps = [Pair(j // V, j % V, 0.0, 0.0) for j in ly.drafts[:k]]
        elif ly.drafts and ps and all(p.beam * V + p.token in ly.drafts for p in ps):
            taken = set(ly.drafts) | {p.beam * V + p.token for p in ps}
            j = next((j for j in range(len(ly.scores) * V) if j not in taken), None)  # None: every pair drafted
            ps = ps if j is None else ps[:-1] + [Pair(j // V, j % V, 0.0, 0.0)]
        out.append(ps)
    return out, ks


def _outside(drafts: list[int], taken: list[int], slots: int, V: int) -> int | None:
    """A joint index (slot * V + token) of the layer that is neither a draft nor taken (None: every one is)."""
    used = set(drafts) | set(taken)
    return next((j for j in range(slots * V) if j not in used), None)


def _beam_forests_at_set_rate(plans, params, fused=None):
    """``beam_sampling.verify_forests`` (T > 0 beam requests, all layers at once) with layers passing at the set rate
    (see the module's docstring): per request, layer after layer, a layer with drafts passes with probability
    ``rate`` (its first K drafts as outputs, K the real layer's or the layer's width) while a step is left; the first
    that does not keeps the real outputs when the real run reached it, made non-passing, or else one pair outside
    the forest, and ends the request's layers. A layer without drafts (the bonus layer) ends them too."""
    from vllm_dsbd.engine.beams.sampling import Pair

    real = yield from _STATE["orig_beam_forests"](plans, params, fused)
    rng, rate = _STATE["rng"], _STATE["rate"]
    out = []
    for p, got in zip(plans, real):
        V = p.leaves.shape[-1]
        slots, mine = len(p.scores), []
        for layer in range(min(len(p.drafts) + 1, p.layers)):
            drafts = p.joint[layer] if layer < len(p.joint) else []
            k = got[layer][1] if layer < len(got) else min(slots, max(len(drafts), 1))
            eos_drafted = p.eos >= 0 and any(j % V == p.eos for j in drafts[:k])
            if drafts and len(drafts) >= k and not eos_drafted and rng.random() < rate:
                mine.append(([Pair(j // V, j % V, 0.0, 0.0) for j in drafts[:k]], k))
                slots = len(drafts)
                continue
            ps = list(got[layer][0]) if layer < len(got) else []
            if not ps or (drafts and all(q.beam * V + q.token in drafts for q in ps)):
                j = _outside(drafts, [q.beam * V + q.token for q in ps], slots, V)
                if j is not None:
                    ps = ps[:-1] + [Pair(j // V, j % V, 0.0, 0.0)]
            mine.append((ps, k))
            break
        out.append(mine)
    return out
