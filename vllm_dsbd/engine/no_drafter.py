"""The drafter of a DSBD engine without a draft model (:class:`NoDrafter`), and how vLLM's runner is built for one
(:func:`vllm_runner_init`). docs/design/step.md §3.1 (how the engine is built).
"""
from __future__ import annotations

import contextlib
import logging

logger = logging.getLogger("vllm.vllm_dsbd.engine")


class NoDrafter:
    """The drafter of a DSBD engine without a draft model: loads nothing and drafts no forest (its requests have
    depth 0, so the runner never gives it a job)."""

    def __init__(self, *args, **kwargs):
        pass

    def load_model(self, target_model) -> None:  # vLLM's runner calls it after loading the target
        logger.info("DSBD: engine without a draft model: no draft to load")

    def propose(self, *args, **kwargs):  # what vLLM's custom-class proposer check asks for; never called
        raise RuntimeError("DSBD engine without a draft model: there is nothing to propose")

    def propose_forests(self, jobs: list) -> list:
        if jobs:
            raise RuntimeError("DSBD engine without a draft model was asked to draft a forest")
        return []


@contextlib.contextmanager
def vllm_runner_init(spec, has_draft: bool):
    """Around vLLM's runner ``__init__``: an engine without a draft model is seen as method "custom_class" with
    :class:`NoDrafter`, because vLLM's runner raises "Unknown speculative decoding method" for a method it does not know
    (gpu_model_runner.py:595-653) and "dsbd" without a draft is not a draft-model engine (patch ``uses_draft_model``).
    Nothing else in that ``__init__`` (nor in the worker's ``init_device``) reads the method or the model."""
    if has_draft:
        yield
        return
    method, model = spec.method, spec.model
    spec.method, spec.model = "custom_class", f"{__name__}.{NoDrafter.__name__}"
    try:
        yield
    finally:
        spec.method, spec.model = method, model
