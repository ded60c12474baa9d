"""CUDA-graph safety of a DSBD engine: no CUDA graph may ever replay over forest attention.

The forest recompute runs in Python inside each attention layer's ``impl.forward`` (:mod:`.attention`), reading the
forest of the current pass. A CUDA graph replays the kernels it captured and skips Python, so a graph that contains
attention would replay the plain causal attention of its capture over a forest: wrong outputs, no error. What vLLM
0.26 captures, by ``compilation_config.cudagraph_mode``:

* FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE: the whole forward, attention included, for uniform decode batches
  (1 + ``num_speculative_tokens`` query tokens per request: every DSBD decode batch) and, for FULL, mixed batches too.
  GPU platforms default to FULL_AND_PIECEWISE (optimization levels 2 and 3, ``config/vllm.py``).
* PIECEWISE: the pieces between the splitting ops. Attention is outside every piece iff the graph is split at the
  attention custom op (``CompilationConfig.is_attention_compiled_piecewise()``: Dynamo split or Inductor partition),
  or with ``VLLM_USE_BREAKABLE_CUDAGRAPH`` (attention ops end the capture segment and run eagerly, except under a
  FULL runtime mode).
* NONE: nothing.

A DSBD engine therefore runs with PIECEWISE where attention is outside the pieces, and NONE otherwise
(:func:`enforce`, called by the ``vllm_post_init`` patch at the end of ``VllmConfig.__post_init__``, after every vLLM
override that could raise the mode again); the DSBD worker checks the result before building its runner
(:func:`check`). The GPU runner's later resolution (``resolve_cudagraph_mode_and_sizes``) only lowers the mode, and the
draft model's dispatcher knows PIECEWISE and NONE only (``llm_base_proposer.initialize_cudagraph_keys``); the DSBD
drafter's own passes run with no runtime graph mode at all.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("vllm.vllm_dsbd.engine")

__all__ = ["attention_outside_graphs", "check", "enforce", "safe_mode"]


def attention_outside_graphs(compilation_config) -> bool:
    """Whether PIECEWISE graphs of this compilation config leave the attention ops out of every graph."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    return bool(compilation_config.is_attention_compiled_piecewise() or is_breakable_cudagraph_enabled())


def safe_mode(compilation_config):
    """The CUDA-graph mode a DSBD engine runs with, given the mode vLLM resolved: NONE stays NONE; any other mode
    becomes PIECEWISE if attention stays outside the pieces, else NONE."""
    from vllm.config.compilation import CUDAGraphMode

    mode = compilation_config.cudagraph_mode
    if mode is None or mode == CUDAGraphMode.NONE:
        return CUDAGraphMode.NONE
    return CUDAGraphMode.PIECEWISE if attention_outside_graphs(compilation_config) else CUDAGraphMode.NONE


def enforce(vllm_config) -> tuple | None:
    """Sets a DSBD config's ``cudagraph_mode`` to :func:`safe_mode` and logs what changed at INFO.

    Returns ``(old, new)`` when the mode was changed, None otherwise (also for any config that is not DSBD's)."""
    from vllm_dsbd.config import uses_dsbd

    if not uses_dsbd(vllm_config):
        return None
    cc = vllm_config.compilation_config
    old, new = cc.cudagraph_mode, safe_mode(cc)
    if old == new:
        return None
    cc.cudagraph_mode = new
    logger.info(
        "DSBD: cudagraph_mode %s -> %s: forest attention runs in Python inside the attention layers, so no CUDA "
        "graph may contain attention (%s)", getattr(old, "name", old), new.name,
        "graphs split at the attention ops" if new.name == "PIECEWISE"
        else "attention is not split out of the compiled graph",
    )
    return old, new


def check(vllm_config) -> None:
    """Raises RuntimeError if a DSBD config could replay a CUDA graph over attention (the worker's last check)."""
    from vllm.config.compilation import CUDAGraphMode

    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is None or mode == CUDAGraphMode.NONE:
        return
    if mode != CUDAGraphMode.PIECEWISE or not attention_outside_graphs(vllm_config.compilation_config):
        raise RuntimeError(
            f"speculative method 'dsbd': cudagraph_mode {mode.name} would replay CUDA graphs over forest attention "
            "(splitting_ops must contain the attention ops for PIECEWISE); the plugin sets PIECEWISE or NONE when "
            "the config is built, so this config was changed afterwards"
        )
