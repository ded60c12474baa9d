"""CUDA-graph safety of a DSBD engine: no CUDA graph may ever replay over forest attention.

The forest recompute runs in Python inside each attention layer's ``impl.forward``; a graph replay skips Python, so a
graph containing attention would replay plain causal attention over a forest: wrong outputs, no error. So
:func:`enforce` (patch ``vllm_post_init``, at the end of ``VllmConfig.__post_init__``, after every vLLM override that
could raise the mode) lowers ``cudagraph_mode`` to PIECEWISE where attention is outside the pieces, else NONE, and the
worker checks the result (:func:`check`). With ``full_cuda_graphs`` the full modes stay for passes without forest
attention; the runner excludes FULL from passes with it. What vLLM 0.26 captures in each mode, and why this is enough:
docs/design/attention.md §3.5.
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
