"""``allowed_token_ids``, ``bad_words``, ``min_tokens``, ``logit_bias`` and ``min_p`` on DSBD plain requests, per forest
node, as vLLM 0.26 applies them to a plain decode row.

vLLM's sampler (``v1/sample/sampler.py``) changes the float32 logits of a row in this order: the ``allowed_token_ids``
whitelist (every other token to -inf), ``bad_words`` (``v1/sample/ops/bad_words.py``: a word's last token to -inf where
the row's output tokens end with the word's other tokens; a word longer than the output + 1 never matches), then the
processors that can change the argmax (``v1/sample/logits_processor/builtin.py``): ``min_tokens`` (the request's stop
token ids, EOS included, to -inf while the output is shorter than ``min_tokens``) and ``logit_bias`` (added); then the
penalties (``engine/penalties.py``); then, when sampling (temperature above vLLM's 1e-5), temperature and ``min_p``
(softmax of the tempered row; tokens whose probability is below ``min_p`` times the largest to -inf) before top-k and
top-p. A forest node's row is the next-token law after prompt + output + the node's path from the root, so each row
takes these with that history (the output it extends is output + path): :func:`pre_target_` (before the penalties)
and :func:`post_target_` (after them) on the target's rows before verification, :class:`DraftRules` on the draft's
rows before each beam step, so the draft's joint Q recorded for verification is the law it drew from. ``min_p`` is
written here before the DSBD sampler's own temperature division (a token set to -inf stays there); the mask is computed
from the tempered row as vLLM computes it. Beam requests take none (vLLM's beam search has none).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .penalties import TargetRows, node_paths

__all__ = ["DraftRules", "RequestRules", "node_histories", "post_target_", "pre_target_"]

_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it are greedy (min_p is not applied)


@dataclass(frozen=True)
class RequestRules:
    """One plain request's logits rules (vLLM's ``SamplingParams`` fields, tokenized); None from :meth:`of` when it sets
    none of them."""

    allowed: tuple[int, ...] | None  # allowed_token_ids (None: every token)
    bad_words: tuple[tuple[int, ...], ...]  # bad_words_token_ids: each word's token ids
    min_tokens: int  # 0: off
    stop_ids: tuple[int, ...]  # all_stop_token_ids (stop_token_ids and EOS): banned while below min_tokens
    bias: tuple[tuple[int, float], ...]  # logit_bias as (token, bias)
    min_p: float  # 0: off
    temperature: float  # the request's (0: greedy, where vLLM applies no min_p)

    @staticmethod
    def of(sampling_params) -> "RequestRules | None":
        """The rules a request sets, read as vLLM's sampler reads them; None when it sets none."""
        sp = sampling_params
        allowed = getattr(sp, "allowed_token_ids", None)
        bad = getattr(sp, "bad_words_token_ids", None) or []
        min_tokens = int(getattr(sp, "min_tokens", 0) or 0)
        stops = sorted(getattr(sp, "all_stop_token_ids", None) or ()) if min_tokens > 0 else []
        bias = getattr(sp, "logit_bias", None) or {}
        temp = float(getattr(sp, "temperature", 1.0) or 0.0)
        temp = 0.0 if temp < _EPS else temp
        min_p = float(getattr(sp, "min_p", 0.0) or 0.0) if temp > 0.0 else 0.0
        rules = RequestRules(allowed=tuple(int(t) for t in allowed) if allowed else None,
                             bad_words=tuple(tuple(int(t) for t in w) for w in bad if w),
                             min_tokens=min_tokens if stops else 0, stop_ids=tuple(int(t) for t in stops),
                             bias=tuple((int(t), float(b)) for t, b in bias.items()), min_p=min_p, temperature=temp)
        if rules.allowed is None and not rules.bad_words and not rules.min_tokens and not rules.bias \
                and not rules.min_p:
            return None
        return rules

    @property
    def has_pre(self) -> bool:
        """Anything applied before the penalties (all but ``min_p``)."""
        return self.allowed is not None or bool(self.bad_words) or self.min_tokens > 0 or bool(self.bias)


def node_histories(output: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """The output each row of a request extends, as vLLM's bad-words and min-tokens processors read it: the root's row
    the request's output, node c's row output + c's path from the root (``penalties.node_paths``)."""
    out = list(output)
    return [out] + [out + p for p in node_paths(tokens, parents)]


def _cols(ids: Sequence[int], V: int) -> list[int]:
    return [t for t in ids if 0 <= t < V]


def allowed_(logits: torch.Tensor, rows: torch.Tensor, hists: list[list[int]], rules: RequestRules) -> None:
    """``allowed_token_ids``: every other token of ``rows`` to -inf (vLLM's ``allowed_token_ids_mask``)."""
    if rules.allowed is None:
        return
    V = logits.shape[1]
    keep = torch.ones(V, dtype=torch.bool, device=logits.device)
    keep[torch.tensor(_cols(rules.allowed, V), dtype=torch.int64, device=logits.device)] = False
    logits[rows] = logits[rows].masked_fill(keep, float("-inf"))


def bad_words_(logits: torch.Tensor, rows: torch.Tensor, hists: list[list[int]], rules: RequestRules) -> None:
    """``bad_words``: in row i, each word's last token to -inf when ``hists[i]`` ends with the word's other tokens
    (vLLM's ``_apply_bad_words_single_batch``)."""
    if not rules.bad_words:
        return
    V = logits.shape[1]
    ri, ci = [], []
    for i, past in enumerate(hists):
        for word in rules.bad_words:
            n = len(word) - 1
            if n > len(past) or not 0 <= word[-1] < V:
                continue
            if n == 0 or list(past[-n:]) == list(word[:-1]):
                ri.append(i)
                ci.append(word[-1])
    if ri:
        dev = logits.device
        logits[rows[torch.tensor(ri, dtype=torch.int64, device=dev)], torch.tensor(ci, dtype=torch.int64,
                                                                                    device=dev)] = float("-inf")


def min_tokens_(logits: torch.Tensor, rows: torch.Tensor, hists: list[list[int]], rules: RequestRules) -> None:
    """``min_tokens``: the stop token ids (EOS included) to -inf in the rows whose output is shorter than
    ``min_tokens`` (vLLM's ``MinTokensLogitsProcessor``)."""
    if not rules.min_tokens:
        return
    short = [i for i, h in enumerate(hists) if len(h) < rules.min_tokens]
    cols = _cols(rules.stop_ids, logits.shape[1])
    if short and cols:
        dev = logits.device
        r = rows[torch.tensor(short, dtype=torch.int64, device=dev)]
        logits[r[:, None], torch.tensor(cols, dtype=torch.int64, device=dev)[None, :]] = float("-inf")


def bias_(logits: torch.Tensor, rows: torch.Tensor, hists: list[list[int]], rules: RequestRules) -> None:
    """``logit_bias``: each listed token's bias added to ``rows`` (vLLM's ``LogitBiasLogitsProcessor``)."""
    pairs = [(t, b) for t, b in rules.bias if 0 <= t < logits.shape[1]]
    if not pairs:
        return
    dev = logits.device
    cols = torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=dev)
    vals = torch.tensor([b for _, b in pairs], dtype=torch.float32, device=dev)
    logits[rows[:, None], cols[None, :]] += vals.to(logits.dtype)


def min_p_(logits: torch.Tensor, rows: torch.Tensor, hists: list[list[int]], rules: RequestRules) -> None:
    """``min_p`` (sampling only): tokens of ``rows`` whose probability under the tempered row is below ``min_p`` times
    the row's largest to -inf, the mask computed as vLLM's ``MinPLogitsProcessor`` computes it (the row itself is not
    tempered here: the DSBD sampler divides by the temperature afterwards)."""
    if not rules.min_p or rules.temperature <= 0.0:
        return
    x = logits[rows]
    probs = torch.softmax(x.float() / torch.tensor(rules.temperature, dtype=torch.float32, device=x.device), dim=-1)
    cut = probs.amax(dim=-1, keepdim=True).mul_(rules.min_p)
    logits[rows] = x.masked_fill(probs < cut, float("-inf"))


# in vLLM's order; looked up by name at each call (the law tests' planted variants replace a target step by name);
# the draft's side keeps its own references (:data:`_DRAFT`)
PRE = ("allowed_", "bad_words_", "min_tokens_", "bias_")
POST = ("min_p_",)
_DRAFT = {"allowed_": allowed_, "min_tokens_": min_tokens_, "bias_": bias_, "min_p_": min_p_}


def _target(logits: torch.Tensor, requests: list[TargetRows], names: tuple[str, ...]) -> torch.Tensor:
    g = globals()
    for r in requests:
        rules = getattr(r, "rules", None)
        if rules is None:
            continue
        rows = torch.arange(r.first_row, r.first_row + 1 + len(r.tokens), device=logits.device)
        hists = node_histories(r.output, r.tokens, r.parents)
        for name in names:
            g[name](logits, rows, hists, rules)
    return logits


def pre_target_(logits: torch.Tensor, requests: list[TargetRows]) -> torch.Tensor:
    """``allowed_token_ids``, ``bad_words``, ``min_tokens`` and ``logit_bias`` in place on the target's logits
    (float32 [N, V]) at each listed request's rows (its root's row and one per scheduled node, ``TargetRows``), each
    row with its own history (:func:`node_histories`); before the penalties. Returns ``logits``."""
    return _target(logits, requests, PRE)


def post_target_(logits: torch.Tensor, requests: list[TargetRows]) -> torch.Tensor:
    """``min_p`` in place on the same rows, after the penalties (the sampler tempers afterwards). Returns
    ``logits``."""
    return _target(logits, requests, POST)


class DraftRules:
    """The draft's side for one drafting call: each listed request's beam slots' paths over the depths (on the
    device), applied to the draft's logits [R, W, V] at the live beams before each beam step (:meth:`pre`, before the
    penalties, and :meth:`post`, after them), advanced with the step's draws (:meth:`advance`). No host read: the
    rules that look at a slot's path (``bad_words``) compare on the device; ``min_tokens`` looks at the depth only
    (every slot of a step has the same output length)."""

    def __init__(self, sel: list[int], outputs: list[list[int]], rules: list[RequestRules], width: int, vocab: int,
                 device):
        self.sel, self.rules, self.width, self.vocab = sel, rules, width, vocab
        self.out_len = [len(o) for o in outputs]
        # the last tokens of each output a bad word's prefix may match (-1 where the output is shorter: no match)
        self.tails = []
        for o, r in zip(outputs, rules):
            n = max([len(w) - 1 for w in r.bad_words] + [0])
            tail = [-1] * max(n - len(o), 0) + (list(o[max(len(o) - n, 0):]) if n else [])
            self.tails.append(torch.tensor(tail, dtype=torch.int64).to(device))
        self.path = torch.full((len(sel), width, 0), -1, dtype=torch.int64, device=device)  # [Rr, W, d] tokens

    def _apply(self, full: torch.Tensor, pre: bool) -> torch.Tensor:
        out = full.clone()
        W, V = full.shape[1], full.shape[2]
        d = self.path.shape[2]  # the tokens each slot's path adds to the output
        slots = torch.arange(W, device=full.device)
        for k, (i, rules) in enumerate(zip(self.sel, self.rules)):
            if not pre:
                _DRAFT["min_p_"](out[i], slots, [], rules)
                continue
            _DRAFT["allowed_"](out[i], slots, [], rules)
            if rules.bad_words:  # [W, n + d] each slot's last output tokens and its path
                hist = torch.cat([self.tails[k][None, :].expand(W, -1), self.path[k]], 1)
                for word in rules.bad_words:
                    n = len(word) - 1
                    if not 0 <= word[-1] < V or n > self.out_len[k] + d:
                        continue
                    if n == 0:
                        out[i, :, word[-1]] = float("-inf")
                        continue
                    prefix = torch.tensor(word[:-1], dtype=torch.int64, device=full.device)
                    hit = (hist[:, hist.shape[1] - n:] == prefix[None, :]).all(1)  # [W]
                    out[i, :, word[-1]] = torch.where(hit, float("-inf"), out[i, :, word[-1]])
            if rules.min_tokens and self.out_len[k] + d < rules.min_tokens:  # every slot's output is this long
                _DRAFT["min_tokens_"](out[i], slots, [[]] * W, rules)
            _DRAFT["bias_"](out[i], slots, [], rules)
        return out

    def pre(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` [R, W, V] with the rules before the penalties applied to the listed requests' slots (a new
        tensor: the caller's stays as it was)."""
        return self._apply(full, True)

    def post(self, full: torch.Tensor) -> torch.Tensor:
        """``min_p``, after the penalties (a new tensor)."""
        return self._apply(full, False)

    def fork(self) -> "DraftRules":
        """A copy at the same depth (:meth:`advance` replaces the paths, never writes them)."""
        new = object.__new__(DraftRules)
        new.__dict__.update(self.__dict__)
        return new

    def advance(self, parent: torch.Tensor, token: torch.Tensor) -> None:
        """After a beam step whose draws are (``parent`` slot, ``token``) [R, ws]: slot s of the next depth holds draw
        s, whose path is its parent slot's path + its token (slots past ws: padding, -1)."""
        sel = torch.tensor(self.sel, dtype=torch.int64, device=parent.device)
        par, tok = parent[sel], token[sel]  # [Rr, ws]
        d = self.path.shape[2]
        path = torch.cat([self.path.gather(1, par[:, :, None].expand(-1, -1, d)), tok[:, :, None]], 2)
        pad = self.width - path.shape[1]
        self.path = torch.nn.functional.pad(path, (0, 0, 0, pad), value=-1) if pad else path


class DraftRows:
    """The draft's grammar masks (``grammar.DraftGrammar``), penalties (``penalties.DraftPenalties``) and rules
    (:class:`DraftRules`) of one drafting call, behind the interface the drafter calls: :meth:`apply` (grammar, rules,
    penalties, ``min_p``: vLLM's order), :meth:`advance`, :meth:`fork`."""

    def __init__(self, pen, rules: DraftRules | None, gram=None):
        self.pen, self.rules, self.gram = pen, rules, gram

    def apply(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` [R, W, V] processed as vLLM processes a row before sampling (a new tensor)."""
        if self.gram is not None:  # vLLM masks the grammar first (``sample_tokens``, before its sampler)
            full = self.gram.apply(full)
        if self.rules is not None:
            full = self.rules.pre(full)
        if self.pen is not None:
            full = self.pen.apply(full)
        if self.rules is not None:
            full = self.rules.post(full)
        return full

    def advance(self, parent: torch.Tensor, token: torch.Tensor) -> None:
        """Both sides' paths after a beam step."""
        for side in (self.pen, self.rules, self.gram):
            if side is not None:
                side.advance(parent, token)

    def fork(self) -> "DraftRows":
        """A copy at the same depth."""
        return DraftRows(self.pen.fork() if self.pen is not None else None,
                         self.rules.fork() if self.rules is not None else None,
                         self.gram.fork() if self.gram is not None else None)
