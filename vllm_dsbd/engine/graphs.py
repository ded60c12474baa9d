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
(:func:`check`). The GPU runner's later resolution (``resolve_cudagraph_mode_and_sizes``) only lowers the mode, and
the draft model's dispatcher knows PIECEWISE and NONE only (``llm_base_proposer.initialize_cudagraph_keys``); the
DSBD drafter's own passes run with no runtime graph mode at all.

With ``full_cuda_graphs`` (DSBD setting, off by default) the full modes are kept: a pass without forest attention
(every forest a chain, which the layers' causal attention computes right, ``attention.drop_chain_queries``, and no
beam request's trie) is exactly a vLLM spec-decode pass and may replay a full graph; a pass with forest attention
never does, because the DSBD runner excludes FULL from its dispatch (``runner._determine_batch_execution_and_padding``,
vLLM's own exclusion for cascade attention). Those passes replay PIECEWISE graphs where attention is outside the
pieces, and run eagerly otherwise, so a mode whose piecewise graphs would contain attention is lowered
(FULL_AND_PIECEWISE -> FULL_DECODE_ONLY, PIECEWISE -> NONE).
"""
from __future__ import annotations

import logging

logger = logging.getLogger("vllm.vllm_dsbd.engine")

__all__ = ["attention_outside_graphs", "check", "enforce", "safe_mode"]


def attention_outside_graphs(compilation_config) -> bool:
    """Whether PIECEWISE graphs of this compilation config leave the attention ops out of every graph."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    return bool(compilation_config.is_attention_compiled_piecewise() or is_breakable_cudagraph_enabled())


def full_graphs_allowed(vllm_config) -> bool:
    """Whether the DSBD config of ``vllm_config`` sets ``full_cuda_graphs`` (validated when the config was built)."""
    from vllm_dsbd.config import ADDITIONAL_CONFIG_KEY

    extra = (getattr(vllm_config, "additional_config", None) or {}).get(ADDITIONAL_CONFIG_KEY) or {}
    return extra.get("full_cuda_graphs", False) is True


def safe_mode(compilation_config, full_graphs: bool = False):
    """The CUDA-graph mode a DSBD engine runs with, given the mode vLLM resolved: NONE stays NONE. Without
    ``full_graphs`` any other mode becomes PIECEWISE if attention stays outside the pieces, else NONE. With it, the
    full modes stay where attention is outside the pieces; otherwise FULL and FULL_DECODE_ONLY stay (their other
    passes run eagerly), FULL_AND_PIECEWISE becomes FULL_DECODE_ONLY and PIECEWISE becomes NONE."""
    from vllm.config.compilation import CUDAGraphMode

    mode = compilation_config.cudagraph_mode
    if mode is None or mode == CUDAGraphMode.NONE:
        return CUDAGraphMode.NONE
    split = attention_outside_graphs(compilation_config)
    if not full_graphs:
        return CUDAGraphMode.PIECEWISE if split else CUDAGraphMode.NONE
    if split or mode in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY):
        return mode
    return CUDAGraphMode.FULL_DECODE_ONLY if mode == CUDAGraphMode.FULL_AND_PIECEWISE else CUDAGraphMode.NONE


def enforce(vllm_config) -> tuple | None:
    """Sets a DSBD config's ``cudagraph_mode`` to :func:`safe_mode` and logs what changed at INFO.

    Returns ``(old, new)`` when the mode was changed, None otherwise (also for any config that is not DSBD's)."""
    from vllm_dsbd.config import uses_dsbd

    if not uses_dsbd(vllm_config):
        return None
    cc = vllm_config.compilation_config
    old, new = cc.cudagraph_mode, safe_mode(cc, full_graphs_allowed(vllm_config))
    if old == new:
        return None
    cc.cudagraph_mode = new
    logger.info(
        "DSBD: cudagraph_mode %s -> %s: forest attention runs in Python inside the attention layers, so no CUDA "
        "graph may contain attention%s (%s)", getattr(old, "name", old), new.name,
        " unless its pass has no forest attention (full_cuda_graphs)" if new.has_full_cudagraphs() else "",
        "graphs split at the attention ops" if new.name == "PIECEWISE" or attention_outside_graphs(cc)
        else "attention is not split out of the compiled graph",
    )
    return old, new


def check(vllm_config) -> None:
    """Raises RuntimeError if a DSBD config could replay a CUDA graph over attention (the worker's last check)."""
    from vllm.config.compilation import CUDAGraphMode

    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is None or mode == CUDAGraphMode.NONE:
        return
    cc = vllm_config.compilation_config
    if full_graphs_allowed(vllm_config):  # full graphs only over passes without forest attention (the runner)
        if safe_mode(cc, True) == mode:
            return
    elif mode == CUDAGraphMode.PIECEWISE and attention_outside_graphs(cc):
        return
    raise RuntimeError(
        f"speculative method 'dsbd': cudagraph_mode {mode.name} would replay CUDA graphs over forest attention "
        "(splitting_ops must contain the attention ops for PIECEWISE; full modes need full_cuda_graphs); the plugin "
        "sets a safe mode when the config is built, so this config was changed afterwards"
    )
