"""What a DSBD engine cannot do, refused at start-up with the reason (never a wrong answer or a crash mid-decode).

:func:`check_attention_layers` (the runner, after loading): forest attention is plain causal self-attention over an
unquantised paged cache, so sliding windows, ALiBi, sinks, softcapping, other attention classes and quantised KV caches
are refused, naming feature and layer. :func:`check_engine_config` (patch ``vllm_post_init``): models with
multimodal rotary positions (M-RoPE / XD-RoPE), and settings vLLM applies in the sampler DSBD replaces: ``--logits-processors`` and a reasoning config with thinking delimiters are refused;
installed logits-processor plugins, which vLLM skips for every speculative method, get a warning. Why each:
docs/design/startup.md §3.7.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("vllm.vllm_dsbd.engine")

__all__ = ["check_attention_layers", "check_engine_config", "has_window", "unsupported_features"]

_PLAIN_KV_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")
_SUPPORTED = ("plain causal decoder self-attention (vLLM's Attention layer) with no sliding window, ALiBi, attention "
              "sinks or logit softcapping, over an unquantised KV cache")


def has_window(sliding_window) -> bool:
    """A sliding window is set: an int > 0 (CPU impl) or a (left, right) pair with one side >= 0 (FlashAttention
    keeps (-1, -1) for none)."""
    if sliding_window is None:
        return False
    if isinstance(sliding_window, (tuple, list)):
        return any(w is not None and w >= 0 for w in sliding_window)
    return sliding_window > 0


def unsupported_features(layer) -> list[str]:
    """What forest attention cannot reproduce in one attention layer (empty: supported)."""
    from vllm.model_executor.layers.attention import Attention

    if type(layer) is not Attention:
        return [f"layer type {type(layer).__name__}"]
    impl = getattr(layer, "impl", None)
    found = []
    attn_type = getattr(layer, "attn_type", "decoder")
    if str(getattr(attn_type, "value", attn_type)) != "decoder":
        found.append(f"attention type {getattr(attn_type, 'value', attn_type)}")
    if has_window(getattr(impl, "sliding_window", None)) or has_window(getattr(layer, "sliding_window", None)):
        found.append("sliding window")
    if getattr(impl, "alibi_slopes", None) is not None:
        found.append("ALiBi")
    if getattr(impl, "sinks", None) is not None:
        found.append("attention sinks")
    if getattr(impl, "logits_soft_cap", None):
        found.append("logit softcapping")
    kv_dtype = getattr(layer, "kv_cache_dtype", "auto")
    if kv_dtype not in _PLAIN_KV_DTYPES:
        found.append(f"quantised KV cache (kv_cache_dtype={kv_dtype})")
    return found


def check_attention_layers(layers: dict) -> None:
    """Raises ValueError naming each unsupported feature and the first layer that has it, for the attention layers
    among ``layers`` (name -> module: the static forward context, target and draft layers)."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    first: dict[str, tuple[str, int]] = {}  # feature -> (first layer, number of layers)
    for name, layer in layers.items():
        if not isinstance(layer, AttentionLayerBase):
            continue  # e.g. fused MoE layers register there too
        for feature in unsupported_features(layer):
            at, n = first.get(feature, (name, 0))
            first[feature] = (at, n + 1)
    if first:
        found = "; ".join(f"{feature} in layer {at!r}" + (f" (and {n - 1} more)" if n > 1 else "")
                          for feature, (at, n) in first.items())
        raise ValueError(f"speculative method 'dsbd' cannot run this model: {found}. Forest attention supports "
                         f"{_SUPPORTED} only.")


def check_engine_config(vllm_config) -> None:
    """Refuses (ValueError) the engine settings a DSBD engine would ignore; warns about installed logits-processor
    plugins."""
    model_config = vllm_config.model_config
    if getattr(model_config, "uses_mrope", False) or getattr(model_config, "uses_xdrope_dim", 0):
        # vLLM feeds such models their positions from ``mrope_positions`` / ``xdrope_positions``, while DSBD writes
        # forest and trie nodes' positions to ``positions`` only: their logits would be silently wrong
        raise ValueError(
            "speculative method 'dsbd' cannot run this model: it uses multimodal rotary positions (M-RoPE / "
            "XD-RoPE, e.g. Qwen2-VL), and DSBD sets only the linear positions of its draft forests and beam tries. "
            "Serve it without --speculative-method dsbd."
        )
    procs = getattr(model_config, "logits_processors", None)
    if procs:
        names = [p if isinstance(p, str) else f"{p.__module__}:{p.__qualname__}" for p in procs]
        raise ValueError(
            f"speculative method 'dsbd' does not apply engine-level logits processors (logits_processors / "
            f"--logits-processors: {names}): the DSBD verification sampler replaces vLLM's sampler, where they run. "
            "Start the engine without them."
        )
    reasoning = getattr(vllm_config, "reasoning_config", None)
    if reasoning is not None and (reasoning.reasoning_start_str or reasoning.reasoning_end_str):
        raise ValueError(
            "speculative method 'dsbd' does not apply thinking-token budgets: reasoning_config / "
            "--reasoning-config (reasoning_start_str/reasoning_end_str) enables SamplingParams.thinking_token_budget, "
            "which vLLM enforces in the sampler that DSBD replaces. Start the engine without --reasoning-config."
        )
    from importlib.metadata import entry_points

    plugins = [ep.value for ep in entry_points(group="vllm.logits_processors")]
    if plugins:
        logger.warning("DSBD: the installed logits-processor plugins %s are not applied (vLLM skips them with "
                       "speculative decoding; DSBD's sampler does not run them either)", plugins)
