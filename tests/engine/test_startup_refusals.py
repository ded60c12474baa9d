"""What a DSBD engine cannot do stops it at start-up with the reason (``vllm_dsbd/engine/support.py``), against the
real vLLM 0.26.0 on CPU.

* model features forest attention cannot reproduce: refused when the models are loaded, naming the feature and the
  layer (one real engine start, a tiny Mistral with a sliding window; the other features on real vLLM attention
  layers built without an engine);
* engine-level logits processors and thinking-budget reasoning configs: refused when the config is built.
Non-DSBD engines with the same settings are left to vLLM.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine_utils import shutdown  # noqa: F401  (sets the CPU engine environment before vllm is imported)
import vllm  # noqa: E402  (a broken vLLM fails the suite)

from vllm_dsbd import plugin  # noqa: E402
from vllm_dsbd.testing import models  # noqa: E402

plugin.register()

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.config.reasoning import ReasoningConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.layers.attention import Attention, EncoderOnlyAttention  # noqa: E402

from vllm_dsbd.engine import support  # noqa: E402

MIN_P = "vllm.v1.sample.logits_processor.builtin:MinPLogitsProcessor"  # a real engine-level logits processor


@pytest.fixture(scope="module")
def pair() -> tuple[str, str]:
    target, draft = models.tiny_llama_pair()
    return str(target), str(draft)


def engine_args(pair, dsbd: bool = True, **kw) -> EngineArgs:
    target, draft = pair
    spec = {"method": "dsbd", "model": draft, "num_speculative_tokens": 2} if dsbd else None
    return EngineArgs(model=target, dtype="float32", enforce_eager=True, max_model_len=256, speculative_config=spec,
                      **kw)


# ----------------------------------------------------------------------------------------------------------------
# model features, at model load
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sliding_window_model(pair, tmp_path_factory) -> str:
    """The tiny target as a Mistral with a 16-token sliding window (same weights and tokenizer)."""
    folder = tmp_path_factory.mktemp("mistral-sw")
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(f"{pair[0]}/{f}", folder / f)
    cfg = json.loads(open(f"{pair[0]}/config.json").read())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16)
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def test_sliding_window_model_stops_the_engine_at_start_up(sliding_window_model):
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    try:
        with pytest.raises(ValueError) as err:
            vllm.LLM(model=sliding_window_model, dtype="float32", enforce_eager=True, max_model_len=256,
                     enable_prefix_caching=False,
                     speculative_config={"method": "dsbd", "model": sliding_window_model, "num_speculative_tokens": 2})
    finally:
        cleanup_dist_env_and_memory()  # the worker had set up its process group before loading the models
    msg = str(err.value)
    assert msg.startswith("speculative method 'dsbd' cannot run this model: sliding window in layer "
                          "'model.layers.0.self_attn.attn' (and "), msg  # target and draft layers: all windowed
    assert "Forest attention supports plain causal decoder self-attention" in msg


@pytest.fixture(scope="module")
def layer_config(pair):
    return engine_args(pair, dsbd=False).create_engine_config()


def attention_layer(config, name: str, cls=Attention, **kw):
    """A real vLLM attention layer (CPU backend impl) with the given features."""
    with set_current_vllm_config(config):
        return cls(2, 64, 0.125, num_kv_heads=2, prefix=name, **kw)


FEATURES = {
    "sliding window": {"per_layer_sliding_window": 16},
    "ALiBi": {"alibi_slopes": [0.5, 0.25]},
    "attention sinks": {"sinks": torch.zeros(2)},
    "logit softcapping": {"logits_soft_cap": 30.0},
}


@pytest.mark.parametrize("feature", FEATURES)
def test_each_unsupported_feature_is_named_with_its_layer(layer_config, feature):
    plain = attention_layer(layer_config, f"plain.{feature}")
    odd = attention_layer(layer_config, f"model.layers.1.{feature}", **FEATURES[feature])
    support.check_attention_layers({"a": plain})  # a plain decoder layer passes
    with pytest.raises(ValueError, match=rf"cannot run this model: {feature} in layer 'model.layers.1.{feature}'\."):
        support.check_attention_layers({"a": plain, f"model.layers.1.{feature}": odd})


def test_other_layer_types_and_quantised_kv_are_refused(layer_config):
    enc = attention_layer(layer_config, "enc", cls=EncoderOnlyAttention)
    fp8 = attention_layer(layer_config, "fp8")
    fp8.kv_cache_dtype = "fp8_e4m3"  # what an fp8 KV cache gives the layer (vLLM's CPU impl cannot be built with it)
    with pytest.raises(ValueError) as err:
        support.check_attention_layers({"enc": enc, "fp8": fp8, "moe": torch.nn.Linear(2, 2)})
    msg = str(err.value)
    assert "layer type EncoderOnlyAttention in layer 'enc'" in msg
    assert "quantised KV cache (kv_cache_dtype=fp8_e4m3) in layer 'fp8'" in msg
    assert "moe" not in msg  # not an attention layer (fused MoE layers share the static forward context)


# ----------------------------------------------------------------------------------------------------------------
# engine settings, at config build
# ----------------------------------------------------------------------------------------------------------------
def test_engine_logits_processors_stop_the_engine(pair):
    target, draft = pair
    with pytest.raises(ValueError, match=r"does not apply engine-level logits processors \(logits_processors / "
                                         r"--logits-processors: \['" + MIN_P + r"'\]\)"):
        vllm.LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=256, logits_processors=[MIN_P],
                 speculative_config={"method": "dsbd", "model": draft, "num_speculative_tokens": 2})
    plain = engine_args(pair, dsbd=False, logits_processors=[MIN_P]).create_engine_config()
    assert plain.model_config.logits_processors == [MIN_P]  # non-DSBD: vLLM's business


def test_thinking_budget_reasoning_config_stops_the_engine(pair):
    think = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
    with pytest.raises(ValueError, match=r"does not apply thinking-token budgets: reasoning_config / "
                                         r"--reasoning-config"):
        engine_args(pair, reasoning_config=ReasoningConfig(**think)).create_engine_config()
    plain = engine_args(pair, dsbd=False, reasoning_config=ReasoningConfig(**think)).create_engine_config()
    assert plain.reasoning_config is not None and plain.reasoning_config.enabled


def test_mrope_model_stops_the_engine_at_config_build(pair, tmp_path):
    """A target whose rotary positions are multimodal (``mrope_section`` in its rope parameters, as Qwen2-VL's) is
    refused when the config is built: vLLM would feed it ``mrope_positions``, DSBD sets only ``positions``."""
    folder = tmp_path / "mrope"
    folder.mkdir()
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(f"{pair[0]}/{f}", folder / f)
    cfg = json.loads(open(f"{pair[0]}/config.json").read())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    section = [head_dim // 2 - 2 * (head_dim // 8), head_dim // 8, head_dim // 8]  # sums to head_dim / 2
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0),
                              "mrope_section": section}
    (folder / "config.json").write_text(json.dumps(cfg))
    target = str(folder)
    plain = engine_args((target, pair[1]), dsbd=False).create_engine_config()
    assert plain.model_config.uses_mrope  # vLLM reads this config as an M-RoPE model
    with pytest.raises(ValueError, match=r"cannot run this model: it uses multimodal rotary positions \(M-RoPE"):
        engine_args((target, pair[1])).create_engine_config()


def test_reasoning_parser_config_is_left_to_the_request_check(pair):
    """``--reasoning-parser`` alone makes a reasoning config (``EngineArgs._set_default_reasoning_config_args``) that
    also serves the front end: kept; a request that sets ``thinking_token_budget`` is refused on its own."""
    config = engine_args(pair).create_engine_config()
    config.reasoning_config = parser_only = ReasoningConfig(reasoning_parser="deepseek_r1")
    support.check_engine_config(config)
    assert config.reasoning_config is parser_only


@pytest.mark.parametrize("name,value,match", [
    ("VLLM_DSBD_STATIC_VERIFY", "sometimes", "VLLM_DSBD_STATIC_VERIFY must be auto, 1 or 0, got 'sometimes'"),
    ("VLLM_DSBD_FUSED_VERIFY", "maybe", "VLLM_DSBD_FUSED_VERIFY must be auto or 0, got 'maybe'"),
    ("VLLM_DSBD_STATIC_DRAFT", "auto", "VLLM_DSBD_STATIC_DRAFT must be 1 or 0, got 'auto'"),
    ("VLLM_DSBD_KV_COMMIT", "triton", "VLLM_DSBD_KV_COMMIT must be auto or torch, got 'triton'"),
    ("VLLM_DSBD_PROFILE_STEP", "later", "VLLM_DSBD_PROFILE_STEP must be 1 or 0, got 'later'")])
def test_bad_verify_setting_stops_the_engine_at_start_up(pair, monkeypatch, name, value, match):
    """``VLLM_DSBD_STATIC_VERIFY``, ``VLLM_DSBD_FUSED_VERIFY``, ``VLLM_DSBD_STATIC_DRAFT``, ``VLLM_DSBD_KV_COMMIT`` and
    ``VLLM_DSBD_PROFILE_STEP`` are read when the runner is built (on the CPU too): a bad value stops the engine there, naming the variable."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    monkeypatch.setenv(name, value)
    try:
        with pytest.raises(ValueError, match=match):
            vllm.LLM(model=pair[0], dtype="float32", enforce_eager=True, max_model_len=256,
                     enable_prefix_caching=False,
                     speculative_config={"method": "dsbd", "model": pair[1], "num_speculative_tokens": 2})
    finally:
        cleanup_dist_env_and_memory()
