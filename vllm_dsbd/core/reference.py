"""A slow, obviously correct DSBD decoder and the beam-sampling baseline, over any two callables.

A model is a callable mapping a LongTensor [B, T] of token sequences to next-token logits [B, V]. The decoders keep
every beam as a plain token list and recompute from scratch (no KV cache); sequences of one length go to the model in
one call. They drive the batched core (``beam_step`` for both the baseline and the draft, ``verify_forest`` for DSBD),
so a batch of prompts is decoded in lock-step: one iteration = one draft forest + one target pass per request.

    out = dsbd_decode(target, draft, prompt_ids, width=W, depth=G, max_new_tokens=N, ...)
    base = beam_decode(target, prompt_ids, width=W, max_new_tokens=N, ...)

Both return a ``DecodeOutput`` (a list of them for a batch of prompts) with ``.beams``: [(token_ids, score)], best
first (score = cumulative log-probability, length-normalised as vLLM's beam search does: divided by
(prompt + generated tokens, minus a final EOS) ** length_penalty), and ``.stats``.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import rng
from .forest import Forest
from .outputs import iteration_outputs
from .params import BatchParams
from .sampling import beam_step
from .verify import verify_forest

Model = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class DecodeStats:
    target_calls: int = 0  # target forward passes: one per DSBD iteration (one pass over the forest) or per step
    draft_calls: int = 0  # draft forward passes: one per drafted depth
    generated_tokens: int = 0  # decoding steps advanced (tokens added to every live beam)
    iterations: int = 0
    layers_passed: int = 0  # verified layers whose outputs were all draft nodes
    widths: list[int] = field(default_factory=list)  # K of every verified draft layer
    target_invocations: int = 0  # calls of the target callable (the reference splits a pass by sequence length)
    draft_invocations: int = 0


@dataclass
class DecodeOutput:
    beams: list[tuple[list[int], float]]
    stats: DecodeStats


def dsbd_decode(target: Model, draft: Model, prompt_ids, *, width: int, depth: int, max_new_tokens: int,
                temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                eos_token_id: int | None = None, mode: str = "full", dynamic_width: bool = False,
                width_threshold: float = 0.9, min_width: int = 1, seed: int = 0, length_penalty: float = 1.0,
                num_beams_out: int | None = None):
    """DSBD decoding (``docs/design/algorithm.md`` §1). ``mode="full"``: W live beams persist, the best beams are
    returned; ``mode="sample"``: one sequence, exact target sampling (each layer verifies up to W drafts and emits one
    token, K = 1; temperature 0 is greedy decoding whatever W); ``mode="single"``: the paper's single-output-beam
    mode, each iteration emits one beam but layers keep K <= W beams (W = 1 is speculative sampling; for W > 1 the
    output law depends on the draft). Temperature 0 in full mode is the deterministic variant (equals
    ``beam_decode(temperature=0)``; the width stays W)."""
    _check_common(width, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed, length_penalty)
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an int >= 1, got {depth!r}")
    if mode not in ("full", "sample", "single"):
        raise ValueError(f"mode must be 'full', 'sample' or 'single', got {mode!r}")
    if not 0.0 < float(width_threshold) <= 1.0:
        raise ValueError(f"width_threshold must be in (0, 1], got {width_threshold!r}")
    if not isinstance(min_width, int) or not 1 <= min_width <= width:
        raise ValueError(f"min_width must be an int in [1, width], got {min_width!r}")
    prompts, batched = _prompts(prompt_ids)
    cfg = Settings(width=width, depth=depth, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                   top_p=top_p, eos=eos_token_id, single=mode != "full", sample=mode == "sample", dynamic=dynamic_width,
                   tau=width_threshold, min_width=min_width, length_penalty=length_penalty, n_out=num_beams_out)
    outs = _run(target, draft, prompts, [cfg] * len(prompts), _seeds(seed, len(prompts), batched))
    return outs if batched else outs[0]


def beam_decode(target: Model, prompt_ids, *, width: int, max_new_tokens: int, temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
                seed: int = 0, length_penalty: float = 1.0, num_beams_out: int | None = None):
    """Target beam sampling of width W (temperature 0: deterministic beam search with vLLM's semantics)."""
    _check_common(width, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed, length_penalty)
    prompts, batched = _prompts(prompt_ids)
    cfg = Settings(width=width, depth=0, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                   top_p=top_p, eos=eos_token_id, length_penalty=length_penalty, n_out=num_beams_out)
    outs = _run(target, None, prompts, [cfg] * len(prompts), _seeds(seed, len(prompts), batched))
    return outs if batched else outs[0]


@dataclass(frozen=True)
class Settings:
    """One request's settings (already validated). depth = 0: no draft (beam sampling / plain steps)."""

    width: int
    depth: int
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos: int | None = None
    single: bool = False
    sample: bool = False  # with single: one output per layer (exact target sampling)
    dynamic: bool = False
    tau: float = 0.9
    min_width: int = 1
    length_penalty: float = 1.0
    n_out: int | None = None


def dsbd_decode_mixed(target: Model, draft: Model, prompts: list[list[int]], settings: list[Settings],
                      seeds: list[int]) -> list[DecodeOutput]:
    """DSBD over a batch whose requests each have their own settings (width, depth, mode, sampling, ...), decoded
    together. Each request's result equals what it gives alone with the same seed (the tests check this)."""
    if not (len(prompts) == len(settings) == len(seeds)):
        raise ValueError("prompts, settings and seeds must have the same length")
    return _run(target, draft, _prompts(prompts)[0], list(settings), list(seeds))


# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Req:
    prompt: list[int]
    seed: int
    live: list[tuple[list[int], float]]  # (generated tokens, cumulative score)
    finished: list[tuple[list[int], float]] = field(default_factory=list)
    n_gen: int = 0
    stats: DecodeStats = field(default_factory=DecodeStats)
    cfg: Settings | None = None


def _seeds(seed: int, n: int, batched: bool) -> list[int]:
    return [rng.derive_seed(seed, i) for i in range(n)] if batched else [seed]


def _run(target, draft, prompts, settings: list[Settings], seeds: list[int]) -> list[DecodeOutput]:
    reqs = [_Req(p, sd, [([], 0.0)], cfg=c) for p, c, sd in zip(prompts, settings, seeds)]
    while True:
        act = [r for r in reqs if r.live and r.n_gen < r.cfg.max_new_tokens]
        if not act:
            break
        cf = [r.cfg for r in act]
        params = BatchParams.make(
            len(act), temperature=[c.temperature for c in cf], top_k=[c.top_k or 0 for c in cf],
            top_p=[1.0 if c.top_p is None else c.top_p for c in cf], width=[c.width for c in cf],
            seed=[r.seed for r in act], eos=[-1 if c.eos is None else c.eos for c in cf],
            depth=[min(c.depth, c.max_new_tokens - r.n_gen - 1) for c, r in zip(cf, act)],
            min_width=[c.min_width for c in cf], tau=[c.tau for c in cf], dynamic=[c.dynamic for c in cf],
            single=[c.single for c in cf], max_k=[1 if c.sample else 0 for c in cf])
        if draft is None:
            _beam_step(target, act, params)
        else:
            _dsbd_iteration(target, draft, act, params)
    return [DecodeOutput(_final(r), r.stats) for r in reqs]


def _beam_step(target, act, params):
    S = int(params.width.max())
    roots, scores, live = _roots(act, S)
    logits, calls = _evaluate(target, [_seq(act[i], b) for i, b in roots])
    V = logits.shape[1]
    full = torch.zeros(len(act), S, V)
    for (i, b), row in zip(roots, logits):
        full[i, b] = row
    ctx = torch.tensor([len(r.prompt) + r.n_gen for r in act])
    st = beam_step(full, scores, live, params, ctx, rng.Stream.TARGET_DRAW)
    for i, r in enumerate(act):
        eos = int(params.eos[i])
        r.stats.target_calls += 1
        r.stats.target_invocations += calls
        r.stats.generated_tokens += 1
        r.stats.iterations += 1
        old = r.live
        for b in torch.nonzero(st.eos_done[i]).flatten().tolist():
            r.finished.append((old[b][0] + [eos], float(st.eos_score[i, b])))
        r.live = []
        for j in torch.nonzero(st.valid[i]).flatten().tolist():
            beam = (old[int(st.parent[i, j])][0] + [int(st.token[i, j])], float(st.score[i, j]))
            (r.finished if beam[0][-1] == eos else r.live).append(beam)
        r.n_gen += 1


def _dsbd_iteration(target, draft, act, params):
    R, S = len(act), int(params.width.max())
    roots, scores, live = _roots(act, S)
    ctx = torch.tensor([len(r.prompt) + r.n_gen for r in act])
    G = int(params.depth.max())
    # 1. draft: beam sampling G steps from the live beams, W draws per depth
    steps, seqs = [], {(i, 0, b): _seq(act[i], b) for i, b in roots}  # (request, depth, slot) -> sequence
    par_scores, par_live = scores, live
    for d in range(G):
        par_live = par_live & (params.depth > d)[:, None]
        keys = [(i, s) for i, s in zip(*[t.tolist() for t in torch.nonzero(par_live, as_tuple=True)])]
        if not keys:  # every draft beam ended in EOS: the forest stops here
            params = params.with_(depth=params.depth.clamp(max=d))
            G = d
            break
        logits, calls = _evaluate(draft, [seqs[(i, d, s)] for i, s in keys])
        full = torch.zeros(R, S, logits.shape[1])
        for (i, s), row in zip(keys, logits):
            full[i, s] = row
        st = beam_step(full, par_scores, par_live, params, rng.forest_position(ctx - 1, d + 1), rng.Stream.DRAFT_DRAW)
        steps.append(st)
        for i in {i for i, _ in keys}:
            act[i].stats.draft_calls += 1
            act[i].stats.draft_invocations += calls
        for i, j in zip(*[t.tolist() for t in torch.nonzero(st.valid, as_tuple=True)]):
            seqs[(i, d + 1, j)] = seqs[(i, d, int(st.parent[i, j]))] + [int(st.token[i, j])]
        not_eos = ~((params.eos >= 0)[:, None] & (st.token == params.eos[:, None]))
        par_scores, par_live = st.score, st.valid & not_eos
    forest = Forest.from_steps(steps, params.depth, S)
    # 2. one target pass over roots and every forest node
    nodes = [zip(*[t.tolist() for t in torch.nonzero(forest.valid[:, d], as_tuple=True)]) for d in range(G)]
    keys = [(i, 0, b) for i, b in roots] + [(i, d + 1, j) for d in range(G) for i, j in nodes[d]]
    logits, calls = _evaluate(target, [seqs[k] for k in keys])
    tl = torch.zeros(R, G + 1, S, logits.shape[1])
    for (i, d, s), row in zip(keys, logits):
        tl[i, d, s] = row
    # 3. verify, then take what the iteration emitted
    res = verify_forest(forest, tl, scores, live, params, ctx)
    new, fin = iteration_outputs(forest, res, params)
    for i, r in enumerate(act):
        st_ = r.stats
        st_.target_calls += 1
        st_.target_invocations += calls
        st_.iterations += 1
        st_.layers_passed += int(res.passed[i])
        st_.widths += res.layers.width[i, : int(min(res.last[i] + 1, params.depth[i]))].tolist()
        st_.generated_tokens += int(res.last[i]) + 1
        old = r.live
        for k in torch.nonzero(fin.valid[i]).flatten().tolist():
            r.finished.append(_extend(old, fin, i, k))
        r.live = [_extend(old, new, i, k) for k in torch.nonzero(new.valid[i]).flatten().tolist()]
        r.n_gen += int(res.last[i]) + 1


def _extend(old, em, i, k):
    n = int(em.length[i, k])
    return old[int(em.root[i, k])][0] + em.tokens[i, k, :n].tolist(), float(em.score[i, k])


def _roots(act, S):
    R = len(act)
    scores = torch.full((R, S), float("-inf"))
    live = torch.zeros(R, S, dtype=torch.bool)
    roots = []
    for i, r in enumerate(act):
        for b, (_, sc) in enumerate(r.live):
            scores[i, b], live[i, b] = sc, True
            roots.append((i, b))
    return roots, scores, live


def _seq(r: _Req, b: int) -> list[int]:
    return r.prompt + r.live[b][0]


def _evaluate(model: Model, seqs: list[list[int]]) -> tuple[torch.Tensor, int]:
    """Next-token logits of every sequence, one model call per distinct length. Returns ([n, V] float32, calls)."""
    by_len = defaultdict(list)
    for n, s in enumerate(seqs):
        by_len[len(s)].append(n)
    out, calls = None, 0
    for idx in by_len.values():
        logits = model(torch.tensor([seqs[n] for n in idx], dtype=torch.long)).float()
        calls += 1
        if out is None:
            out = torch.empty(len(seqs), logits.shape[-1])
        out[idx] = logits
    return (out if out is not None else torch.empty(0, 0)), calls


def _final(r: _Req):
    eos, length_penalty = r.cfg.eos, r.cfg.length_penalty
    n = 1 if r.cfg.single else (r.cfg.n_out or r.cfg.width)
    cands = r.finished + r.live
    def key(c):
        toks, sc = c
        n_tok = len(r.prompt) + len(toks) - (1 if eos is not None and toks and toks[-1] == eos else 0)
        return sc / (n_tok ** length_penalty)
    return [(t, key((t, s))) for t, s in sorted(cands, key=key, reverse=True)[:n]]


def _prompts(prompt_ids) -> tuple[list[list[int]], bool]:
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.tolist()
    if not isinstance(prompt_ids, (list, tuple)) or len(prompt_ids) == 0:
        raise ValueError("prompt_ids must be a non-empty sequence of token ids (or a batch of them)")
    batched = isinstance(prompt_ids[0], (list, tuple))
    prompts = [list(p) for p in prompt_ids] if batched else [list(prompt_ids)]
    for p in prompts:
        if not p or not all(isinstance(x, int) and x >= 0 for x in p):
            raise ValueError("prompt_ids must hold non-empty sequences of non-negative int token ids")
    return prompts, batched


def _check_common(width, max_new_tokens, temperature, top_k, top_p, eos, seed, length_penalty):
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be an int >= 1, got {width!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not temperature >= 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")
    if eos is not None and (not isinstance(eos, int) or eos < 0):
        raise ValueError(f"eos_token_id must be None or an int >= 0, got {eos!r}")
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if not isinstance(length_penalty, (int, float)):
        raise ValueError(f"length_penalty must be a number, got {length_penalty!r}")
