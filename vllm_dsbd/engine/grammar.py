"""Structured outputs on DSBD forests: every forest node's rows masked by the grammar after its own path.

vLLM 0.26 masks a structured request's rows with bitmasks its scheduler computes by walking the request's grammar
matcher along the draft *chain* (``StructuredOutputManager.grammar_bitmask``), and cuts the drafts to their
grammar-valid chain prefix (``Scheduler.update_draft_token_ids``); both are wrong for a forest, and the draft's rows,
drawn in the worker before the scheduler sees the forest, need masks too. So a DSBD worker keeps its own matcher per
structured request, compiled by vLLM's own structured-output backend (the one the front end chose for the request,
``StructuredOutputsParams._backend``), advanced lazily with the request's output tokens (the tokens vLLM's scheduler
advances its own matcher with). A row whose history is output + path (the root's: the output; node c's: output + c's
path from the root) is masked by the bitmask of the matcher after that path (accept, fill, roll back), as vLLM
masks a plain decode row; a terminated grammar (EOS accepted) or a path the grammar rejects (a node that can never be
accepted, a dead slot's padding) leaves its row unmasked, as vLLM leaves a terminated request's row.
``patches/grammar_forests.py`` keeps vLLM's scheduler from masking or cutting DSBD forests.

With a reasoning parser (``--reasoning-parser``, ``enable_in_reasoning`` off) vLLM neither masks nor advances the
grammar until the reasoning end marker (``StructuredOutputManager.should_fill_bitmask`` / ``should_advance``): a
:class:`ReasoningGate` does the same per row. A row whose history (prompt + output + path) has not reached the end
marker is unmasked; after it, the grammar starts with the token that follows the marker (the marker itself is
reasoning). Whether reasoning had ended before the first output token (the prompt, or the chat front end's word) is
the scheduler's (patch ``reasoning_gate``).

The masks go on first, before the logits rules and the penalties (vLLM masks in ``sample_tokens``, before its
sampler): :func:`mask_target_` on the target's rows before verification, :class:`DraftGrammar` on the draft's rows
before each beam step (so the Q recorded for verification is the masked law). Beam requests follow vLLM's beam search
under the grammar instead, without a forest (``beams/grammar.py``, on a :class:`RequestGrammar` of their own).
"""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Sequence

import torch

from .penalties import node_paths

__all__ = ["Compiler", "DraftGrammar", "ReasoningGate", "RequestGrammar", "apply_bitmask_", "mask_target_",
           "target_paths"]


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Every token whose bit is 0 in its row's int32 ``bitmask`` [n, ceil(V / 32)] (xgrammar's packing: token t is bit
    t % 32 of word t // 32) to -inf in ``logits`` [n, V], in place; tokens past the bitmask's width are kept (as
    ``xgr.apply_token_bitmask_inplace`` keeps them). Returns ``logits``."""
    n, V = logits.shape
    width = min(V, bitmask.shape[1] * 32)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device)[:, :, None] >> shifts) & 1  # [n, words, 32]
    off = bits.reshape(n, -1)[:, :width] == 0
    logits[:, :width].masked_fill_(off, float("-inf"))
    return logits


class ReasoningGate:
    """vLLM's reasoning gate for one structured request: where its reasoning ends (``reasoner``: the request's vLLM
    ``ReasoningParser``, its ``is_reasoning_end_streaming`` asked token by token, as vLLM's scheduler asks it once
    per emitted token; ``ended``: reasoning had ended before the first output token)."""

    def __init__(self, reasoner, ended: bool, prompt: Sequence[int]):
        self.reasoner, self.ended = reasoner, bool(ended)
        self.prompt = [int(t) for t in prompt]

    def end_in(self, before: Sequence[int], tokens: Sequence[int]) -> int | None:
        """The index in ``tokens`` of the end marker, the reasoning still going on after ``before`` (the output
        tokens ahead of them); None: not in ``tokens``."""
        seq = self.prompt + list(before)
        for j, t in enumerate(tokens):
            seq.append(int(t))
            if self.reasoner.is_reasoning_end_streaming(seq, [int(t)]):
                return j
        return None


class RequestGrammar:
    """One structured request's worker-side matcher (vLLM's ``StructuredOutputGrammar``), advanced with the request's
    output tokens on demand, and the bitmasks after paths from there. ``gate``: the request's :class:`ReasoningGate`
    (None: the grammar acts from the first output token)."""

    def __init__(self, req_id: str, grammar, allocate, vocab: int, gate: ReasoningGate | None = None):
        self.req_id, self.grammar, self._allocate, self.vocab, self.gate = req_id, grammar, allocate, vocab, gate
        self.consumed: list[int] = []  # the output tokens seen (the matcher is advanced with those after ``start``)
        self.broken = False  # the output left the grammar (never with exact masks): rows stay unmasked
        self.start = self._start0()  # the output index where the grammar starts (None: still reasoning)

    def _start0(self) -> int | None:
        return 0 if self.gate is None or self.gate.ended else None

    def sync(self, output: Sequence[int]) -> None:
        """Advances the matcher to ``output`` (the request's output tokens; only ever extended)."""
        n = len(self.consumed)
        if len(output) < n or list(output[:n]) != self.consumed:  # not an extension: start over
            self.grammar.reset()
            self.consumed, self.broken, self.start, n = [], False, self._start0(), 0
        new = [int(t) for t in output[n:]]
        if self.start is None and new:  # vLLM's should_advance: the marker is reasoning, the grammar starts after it
            j = self.gate.end_in(self.consumed, new)
            if j is not None:
                self.start = n + j + 1
        self.consumed += new
        g = self.grammar
        for t in new[max(0, self.start - n):] if self.start is not None else ():
            if self.broken or g.is_terminated():
                break
            if not 0 <= t < self.vocab or len(g.validate_tokens([t])) != 1 or not g.accept_tokens(self.req_id, [t]):
                self.broken = True

    def bitmasks(self, output: Sequence[int], paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """int32 [len(paths), words]: row i the bitmask after output + ``paths[i]`` (all ones where the grammar is
        terminated there or rejects the path, or the reasoning has not ended there)."""
        self.sync(output)
        bm = self._allocate(len(paths))
        g, seen = self.grammar, {}
        for i, path in enumerate(paths):
            key = tuple(int(t) for t in path)
            if key in seen:
                bm[i] = bm[seen[key]]
                continue
            seen[key] = i
            grammar_part = key
            if self.start is None:  # still reasoning after the output: the grammar starts after the path's marker
                j = self.gate.end_in(self.consumed, key)
                if j is None:
                    bm[i].fill_(-1)
                    continue
                grammar_part = key[j + 1 :]
            k = 0  # the path's tokens accepted (each checked first: a rejected token is no error)
            ok = not self.broken
            for t in grammar_part:
                if not ok or g.is_terminated() or not 0 <= t < self.vocab or len(g.validate_tokens([t])) != 1:
                    ok = False
                    break
                ok = g.accept_tokens(self.req_id, [t])
                k += ok
            if ok and not g.is_terminated():
                g.fill_bitmask(bm, i)
            else:
                bm[i].fill_(-1)
            if k:
                g.rollback(k)
        return bm


class Compiler:
    """Compiles a structured request's grammar in the worker with vLLM's ``StructuredOutputManager`` (built on first
    use: the model's tokenizer, the engine's structured-outputs config, the request's backend, the reasoning parser's
    class)."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self._mgr = None

    def __call__(self, req_id: str, sampling_params, reasoning: dict | None = None,
                 prompt: Sequence[int] = ()) -> RequestGrammar | None:
        """``reasoning``: the scheduler's word on a plain request under vLLM's reasoning gate (patch
        ``reasoning_gate``: ``{"ended": bool, "kwargs": the parser's per-request kwargs}``; None: no gate)."""
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.structured_output.request import StructuredOutputRequest

        so = StructuredOutputRequest.from_sampling_params(sampling_params)
        if so is None:
            return None
        params = sampling_params.structured_outputs
        if getattr(params, "_backend", None) is None:  # the front end sets it; a bare request gets the engine's
            backend = self.vllm_config.structured_outputs_config.backend
            params._backend = "xgrammar" if backend == "auto" else backend
        if self._mgr is None:
            self._mgr = StructuredOutputManager(self.vllm_config)
        mgr = self._mgr
        mgr.grammar_init(SimpleNamespace(request_id=req_id, sampling_params=sampling_params,
                                         structured_output_request=so))
        g = so._grammar
        if isinstance(g, Future):
            g = g.result()
        gate = None
        if reasoning is not None and mgr.reasoner_cls is not None and not mgr.enable_in_reasoning:
            reasoner = mgr.reasoner_cls(tokenizer=mgr.tokenizer, **(reasoning.get("kwargs") or {}))
            gate = ReasoningGate(reasoner, reasoning["ended"], prompt)
        backend = mgr.backend
        return RequestGrammar(req_id, g, backend.allocate_token_bitmask, int(backend.vocab_size), gate)


def target_paths(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """The paths whose grammar masks a request's target rows: the root's row (empty path), then each node's path
    (looked up by name at each call: the law test's planted variant replaces it)."""
    return [[]] + node_paths(tokens, parents)


def mask_target_(logits: torch.Tensor, requests) -> torch.Tensor:
    """Each listed request with a grammar (``penalties.TargetRows.grammar``): its root's row and one row per scheduled
    node of ``logits`` (float32 [N, V]) masked by the grammar after output + the row's path, in place. Returns
    ``logits``."""
    for r in requests:
        g = getattr(r, "grammar", None)
        if g is None:
            continue
        paths = globals()["target_paths"](r.tokens, r.parents)
        n = 1 + len(r.tokens)
        apply_bitmask_(logits[r.first_row : r.first_row + n], g.bitmasks(r.output, paths[:n]))
    return logits


class DraftGrammar:
    """The draft's side for one drafting call: each listed request's beam slots' paths (host lists), its draft rows
    [R, W, V] masked before each beam step (:meth:`apply`) by the grammar after output + the slot's path, the paths
    advanced with the step's draws (:meth:`advance`, one host read)."""

    def __init__(self, sel: list[int], outputs: list[list[int]], grammars: list[RequestGrammar], width: int):
        self.sel, self.outputs, self.grammars, self.width = sel, outputs, grammars, width
        self.paths: list[list[tuple[int, ...]]] = [[()] * width for _ in sel]

    def apply(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` [R, W, V] with the listed requests' slots masked (a new tensor)."""
        out = full.clone()
        for k, i in enumerate(self.sel):
            bm = self.grammars[k].bitmasks(self.outputs[k], self.paths[k])
            apply_bitmask_(out[i], bm)
        return out

    def fork(self) -> "DraftGrammar":
        """A copy at the same depth (:meth:`advance` replaces the paths, never writes them)."""
        new = object.__new__(DraftGrammar)
        new.__dict__.update(self.__dict__)
        return new

    def advance(self, parent: torch.Tensor, token: torch.Tensor) -> None:
        """After a beam step whose draws are (``parent`` slot, ``token``) [R, ws]: slot s of the next depth holds draw
        s (slots past ws: empty paths, padding)."""
        sel = torch.tensor(self.sel, dtype=torch.int64, device=parent.device)
        par, tok = parent[sel].cpu().tolist(), token[sel].cpu().tolist()
        self.paths = [[old[p] + (t,) if 0 <= p < len(old) else () for p, t in zip(ps, ts)]
                      + [()] * (self.width - len(ps)) for old, ps, ts in zip(self.paths, par, tok)]
