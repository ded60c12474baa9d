"""Repetition, presence and frequency penalties on DSBD plain requests, per forest node, as vLLM 0.26 applies them.

vLLM's sampler (``v1/sample/sampler.py``, step 6) changes the float32 logits before temperature, top-k and top-p: the
repetition penalty (``_custom_ops.apply_repetition_penalties``) on every token of prompt or output, then
``- frequency * count`` and ``- presence * [count > 0]`` over the output tokens (``apply_penalties`` in
``model_executor/layers/utils.py``). A forest node's logits row is the next-token law after prompt + output + the
node's path from the root, so each row gets the penalties of that history: the target's rows before verification
(:func:`penalize_target`) and the draft's rows before each beam step (:class:`DraftPenalties`), so the draft's joint Q
recorded for verification is the law it drew from. Beam requests take none (vLLM's beam search has none).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from .processors import RequestRules

__all__ = ["DraftPenalties", "RequestPenalties", "TargetRows", "apply", "node_paths", "penalize_rows_",
           "penalize_target"]


@dataclass(frozen=True)
class RequestPenalties:
    """One request's penalties (vLLM's ``SamplingParams`` fields); None from :meth:`of` when all are neutral."""

    presence: float
    frequency: float
    repetition: float

    @staticmethod
    def of(sampling_params) -> "RequestPenalties | None":
        p = float(getattr(sampling_params, "presence_penalty", 0.0) or 0.0)
        f = float(getattr(sampling_params, "frequency_penalty", 0.0) or 0.0)
        r = getattr(sampling_params, "repetition_penalty", 1.0)
        r = 1.0 if r is None else float(r)
        return None if (p == 0.0 and f == 0.0 and r == 1.0) else RequestPenalties(p, f, r)


def apply(logits: torch.Tensor, prompt_mask: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
          frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's ``apply_penalties`` after its bin counts, in place on ``logits``, which it returns.

    Args:
        logits: [M, V] float32, contiguous (vLLM's CUDA repetition kernel takes contiguous rows only).
        prompt_mask: [M, V] bool, the tokens of each row's prompt.
        counts: [M, V] int64, how often each token is in each row's output (the history after the prompt).
        presence, frequency, repetition: [M] float32.
    """
    from vllm._custom_ops import apply_repetition_penalties

    output_mask = counts > 0
    apply_repetition_penalties(logits, prompt_mask, output_mask, repetition)
    logits -= frequency.unsqueeze(dim=1) * counts
    logits -= presence.unsqueeze(dim=1) * output_mask
    return logits


def _bins(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Counts [M, V] int64 of token ids [M, n] padded with ``vocab`` (vLLM's ``get_token_bin_counts_and_mask``)."""
    counts = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.int64, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens))
    return counts[:, :vocab]


def _padded(rows: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[M, max len] int64 on ``device``, padded with ``vocab``; negative ids (vLLM's async placeholders) too."""
    n = max([len(r) for r in rows] + [0])
    out = torch.full((len(rows), n), vocab, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.int64)
    out[out < 0] = vocab
    return out.to(device)


def _settings(pens: Sequence[RequestPenalties], device) -> torch.Tensor:
    """[3, n] float32: presence, frequency and repetition of each request."""
    return torch.tensor([[p.presence for p in pens], [p.frequency for p in pens], [p.repetition for p in pens]],
                        dtype=torch.float32).reshape(3, len(pens)).to(device)


def node_paths(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """Each node's path from the root, node included, as tokens (nodes in compact order: a parent before its child;
    ``parents[c]`` = -1 for a child of the root). The history a node's row adds to prompt + output."""
    paths: list[list[int]] = []
    for tok, par in zip(tokens, parents):
        paths.append((paths[par] if par >= 0 else []) + [tok])
    return paths


@dataclass
class TargetRows:
    """One plain request's target rows of a step: its root's row, then one after each of its scheduled nodes."""

    first_row: int  # the root's logits row; node c's row is first_row + 1 + c
    tokens: list[int]  # the scheduled nodes' tokens in compact order (empty: the root's row only)
    parents: list[int]  # their compact parents (-1: a child of the root)
    prompt: list[int]
    output: list[int]  # the tokens emitted so far (the root is the last, or the prompt's last token is)
    penalties: RequestPenalties | None
    rules: RequestRules | None = None  # min_p, min_tokens, logit_bias, ... (``engine/processors.py``)
    grammar: Any = None  # structured outputs: the request's ``grammar.RequestGrammar`` (``engine/grammar.py``)


# entries (rows x gathered columns) one batch of :func:`penalize_rows_` holds: its int64 columns and counts, float32
# values, bool masks, ~26 bytes an entry (2 ** 22: ~100 MiB)
PENALTY_BUDGET = 1 << 22


def penalize_rows_(logits: torch.Tensor, requests: list[TargetRows], budget: int | None = None) -> torch.Tensor:
    """:func:`penalize_target` in place on ``logits`` (float32 [N, V]) and sparse: a request's rows are changed only
    at the C tokens of its prompt, output and forest, so only those columns are gathered (``[rows, C]``), penalized by
    vLLM's own element-wise operations (:func:`apply`, the same values as on a dense row) and scattered back, in
    batches of requests of at most ``budget`` (default :data:`PENALTY_BUDGET`) entries. Returns ``logits``."""
    budget = PENALTY_BUDGET if budget is None else budget
    V = logits.shape[1]
    batch: list[tuple[TargetRows, list[int]]] = []
    rows = width = 0
    for r in requests:
        if r.penalties is None:
            continue
        cols = sorted({t for t in (*r.prompt, *r.output, *r.tokens) if 0 <= t < V})
        if not cols:
            continue
        n = 1 + len(r.tokens)
        if batch and (rows + n) * max(width, len(cols)) > budget:
            _penalize_batch_(logits, batch)
            batch, rows, width = [], 0, 0
        batch.append((r, cols))
        rows, width = rows + n, max(width, len(cols))
    if batch:
        _penalize_batch_(logits, batch)
    return logits


def _penalize_batch_(logits: torch.Tensor, batch: list[tuple[TargetRows, list[int]]]) -> None:
    """One batch of :func:`penalize_rows_`: request k's C_k columns (padded to C by repeating its first column, whose
    padded copies get the same value: the scatter writes it twice), counts in column-position space."""
    dev = logits.device
    C = max(len(cols) for _, cols in batch)
    colidx, srcpos, prompt_pos, output_pos, path_pos, owner, rows = [], [], [], [], [], [], []
    for k, (r, cols) in enumerate(batch):
        at = {t: i for i, t in enumerate(cols)}
        pad = C - len(cols)
        colidx.append(cols + [cols[0]] * pad)
        srcpos.append(list(range(len(cols))) + [0] * pad)
        prompt_pos.append([at.get(t, C) for t in r.prompt])
        output_pos.append([at.get(t, C) for t in r.output])
        path_pos += [[]] + [[at.get(t, C) for t in p] for p in node_paths(r.tokens, r.parents)]
        owner += [k] * (1 + len(r.tokens))
        rows += range(r.first_row, r.first_row + 1 + len(r.tokens))
    own = torch.tensor(owner, dtype=torch.int64).to(dev)  # [M] the request of each row
    src = torch.tensor(srcpos, dtype=torch.int64).to(dev)  # [K, C] the column position each column copies
    prompt_mask = (_bins(_padded(prompt_pos, C, dev), C) > 0).gather(1, src)[own]  # [M, C]
    counts = (_bins(_padded(output_pos, C, dev), C)[own] + _bins(_padded(path_pos, C, dev), C)).gather(1, src[own])
    s = _settings([r.penalties for r, _ in batch], dev)[:, own]
    ri = torch.tensor(rows, dtype=torch.int64).to(dev)[:, None]
    ci = torch.tensor(colidx, dtype=torch.int64).to(dev)[own]
    vals = logits[ri, ci]  # [M, C] a contiguous copy
    logits[ri, ci] = apply(vals, prompt_mask, counts, s[0], s[1], s[2])


def penalize_target(logits: torch.Tensor, requests: list[TargetRows]) -> torch.Tensor:
    """The target's logits [N, V] (float32, a copy) with each listed request's rows penalized by their own histories:
    the root's row by prompt + output, node c's row by prompt + output + :func:`node_paths`' path of c. Dense over all
    rows (the reference :func:`penalize_rows_` equals; the engine penalizes chunk by chunk in ``sampler.verify``)."""
    out = logits.to(torch.float32, copy=True)
    requests = [r for r in requests if r.penalties is not None]
    if not requests:
        return out
    V, dev = out.shape[1], out.device
    rows, owner, extra = [], [], []
    for k, r in enumerate(requests):
        paths = node_paths(r.tokens, r.parents)
        rows += [r.first_row] + [r.first_row + 1 + c for c in range(len(r.tokens))]
        owner += [k] * (1 + len(r.tokens))
        extra += [[]] + paths
    own = torch.tensor(owner, dtype=torch.int64).to(dev)
    prompt_mask = _bins(_padded([r.prompt for r in requests], V, dev), V)[own] > 0
    counts = _bins(_padded([r.output for r in requests], V, dev), V)[own] + _bins(_padded(extra, V, dev), V)
    s = _settings([r.penalties for r in requests], dev)[:, own]
    idx = torch.tensor(rows, dtype=torch.int64).to(dev)
    out[idx] = apply(out[idx].contiguous(), prompt_mask, counts, s[0], s[1], s[2])
    return out


class DraftPenalties:
    """The draft's side for one drafting call: the beam slots' histories over the depths, applied to the draft's
    logits [R, W, V] at the live beams before each beam step (:meth:`apply`), advanced with the step's draws
    (:meth:`advance`). Stays on the device (no host read): the static loops keep their one read. Sparse: a slot's row
    changes only at its request's prompt and output tokens (C columns, from the host) and its path's d tokens, so
    only those C + d columns are gathered, penalized and scattered back (:meth:`apply_dense` is the dense reference)."""

    def __init__(self, sel: list[int], prompts: list[list[int]], outputs: list[list[int]],
                 pens: list[RequestPenalties], width: int, vocab: int, device):
        self.sel = torch.tensor(sel, dtype=torch.int64).to(device)  # [Rp] the calls' requests with penalties
        self.vocab, self.width = vocab, width
        self.history = (prompts, outputs)  # host lists (the dense reference)
        self.settings = _settings(pens, device)  # [3, Rp]
        self.path = torch.full((len(sel), width, 0), vocab, dtype=torch.int64, device=device)  # [Rp, W, d] tokens
        # each request's C distinct prompt / output tokens (padded by repeating the first, or token 0 when none),
        # whether each is in the prompt, and its count in the output
        cols = [sorted({t for t in (*p, *o) if 0 <= t < vocab}) for p, o in zip(prompts, outputs)]
        C = max([len(c) for c in cols] + [1])
        col, pm, oc = [], [], []
        for c, p, o in zip(cols, prompts, outputs):
            c = c + [c[0] if c else 0] * (C - len(c))
            ps, n = set(p), {}
            for t in o:
                n[t] = n.get(t, 0) + 1
            col.append(c)
            pm.append([t in ps for t in c])
            oc.append([n.get(t, 0) for t in c])
        self.cols = torch.tensor(col, dtype=torch.int64).reshape(len(sel), C).to(device)  # [Rp, C]
        self.col_prompt = torch.tensor(pm, dtype=torch.bool).reshape(len(sel), C).to(device)  # [Rp, C]
        self.col_output = torch.tensor(oc, dtype=torch.int64).reshape(len(sel), C).to(device)  # [Rp, C]
        real = [[j < len(c) for j in range(C)] for c in cols]  # not padding (a path token matches one real column)
        self.col_real = torch.tensor(real, dtype=torch.bool).reshape(len(sel), C).to(device)  # [Rp, C]

    def _check(self, V: int) -> None:
        if V != self.vocab:
            raise ValueError(f"DSBD penalties: draft logits have {V} columns, the histories were counted over "
                             f"{self.vocab}")

    def apply(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` [R, W, V] (float32) with the penalized requests' slots penalized by prompt + output + the slot's
        path (a new tensor: the caller's stays as it was). Every gathered column's values are a function of its token
        alone, so a token gathered twice (padding, a path token also in the prompt) is written twice alike."""
        Rp, W, V = len(self.sel), full.shape[1], full.shape[2]
        self._check(V)
        C = self.cols.shape[1]
        path = self.path  # [Rp, W, d], V on padding slots
        tok = torch.where(path < V, path, 0)  # padding gathers token 0, penalized as token 0
        hit = (tok[..., None] == self.cols[:, None, None, :]) & self.col_real[:, None, None, :]  # [Rp, W, d, C]
        cols = torch.cat([self.cols[:, None, :].expand(Rp, W, C), tok], 2)  # [Rp, W, C + d]
        prompt_mask = torch.cat([self.col_prompt[:, None, :].expand(Rp, W, C),
                                 (hit & self.col_prompt[:, None, None, :]).any(-1)], 2)
        out_count = torch.cat([self.col_output[:, None, :].expand(Rp, W, C),
                               (hit * self.col_output[:, None, None, :]).sum(-1)], 2)
        counts = out_count + (cols[..., None] == path[:, :, None, :]).sum(-1)  # + the path's count of the token
        K = C + path.shape[2]
        s = self.settings[:, :, None].expand(3, Rp, W).reshape(3, Rp * W)
        ri = self.sel[:, None, None].expand(Rp, W, K)
        wi = torch.arange(W, device=full.device)[None, :, None].expand(Rp, W, K)
        vals = full[ri, wi, cols].reshape(Rp * W, K)  # a contiguous copy
        vals = apply(vals, prompt_mask.reshape(Rp * W, K), counts.reshape(Rp * W, K), s[0], s[1], s[2])
        out = full.clone()
        out[ri, wi, cols] = vals.reshape(Rp, W, K)
        return out

    def apply_dense(self, full: torch.Tensor) -> torch.Tensor:
        """:meth:`apply` over whole rows (``[Rp, W, V]`` counts and masks; the reference its tests compare with)."""
        Rp, W, V = len(self.sel), full.shape[1], full.shape[2]
        self._check(V)
        dev = full.device
        prompt_mask = _bins(_padded(self.history[0], V, dev), V) > 0  # [Rp, V]
        path = self.path.reshape(Rp * W, -1)
        counts = (_bins(_padded(self.history[1], V, dev), V)[:, None] + _bins(path, V).reshape(Rp, W, V))
        counts = counts.reshape(Rp * W, V)
        mask = prompt_mask[:, None].expand(Rp, W, V).reshape(Rp * W, V)
        s = self.settings[:, :, None].expand(3, Rp, W).reshape(3, Rp * W)
        rows = full[self.sel].reshape(Rp * W, V).contiguous()
        return full.index_put((self.sel,), apply(rows, mask, counts, s[0], s[1], s[2]).reshape(Rp, W, V))

    def fork(self) -> "DraftPenalties":
        """A copy at the same depth (:meth:`advance` replaces the paths, never writes them): the static loop drafts
        with one, so the general loop can start over from the root with this one when the static loop's bet fails."""
        new = object.__new__(DraftPenalties)
        new.__dict__.update(self.__dict__)
        return new

    def advance(self, parent: torch.Tensor, token: torch.Tensor) -> None:
        """After a beam step whose draws are (``parent`` slot, ``token``) [R, ws]: slot s of the next depth holds draw
        s, whose path is its parent slot's path + its token (slots past ws: padding)."""
        par, tok = parent[self.sel], token[self.sel]  # [Rp, ws]
        d = self.path.shape[2]
        path = torch.cat([self.path.gather(1, par[:, :, None].expand(-1, -1, d)), tok[:, :, None]], 2)
        pad = self.width - path.shape[1]
        self.path = torch.nn.functional.pad(path, (0, 0, 0, pad), value=self.vocab) if pad else path
