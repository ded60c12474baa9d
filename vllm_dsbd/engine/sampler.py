"""DSBD's sampler: replaces vLLM's rejection sampler (and plain sampler) for every request of a DSBD engine.

One call per step over the target's logits rows (per request: the root's row, then one after each scheduled forest node
in compact depth-major order) verifies every forest exactly (``core.verify_forest``, or its chain and static forms,
or for a chunk of temperature-0 requests the greedy walk, which make the same decisions) and returns the emitted
tokens in vLLM's sampled-token format. vLLM's linear rollback is right once the runner has moved the accepted path's
K/V into the first slots after the context (``kv.commit`` with :attr:`RowResult.path`). Rows, paths and output
format: docs/design/step.md §3.1.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import torch

from vllm_dsbd import envs
from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.core.chain import ChainResult, greedy_roots, verify_chains
from vllm_dsbd.core.chain_static import verify_chains_static
from vllm_dsbd.core.forest import Forest, compact_index
from vllm_dsbd.core.joint import NEG_INF
from vllm_dsbd.core.outputs import iteration_outputs
from vllm_dsbd.core.params import BatchParams
from vllm_dsbd.core.verify import verify_forest
from vllm_dsbd.core.verify_static import verify_forest_static

from . import grammar, penalties, processors
from .fused import fused_default, fused_layer
from .beams.trie import StepResult
from .chunks import verify_chunk
from .reads import Reader
from .state import PendingForest, RequestState, batch_params

# which verification paths a step takes: "auto" (default) the static ones (no host reads) on a device and the row
# subsets on the CPU; "1" the static ones everywhere, "0" the row subsets everywhere (a fallback on a device)
STATIC_ENV = envs.STATIC_VERIFY


def static_default(device: torch.device) -> bool:
    """Whether the static paths are the default on ``device`` (``VLLM_DSBD_STATIC_VERIFY``; ValueError when the value
    is none of auto / 1 / 0), as the environment says now: the default of callers that do not say (the runner says
    what it read at start-up, ``envs.Env.static_verify_on``)."""
    return envs.read(only=(STATIC_ENV,)).static_verify_on(device)


@dataclass
class RowPlan:
    """What the sampler needs about one request of the step (built by the runner before the forward pass, in batch
    order). A plain request fills the first two groups, a beam request (``state.beam``) the first and the last."""

    # every request
    state: RequestState  # the request's state between steps (``state.beam``: a beam request)
    first_row: int  # its first logits row (the root; a beam request: its first leaf)
    context_len: int  # L: tokens before the first new token (= position of the first token emitted now)
    # plain requests: the forest this pass verifies (none: a depth-0 iteration, one draw from the target)
    forest: PendingForest | None = None  # the verified forest, truncated to the n scheduled nodes
    num_nodes: int = 0  # n: its nodes scheduled in this pass (their logits rows follow the root's)
    drafted_depth: int = 0  # depth the drafter built (before any truncation)
    # the depth the cost model asked of the draft-free sources where they built less (none, or a shallower forest,
    # the scheduler cutting nothing): its estimates count the layer they could not draft as failed (0: as drafted)
    asked_depth: int = 0
    # beam requests: the trie leaves and the forest after them (``runner._plan_beam``), then the step's outcome
    leaves: int = 0  # leaves whose logits rows this pass has (first_row, first_row + 1, ...)
    forest_nodes: int = 0  # forest nodes whose logits rows follow the leaves'
    beam_result: StepResult | None = None  # this pass's beam step or partial step (set by ``runner._beam_result``)


@dataclass
class RowResult:
    tokens: list[int]  # emitted: accepted path + the last layer's token
    path: list[int]  # compact indices of the accepted path's nodes (depth 1, 2, ...)
    passed: int  # layers passed
    widths: list[int] = field(default_factory=list)  # K of each verified draft layer
    rows: list[int] | None = None  # logits row of each emitted token, when not given by ``path`` (beam requests)


def empty_forest(depth: int, width: int, vocab: int, device="cpu") -> Forest:
    z = torch.zeros(1, depth, width, dtype=torch.int64, device=device)
    return Forest(parent=z, token=z.clone(), valid=torch.zeros(1, depth, width, dtype=torch.bool, device=device),
                  score=torch.full((1, depth, width), NEG_INF, device=device),
                  q_joint=torch.full((1, depth, width * vocab), NEG_INF, device=device),
                  depth=torch.zeros(1, dtype=torch.int64, device=device))


def truncate(forest: Forest, context_len: int, n: int) -> Forest:
    """The forest restricted to its first n nodes in compact order (vLLM may schedule fewer draft tokens than
    proposed). A prefix in compact order is, at every depth, a prefix of the draws: still an exact forest."""
    if n >= int(forest.valid.sum()):  # nothing cut (the usual case): the same result without the index
        return Forest(parent=forest.parent, token=forest.token, valid=forest.valid, score=forest.score,
                      q_joint=forest.q_joint, depth=torch.minimum(forest.valid.any(2).sum(1), forest.depth))
    valid = forest.valid & (compact_index(forest.valid) < n)
    depth = valid.any(2).sum(1)
    return Forest(parent=forest.parent, token=forest.token, valid=valid, score=forest.score,
                  q_joint=forest.q_joint, depth=torch.minimum(depth, forest.depth))


def verify(logits: torch.Tensor, rows: list[RowPlan], cfg: DSBDConfig,
           chain_fast_path: bool = True, chain_static: bool | None = None,
           forest_static: bool | None = None, fused: bool | None = None,
           budget: int | None = None,
           penalized: Sequence[penalties.TargetRows | None] | None = None,
           narrow_bare: bool = True, greedy_fast_path: bool = True) -> Reader[list[RowResult]]:
    """Verifies every request of a step (logits: [num_logits_rows, V] from the target pass); a reader
    (``engine/reads.py``). Runs on the logits' device, one host copy at the end of each chunk of requests (the general
    path also reads at the core's branches). Paths with the same decisions: chunks whose requests are all at
    temperature 0 (``greedy_fast_path``: :func:`_greedy_forests`), width-1 chains (``chain_fast_path``), and
    with ``chain_static`` / ``forest_static`` (default :func:`static_default`) the static forms, with the fused kernel
    when ``fused``. Requests go in chunks of ``chunks.verify_chunk`` (``budget`` float32 elements, default
    ``chunks.VERIFY_BUDGET``): a request's results do not depend on the other requests of its chunk. ``penalized``
    (aligned with ``rows``): the requests whose target rows are penalized by their histories (``engine/penalties.py``),
    chunk by chunk on a copy of the chunk's rows (:func:`penalized_chunk`); ``logits`` stays as it is.
    ``narrow_bare`` False: a chunk without forests at the full shapes (the tests that compare the two)."""
    n = verify_chunk(cfg.depth, cfg.width, logits.shape[-1], budget, penalties=penalized is not None)
    out: list[RowResult] = []
    for a in range(0, len(rows), n):
        chunk, lg = rows[a : a + n], logits
        if penalized is not None and any(p is not None for p in penalized[a : a + n]):
            lg, chunk = penalized_chunk(logits, chunk, penalized[a : a + n])
        out += yield from _verify_chunk(lg, chunk, cfg, chain_fast_path, chain_static, forest_static, fused,
                                        narrow_bare, greedy_fast_path)
    return out


def penalized_chunk(logits: torch.Tensor, rows: list[RowPlan],
                    targets: Sequence[penalties.TargetRows | None]) -> tuple[torch.Tensor, list[RowPlan]]:
    """A chunk's logits rows (float32, a copy of each request's root and scheduled node rows) with the ``targets``'
    rows processed: grammar masks (``grammar.mask_target_``), then logits rules (``processors.pre_target_`` /
    ``post_target_``) around the penalties (sparse:
    ``penalties.penalize_rows_``), and the chunk's plans with ``first_row`` on the copy."""
    src, new_rows, moved = [], [], []
    for row, t in zip(rows, targets):
        n = 1 + max(row.num_nodes, len(t.tokens) if t is not None else 0)
        new_rows.append(dataclasses.replace(row, first_row=len(src)))
        if t is not None:
            moved.append(dataclasses.replace(t, first_row=len(src)))
        src += range(row.first_row, row.first_row + n)
    lg = logits[torch.tensor(src, dtype=torch.int64, device=logits.device)].float()  # [n rows, V] a copy
    # vLLM's order: the grammar (engine/grammar.py); allowed_token_ids, bad_words, min_tokens, logit_bias; the
    # penalties; min_p (engine/processors.py)
    grammar.mask_target_(lg, moved)
    lg = processors.post_target_(penalties.penalize_rows_(processors.pre_target_(lg, moved), moved), moved)
    return lg, new_rows


def _verify_chunk(logits: torch.Tensor, rows: list[RowPlan], cfg: DSBDConfig, chain_fast_path: bool,
                  chain_static: bool | None, forest_static: bool | None,
                  fused: bool | None, narrow_bare: bool = True,
                  greedy_fast_path: bool = True) -> Reader[list[RowResult]]:
    """:func:`verify` of one chunk of requests (``narrow_bare`` False: a chunk without forests at the full shapes,
    for the tests that compare the two)."""
    R, G, W = len(rows), max(cfg.depth, 1), cfg.width  # depth 0 (no draft model): every row is a depth-0 iteration
    V = logits.shape[-1]
    dev = logits.device
    if greedy_fast_path and cfg.mode == "sample" and all(r.state.temperature == 0.0 for r in rows):
        out = yield from _greedy_forests(logits, rows)  # forests or not
        if out is not None:
            return out
    bare = narrow_bare and all(r.forest is None for r in rows)
    if bare and chain_fast_path and cfg.mode == "sample":
        # no forest in the chunk (the cost model drafted nothing): the chain path at no depth, one layer (the root's
        # draw), without a forest to build (``_bare_chains``)
        out = yield from _bare_chains(logits, rows, cfg, chain_static)
        if out is not None:
            return out
    if bare:
        # one parent slot and one layer. The layer's joint, and the noise of every draw from it, are indexed from the
        # root slot's tokens (slot * V + token), so the narrow shapes give the same tokens as [G + 1, W, V] at a
        # W (G + 1)-th of the work and memory
        G, W = 1, 1
    # the requests without a forest share one empty forest (the cat below copies it: R x [G, W V] q_joint rows)
    empty = empty_forest(G, W, V, dev) if any(row.forest is None for row in rows) else None
    forests = [row.forest.forest if row.forest is not None else empty for row in rows]
    forest = Forest(parent=torch.cat([f.parent for f in forests]).to(dev),
                    token=torch.cat([f.token for f in forests]).to(dev),
                    valid=torch.cat([f.valid for f in forests]).to(dev),
                    score=torch.cat([f.score for f in forests]).to(dev),
                    q_joint=torch.cat([f.q_joint for f in forests]).to(dev),
                    depth=torch.cat([f.depth for f in forests]).to(device=dev, dtype=torch.int64))
    depth = _depths(rows, forest)
    ctx = torch.tensor([r.context_len for r in rows], dtype=torch.int64, device=dev)
    compact = compact_index(forest.valid)  # all of the forest layout this needs
    params = batch_params([r.state for r in rows], depth, cfg).to(dev)
    if chain_static is None or forest_static is None:  # not said (the runner says): the environment's default now
        static = static_default(dev)
        chain_static = static if chain_static is None else chain_static
        forest_static = static if forest_static is None else forest_static
    if (chain_fast_path and W == 1 and cfg.mode == "sample" and forest.max_depth == G
            and forest.q_joint.shape[-1] == V):
        out = yield from _verify_chains(logits, rows, forest, compact, params, ctx, depth, chain_static)
        if out is not None:
            return out
    # target logits at the parents of each layer: [:, 0, 0] the root, [:, d, j] after node (depth d, slot j)
    tl = torch.zeros(R, G + 1, W, V, device=dev)
    first = torch.tensor([r.first_row for r in rows], dtype=torch.int64, device=dev)
    tl[:, 0, 0] = logits[first].float()
    if forest_static and cfg.mode == "sample":
        use = fused_default(dev) if fused is None else fused
        out = yield from _verify_static(logits, rows, forest, compact, params, ctx, depth, tl, first,
                                        fused_layer if use else None)
        if out is not None:
            return out
    sel = forest.valid.nonzero(as_tuple=True)  # (r, d - 1, j)
    if sel[0].numel():
        src = first[sel[0]] + 1 + compact[sel]
        tl[sel[0], sel[1] + 1, sel[2]] = logits[src].float()
    scores = torch.zeros(R, W, device=dev)
    live = torch.zeros(R, W, dtype=torch.bool, device=dev)
    live[:, 0] = True
    res = verify_forest(forest, tl, scores, live, params, ctx)
    new, fin = iteration_outputs(forest, res, params, finished=False)  # the finished beams only if some row needs them

    # per-request results from one host copy of what they need, read as Python lists (no per-request tensor indexing)
    rec = res.layers
    parts = [new.valid[:, :1].long(), new.length[:, :1], res.last[:, None], res.passed[:, None], new.tokens[:, 0],
             rec.parent[:, :, 0], rec.width, compact.flatten(1), forest.parent.flatten(1)]
    host, = yield [torch.cat([p.to(torch.int64) for p in parts], 1)]
    cuts = torch.tensor([p.shape[1] for p in parts]).cumsum(0).tolist()
    cols = [host[:, a:b] for a, b in zip([0] + cuts[:-1], cuts)]
    new_valid, new_len, last_l, passed_l = (c[:, 0].tolist() for c in cols[:4])
    new_tok, rpar_l, width_l = cols[4].tolist(), cols[5].tolist(), cols[6].tolist()
    comp_l = cols[7].reshape(compact.shape).tolist()
    fpar_l = cols[8].reshape(forest.parent.shape).tolist()
    if not all(new_valid):
        _, fin = iteration_outputs(forest, res, params)
    out = []
    for i in range(R):
        # single-output-beam mode: the emitted beam is the first output of the last processed layer; it is among the
        # live beams unless it is EOS, then among the finished ones (at most one in single mode)
        if new_valid[i]:
            tokens = new_tok[i][: new_len[i]]
        else:
            ks = fin.valid[i].nonzero().flatten().tolist()
            assert len(ks) == 1, "single-output-beam mode emits exactly one beam"
            tokens = fin.tokens[i, ks[0], : int(fin.length[i, ks[0]])].tolist()
        last = last_l[i]
        path, s = [], rpar_l[i][last]
        for dd in range(last, 0, -1):
            path.append(comp_l[i][dd - 1][s])
            s = fpar_l[i][dd - 1][s]
        path.reverse()
        assert len(tokens) == last + 1 and all(c >= 0 for c in path), (tokens, path)
        out.append(RowResult(tokens=tokens, path=path, passed=passed_l[i],
                             widths=width_l[i][: min(last + 1, depth[i])]))
    return out


def _verify_static(logits: torch.Tensor, rows: list[RowPlan], forest: Forest, compact: torch.Tensor,
                   params: BatchParams, ctx: torch.Tensor, depth: list[int], tl: torch.Tensor,
                   first: torch.Tensor, layer=None) -> Reader[list[RowResult] | None]:
    """Mode "sample" without host reads: the target rows of every node gathered under the forest's mask,
    ``verify_forest_static``, then one copy. A layer's output is the node it passes through, so the emitted tokens are
    the layers' tokens up to the last processed one and the path is the passed layers' nodes. None: a processed row
    without an output (NaN logits), which the general path then reports."""
    R, L = tl.shape[:2]
    G = L - 1
    valid = forest.valid[..., None]
    src = torch.where(forest.valid, first[:, None, None] + 1 + compact, first[:, None, None])  # [R, G, W]
    tl[:, 1:] = torch.where(valid, logits[src].float(), 0.0)
    scores = torch.zeros(R, tl.shape[2], device=tl.device)
    live = torch.zeros(R, tl.shape[2], dtype=torch.bool, device=tl.device)
    live[:, 0] = True
    res = verify_forest_static(forest, tl, scores, live, params, ctx, layer)
    rec = res.layers
    node = rec.node[:, :G, 0]
    path = compact.gather(2, node.clamp(min=0)[:, :, None]).squeeze(2)  # [R, G] compact index of layer d's output
    declined = (rec.processed & ~rec.valid[:, :, 0]).any(1)
    parts = [res.last[:, None], res.passed[:, None], declined[:, None], rec.token[:, :, 0], rec.width, path]
    host, = yield [torch.cat([p.to(torch.int64) for p in parts], 1)]  # one copy
    host = host.tolist()
    out = []
    for i, h in enumerate(host):
        last, passed, bad = h[0], h[1], h[2]
        if bad:
            return None
        tokens, widths, pth = h[3 : 3 + L], h[3 + L : 3 + 2 * L], h[3 + 2 * L :]
        out.append(RowResult(tokens=tokens[: last + 1], path=pth[:last], passed=passed,
                             widths=widths[: min(last + 1, depth[i])]))
    return out


def _bare_chains(logits: torch.Tensor, rows: list[RowPlan], cfg: DSBDConfig,
                 static: bool | None) -> Reader[list[RowResult] | None]:
    """A chunk without forests, mode "sample": every request's chain has no node (its one layer is the root's draw,
    drafts or not the same tokens as at any depth: the layer's joint and noise are indexed from the root's slot), so
    :func:`_verify_chains` runs on zero-size forest tensors at L = 1, where the narrowed forest path would allocate
    and concatenate an empty forest per request and (static) verify one more, masked, layer. None: declined."""
    R, V, dev = len(rows), logits.shape[-1], logits.device
    i64 = dict(dtype=torch.int64, device=dev)
    none = torch.zeros(R, 0, 1, **i64)
    forest = Forest(parent=none, token=none, valid=torch.zeros(R, 0, 1, dtype=torch.bool, device=dev),
                    score=torch.zeros(R, 0, 1, device=dev), q_joint=torch.zeros(R, 0, V, device=dev),
                    depth=torch.zeros(R, **i64))
    params = batch_params([r.state for r in rows], [0] * R, cfg).to(dev)
    ctx = torch.tensor([r.context_len for r in rows], **i64)
    static = static_default(dev) if static is None else static
    return (yield from _verify_chains(logits, rows, forest, none, params, ctx, [0] * R, static))


def _greedy_forests(logits: torch.Tensor, rows: list[RowPlan]) -> Reader[list[RowResult] | None]:
    """Mode "sample", every request at temperature 0: a layer's output is the top-1 of the row of the node the walk
    is at (its only live slot, score shift 0: ``greedy_roots``'s float operations, so the same token as the forest
    paths' ``beam_step``), and the walk passes to the scheduled child drafted with that token, if any, until the
    emitted token is EOS or the forest's last depth. So the top-1 of every root and scheduled node row, computed at
    once (one top-k over the gathered rows) and read in one copy, decides every request on the host from the forest's
    host lists (a drafted EOS passes its layer and ends the walk, off the path, as ``iteration_outputs`` has it): a
    handful of operations for any batch, where the forest paths run a few hundred per layer. None: a row
    without a finite top-1 (NaN or fully masked; the general path then decides and reports)."""
    idx, spans = [], []
    for r in rows:
        n = min(r.num_nodes, len(r.forest.tokens)) if r.forest is not None else 0
        spans.append((len(idx), n))
        idx += range(r.first_row, r.first_row + 1 + n)
    vals, token = greedy_roots(logits, torch.tensor(idx, dtype=torch.int64).to(logits.device))
    host, = yield [torch.stack([token, (~torch.isfinite(vals)).long()])]
    top, declined = host.tolist()
    if any(declined):
        return None
    out = []
    for r, (at, n) in zip(rows, spans):
        pf, eos = r.forest, r.state.eos
        depth = pf.depths[n - 1] if n else 0  # the deepest scheduled node's (compact order is depth-major)
        children: dict[tuple[int, int], int] = {}  # (compact parent, token) -> compact node, scheduled nodes only
        for c in range(n):
            children.setdefault((pf.parents[c], pf.tokens[c]), c)
        tokens, path, node, passed = [], [], -1, 0
        for d in range(depth + 1):
            t = top[at + 1 + node]
            tokens.append(t)
            child = children.get((node, t)) if d < depth else None
            passed += child is not None
            if child is None or (eos >= 0 and t == eos):  # a drafted EOS passes its layer and ends the walk
                break
            path.append(child)
            node = child
        out.append(RowResult(tokens=tokens, path=path, passed=passed, widths=[1] * min(len(tokens), depth)))
    return out


def _depths(rows: list[RowPlan], forest: Forest) -> list[int]:
    """Each request's forest depth: the host value the runner gives (``PendingForest.depth``, 0 without a forest),
    else read from the forest (one synchronisation on a device)."""
    known = [0 if r.forest is None else r.forest.depth for r in rows]
    return forest.depth.tolist() if None in known else known


def _verify_chains(logits: torch.Tensor, rows: list[RowPlan], forest: Forest, compact: torch.Tensor,
                   params: BatchParams, ctx: torch.Tensor, depth: list[int],
                   static: bool) -> Reader[list[RowResult] | None]:
    """Width 1: every forest is a chain (node d at slot 0 of depth d, compact index d - 1); its logits row follows
    the root's by ``1 + compact index``. None: the chain core declined (the general path then decides, and reports).
    The accepted nodes' tokens are the forest's host token list (a chain's compact order is its depth order)."""
    G = forest.max_depth
    valid = forest.valid[:, :, 0]
    comp = compact[:, :, 0]
    first = torch.tensor([r.first_row for r in rows], dtype=torch.int64, device=logits.device)
    src = first[:, None].repeat(1, G + 1)
    src[:, 1:] += torch.where(valid, 1 + comp, 0)
    if static:
        t = verify_chains_static(logits, src, forest.token[:, :, 0], valid, forest.q_joint, params, ctx)
        host, = yield [torch.stack([t.last, t.passed, t.token, t.declined.long()])]
        last, passed, token, declined = host.tolist()
        if any(declined):
            return None
        res = ChainResult(last=last, passed=passed, token=token)
    else:
        res = verify_chains(logits, src, forest.token[:, :, 0], valid, forest.q_joint, params, ctx)
        if res is None:
            return None
    return [RowResult(tokens=(row.forest.tokens[:k] if k else []) + [res.token[i]], path=list(range(k)),
                      passed=res.passed[i], widths=[1] * min(k + 1, depth[i]))
            for i, (row, k) in enumerate(zip(rows, res.last))]


def sampled_token_ids(results: list[RowResult], num_reqs: int) -> torch.Tensor:
    """vLLM's format: int32 [num_reqs, max_len] with -1 padding."""
    width = max([len(r.tokens) for r in results] + [1])
    rows = [list(r.tokens) + [-1] * (width - len(r.tokens)) for r in results]
    rows += [[-1] * width] * (num_reqs - len(results))
    return torch.tensor(rows, dtype=torch.int32).reshape(num_reqs, width)


def emitted_rows(rows: list[RowPlan], results: list[RowResult], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the logprobs of the emitted tokens, in the layout of :func:`sampled_token_ids` flattened
    (``[num_reqs * max_len]``): the logits row each token was drawn from (the root's row for the first token, the row
    after accepted node ``path[k - 1]`` for the k-th) and the token (0 in the padding, which vLLM filters out)."""
    idx = torch.zeros(len(rows), max_len, dtype=torch.int64)
    tok = torch.zeros(len(rows), max_len, dtype=torch.int64)
    for i, (row, res) in enumerate(zip(rows, results)):
        src = res.rows if res.rows is not None else [row.first_row] + [row.first_row + 1 + c for c in res.path]
        n = len(res.tokens)
        idx[i, :n] = torch.tensor(src[:n], dtype=torch.int64)
        idx[i, n:] = row.first_row
        tok[i, :n] = torch.tensor(res.tokens, dtype=torch.int64)
    return idx.flatten(), tok.flatten()
