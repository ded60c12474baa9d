"""Patch: vLLM's scheduler neither cuts DSBD forests to a grammar-valid chain nor masks them as one.

vLLM 0.26 treats a structured request's drafts as a chain: ``Scheduler.update_draft_token_ids`` keeps their longest
prefix the grammar accepts in sequence (``grammar.validate_tokens``, v1/core/sched/scheduler.py:2074-2076), and
``Scheduler.get_grammar_bitmask`` has ``StructuredOutputManager.grammar_bitmask`` walk the matcher along them
(v1/structured_output/__init__.py:285-350, raising ``AssertionError`` on a token the chain does not allow) for the
model runner to mask one row per position (``apply_grammar_bitmask`` in ``sample_tokens``). A DSBD forest is a tree
in compact depth-major order: its second node is usually a sibling of the first, so the chain cut drops it and the
chain masks are another path's. The DSBD worker masks every row of a structured request itself, each by the grammar
after its own path (``engine/grammar.py``), target and draft rows alike.

A beam request's emitted tokens are trie slots of several beams, no one sequence: vLLM's matcher would reject them
and end the request (``update_from_output``, "grammar rejected tokens"); the worker keeps each beam's grammar state
itself (``engine/beams/grammar.py``).

How: on a DSBD engine, ``update_draft_token_ids`` takes the runner's drafts as they are (no grammar cut; prefill
chunks still drop theirs), and ``get_grammar_bitmask`` returns None (nothing for vLLM's runner to mask). vLLM's
scheduler still advances its matcher with every emitted token of a plain request in ``update_from_output`` (and ends
a request whose tokens it rejects), so its grammar state is the accepted path's; ``StructuredOutputManager.
should_advance`` (the scheduler module's name for it) says no for a beam request (``extra_args["dsbd_beam"]``), whose
matcher vLLM then never advances. With vLLM's reasoning gate (a reasoning parser, ``enable_in_reasoning`` off),
``should_advance`` says no for a plain request until its output holds the end marker, then yes from the step that
holds it, and vLLM's ``trim_reasoning_for_advance`` gives the matcher that step's tokens after the marker: the
grammar's tokens of a one-token step, whatever the number of tokens a DSBD step emits (vLLM's own would look for the
marker in the step's last token only, ``num_computed_tokens`` counting the accepted drafts, and hold back the rest of
that step's tokens, which the matcher would then miss). The worker gates its masks alike (``engine/grammar.py``,
patch ``reasoning_gate``). Non-DSBD engines call the originals.

When it can go: vLLM lets a speculative method describe tree-shaped drafts (per-node bitmasks from the scheduler).
"""

from __future__ import annotations

import types

from vllm_dsbd.config import uses_dsbd
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "grammar_forests"
MODULE = "vllm.v1.core.sched.scheduler"


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(mod: types.ModuleType) -> None:
    def make_update(orig):
        def update_draft_token_ids(self, draft_token_ids) -> None:
            if not uses_dsbd(self.vllm_config):
                return orig(self, draft_token_ids)
            for req_id, spec_token_ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
                request = self.requests.get(req_id)
                if request is None or request.is_finished():
                    continue
                if request.is_prefill_chunk:
                    if request.spec_token_ids:
                        request.spec_token_ids = []
                    continue
                request.spec_token_ids = spec_token_ids

        return update_draft_token_ids

    def make_bitmask(orig):
        def get_grammar_bitmask(self, scheduler_output):
            if not uses_dsbd(self.vllm_config):
                return orig(self, scheduler_output)
            return None

        return get_grammar_bitmask

    def make_advance(orig):
        def should_advance(self, request) -> bool:
            if not uses_dsbd(self.vllm_config):
                return orig(self, request)
            if _is_beam(request):
                return False
            so = request.structured_output_request
            if not request.use_structured_output or so is None or self.enable_in_reasoning:
                return orig(self, request)
            reasoner = self._get_reasoner(request)
            if reasoner is None:
                return orig(self, request)
            if so.reasoning_ended is None:  # vLLM's grammar bitmask step reads it from the prompt first
                self.should_fill_bitmask(request)
            return bool(so.reasoning_ended) or _reasoning_ends(reasoner, request)

        return should_advance

    wrap_method(PATCH_ID, mod.Scheduler, "update_draft_token_ids", make_update)
    wrap_method(PATCH_ID, mod.Scheduler, "get_grammar_bitmask", make_bitmask)
    wrap_method(PATCH_ID, mod.StructuredOutputManager, "should_advance", make_advance)


def _reasoning_ends(reasoner, request) -> bool:
    """Whether the end marker is among a plain request's output tokens not looked at yet (each token asked as vLLM
    asks it after a one-token step); if so, the request's reasoning has ended and vLLM's
    ``trim_reasoning_for_advance`` gives the matcher the step's tokens after the marker."""
    so, toks = request.structured_output_request, request.all_token_ids
    start = getattr(so, "_dsbd_scanned", request.num_prompt_tokens)
    seq = list(toks[:start])
    for idx in range(start, len(toks)):
        seq.append(toks[idx])
        if reasoner.is_reasoning_end_streaming(seq, [toks[idx]]):
            so.reasoning_ended, so.reasoning_end_token_index = True, idx
            return True
    so._dsbd_scanned = len(toks)
    return False


def _is_beam(request) -> bool:
    """Whether a scheduler ``Request`` is a DSBD beam request (``extra_args["dsbd_beam"]``)."""
    from vllm_dsbd.requests import BEAM_KEY

    sp = getattr(request, "sampling_params", None)
    return sp is not None and (sp.extra_args or {}).get(BEAM_KEY) is not None
