"""Patch: a DSBD worker learns, with each new plain structured request, whether vLLM's reasoning gate is on for it and
whether its reasoning had ended before its first output token.

vLLM 0.26 neither masks nor advances a structured request's grammar while the model reasons, when the engine has a
reasoning parser (``--reasoning-parser``) and ``enable_in_reasoning`` is off
(``StructuredOutputManager.should_fill_bitmask`` / ``should_advance``, v1/structured_output/__init__.py:362-437). The
scheduler's ``Request`` knows whether reasoning had ended before the output (``reasoning_ended``: the chat front end
says so, e.g. ``include_reasoning`` false, or it is read from the prompt by the parser) and the parser's per-request
kwargs (``reasoning_parser_kwargs``: chat template kwargs); the worker, which masks every forest row itself
(``engine/grammar.py``), sees only ``NewRequestData``.

How: wrap ``Scheduler.schedule``; on a DSBD engine with a reasoning parser and ``enable_in_reasoning`` off, each new
plain (not beam) structured request's ``NewRequestData`` gets ``dsbd_reasoning = {"ended": bool, "kwargs": dict |
None}`` (an attribute of the dataclass instance: it travels with the scheduler output, in process or pickled to
worker processes). ``ended`` is ``should_fill_bitmask(request)`` (vLLM's own: the front end's value, else the prompt
through the parser), which also records it on the request, as vLLM's grammar bitmask step would. The scheduler's own
matcher follows the same gate (patch ``grammar_forests``, ``should_advance``). Other engines and requests: the
original, untouched.

When it can go: vLLM lets a speculative method mask tree-shaped drafts in the scheduler (with ``grammar_forests``).
"""

from __future__ import annotations

import types

from vllm_dsbd.config import uses_dsbd
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "reasoning_gate"
MODULE = "vllm.v1.core.sched.scheduler"
ATTR = "dsbd_reasoning"  # NewRequestData attribute read by the DSBD runner (engine/runner.py, _update_states)


def apply() -> None:
    when_imported(MODULE, _patch)


def gated(manager) -> bool:
    """Whether vLLM's reasoning gate acts on structured requests (a reasoning parser, ``enable_in_reasoning`` off)."""
    return manager.reasoner_cls is not None and not manager.enable_in_reasoning


def _patch(mod: types.ModuleType) -> None:
    from vllm_dsbd.patches.grammar_forests import _is_beam

    def make(orig):
        def schedule(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            if not uses_dsbd(self.vllm_config) or not gated(self.structured_output_manager):
                return out
            for new in out.scheduled_new_reqs:
                request = self.requests.get(new.req_id)
                if request is None or request.structured_output_request is None or _is_beam(request):
                    continue
                ended = self.structured_output_manager.should_fill_bitmask(request)
                setattr(new, ATTR, {"ended": bool(ended),
                                    "kwargs": request.structured_output_request.reasoning_parser_kwargs})
            return out

        return schedule

    wrap_method(PATCH_ID, mod.Scheduler, "schedule", make)
