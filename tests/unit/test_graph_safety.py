"""No CUDA graph may replay over forest attention (ledger patch 11, ``vllm_dsbd/engine/graphs.py``), checked on CPU.

On a GPU, vLLM 0.26 resolves ``cudagraph_mode`` to FULL_AND_PIECEWISE by default: a full graph, attention included,
replays every uniform decode batch, which is every DSBD decode batch, and skips the forest recompute that runs in
Python inside the attention layers. The CPU platform resolves every mode to NONE, so the config-path tests let it
answer ``support_static_graph_mode()`` as GPU platforms do (the only change: vLLM then keeps the GPU defaults and
explicit FULL modes, as the draft_model controls show). No engine is started.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import types

import pytest

import vllm  # noqa: F401  (a broken vLLM fails the suite)

from vllm_dsbd import plugin
from vllm_dsbd.testing import models

plugin.register()

from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

from vllm_dsbd.engine import graphs  # noqa: E402

FULL_MODES = [CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE]


@pytest.fixture(scope="module")
def pair() -> tuple[str, str]:
    target, draft = models.tiny_llama_pair()
    return str(target), str(draft)


@pytest.fixture
def gpu_like(monkeypatch):
    """The CPU platform answers ``support_static_graph_mode()`` as CUDA does, so vLLM keeps graph modes."""
    monkeypatch.setattr(type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True))


@pytest.fixture
def graph_log():
    """INFO records of the DSBD engine logger (vLLM's loggers do not propagate to pytest's handler)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    log = logging.getLogger("vllm.vllm_dsbd.engine")
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield records
    log.removeHandler(handler)
    log.setLevel(old_level)


def build(pair, method=None, mode: CUDAGraphMode | None = None, full: bool | None = None):
    target, draft = pair
    spec = None if method is None else {"method": method, "model": draft, "num_speculative_tokens": 2}
    if full is not None:
        spec["full_cuda_graphs"] = full
    cc = {} if mode is None else {"cudagraph_mode": mode.name}
    return EngineArgs(model=target, dtype="float32", max_model_len=256, speculative_config=spec,
                      compilation_config=cc).create_engine_config()


def gpu_resolved(config, mode: CUDAGraphMode, split_attention: bool):
    """``config`` with its compilation config as vLLM resolves it on a GPU (VLLM_COMPILE; graphs split at the
    attention ops, vLLM's default, or not split at all, e.g. ``splitting_ops=[]`` or sequence parallelism)."""
    cc = config.compilation_config
    cc.mode = CompilationMode.VLLM_COMPILE
    cc.splitting_ops = list(CompilationConfig._attention_ops) if split_attention else []
    cc.cudagraph_mode = mode
    return config


# ----------------------------------------------------------------------------------------------------------------
# through the real config path (EngineArgs.create_engine_config -> VllmConfig.__post_init__)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("gpu_like")
@pytest.mark.parametrize("mode", [None, *FULL_MODES], ids=lambda m: "default" if m is None else m.name)
def test_dsbd_engine_never_resolves_to_a_full_graph(pair, mode, graph_log):
    control = build(pair, "draft_model", mode)  # vLLM's own resolution, left alone: a full-graph mode
    expected = mode or CUDAGraphMode.FULL_AND_PIECEWISE  # the GPU default (optimization level 2)
    assert control.compilation_config.cudagraph_mode == expected and expected.has_full_cudagraphs()
    assert build(pair, None, mode).compilation_config.cudagraph_mode == expected

    config = build(pair, "dsbd", mode)
    resolved = config.compilation_config.cudagraph_mode
    assert not resolved.has_full_cudagraphs()
    # the CPU platform compiles without splitting at attention: no graph may be kept at all
    assert not config.compilation_config.is_attention_compiled_piecewise()
    assert resolved == CUDAGraphMode.NONE
    graphs.check(config)  # what the DSBD worker checks before building its runner
    forced = [r.getMessage() for r in graph_log if "cudagraph_mode" in r.getMessage()]
    assert forced and forced[-1].startswith(f"DSBD: cudagraph_mode {expected.name} -> NONE"), forced


@pytest.mark.usefixtures("gpu_like")
@pytest.mark.parametrize("mode", FULL_MODES, ids=lambda m: m.name)
def test_a_directly_built_vllm_config_is_enforced_too(pair, mode):
    """A ``VllmConfig`` built without ``EngineArgs`` (here a ``dataclasses.replace`` copy with a new compilation
    config: ``__post_init__`` runs again) gets the same enforcement; a non-DSBD copy keeps its full-graph mode."""
    dsbd, plain = build(pair, "dsbd"), build(pair, "draft_model")
    copy = dataclasses.replace(dsbd, compilation_config=CompilationConfig(cudagraph_mode=mode))
    assert copy.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    other = dataclasses.replace(plain, compilation_config=CompilationConfig(cudagraph_mode=mode))
    assert other.compilation_config.cudagraph_mode == mode


# ----------------------------------------------------------------------------------------------------------------
# directly on configs resolved as on a GPU
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [*FULL_MODES, CUDAGraphMode.PIECEWISE], ids=lambda m: m.name)
def test_graph_modes_with_attention_split_out_become_piecewise(pair, mode):
    config = gpu_resolved(build(pair, "dsbd"), mode, split_attention=True)
    assert config.compilation_config.is_attention_compiled_piecewise()
    with pytest.raises(RuntimeError, match=f"cudagraph_mode {mode.name} would replay") if mode.has_full_cudagraphs() \
            else contextlib.nullcontext():
        graphs.check(config)
    changed = graphs.enforce(config)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert changed == ((mode, CUDAGraphMode.PIECEWISE) if mode != CUDAGraphMode.PIECEWISE else None)
    graphs.check(config)


@pytest.mark.parametrize("mode", [*FULL_MODES, CUDAGraphMode.PIECEWISE], ids=lambda m: m.name)
def test_graph_modes_with_attention_inside_the_graph_become_none(pair, mode):
    config = gpu_resolved(build(pair, "dsbd"), mode, split_attention=False)
    with pytest.raises(RuntimeError, match=f"cudagraph_mode {mode.name} would replay"):
        graphs.check(config)
    assert graphs.enforce(config) == (mode, CUDAGraphMode.NONE)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    graphs.check(config)


@pytest.mark.parametrize("mode", FULL_MODES, ids=lambda m: m.name)
def test_non_dsbd_configs_are_left_alone(pair, mode):
    config = gpu_resolved(build(pair, "draft_model"), mode, split_attention=True)
    assert graphs.enforce(config) is None
    assert config.compilation_config.cudagraph_mode == mode


@pytest.mark.parametrize("mode", FULL_MODES, ids=lambda m: m.name)
def test_dsbd_worker_refuses_a_full_graph_config_before_building_its_runner(pair, mode):
    """A config changed after it was built (so the patch never saw the full mode) stops the DSBD worker's
    ``init_device`` before vLLM's, i.e. before any model, runner or graph exists."""
    from vllm_dsbd.engine.worker import DSBDCPUWorker

    config = gpu_resolved(build(pair, "dsbd"), mode, split_attention=True)
    worker = types.SimpleNamespace(vllm_config=config, use_v2_model_runner=False)
    with pytest.raises(RuntimeError, match=f"cudagraph_mode {mode.name} would replay CUDA graphs over forest"):
        DSBDCPUWorker.init_device(worker)


# ----------------------------------------------------------------------------------------------------------------
# full_cuda_graphs: full graphs kept for passes without forest attention (the runner excludes FULL from the others)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("gpu_like")
@pytest.mark.parametrize("mode", [None, *FULL_MODES], ids=lambda m: "default" if m is None else m.name)
def test_full_cuda_graphs_keep_full_graphs_through_the_config_path(pair, mode):
    """On the CPU platform's compile (attention not split out), the full modes stay except FULL_AND_PIECEWISE, whose
    piecewise graphs would contain attention: it becomes FULL_DECODE_ONLY (its other passes run eagerly)."""
    config = build(pair, "dsbd", mode, full=True)
    expected = mode or CUDAGraphMode.FULL_AND_PIECEWISE
    if expected == CUDAGraphMode.FULL_AND_PIECEWISE:
        expected = CUDAGraphMode.FULL_DECODE_ONLY
    assert config.compilation_config.cudagraph_mode == expected
    assert config.additional_config["dsbd"]["full_cuda_graphs"] is True
    graphs.check(config)
    off = build(pair, "dsbd", mode, full=False)  # the default, spelled out
    assert off.compilation_config.cudagraph_mode == CUDAGraphMode.NONE


@pytest.mark.parametrize("mode", [*FULL_MODES, CUDAGraphMode.PIECEWISE], ids=lambda m: m.name)
def test_full_cuda_graphs_with_attention_split_out_keep_every_mode(pair, mode):
    config = gpu_resolved(build(pair, "dsbd", full=True), mode, split_attention=True)
    assert graphs.enforce(config) is None
    assert config.compilation_config.cudagraph_mode == mode
    graphs.check(config)


@pytest.mark.parametrize("mode,expected", [(CUDAGraphMode.FULL, CUDAGraphMode.FULL),
                                           (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_DECODE_ONLY),
                                           (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY),
                                           (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE)], ids=lambda m: m.name)
def test_full_cuda_graphs_with_attention_inside_the_pieces(pair, mode, expected):
    config = gpu_resolved(build(pair, "dsbd", full=True), mode, split_attention=False)
    if expected != mode:
        with pytest.raises(RuntimeError, match=f"cudagraph_mode {mode.name} would replay"):
            graphs.check(config)
    assert graphs.enforce(config) == (None if expected == mode else (mode, expected))
    assert config.compilation_config.cudagraph_mode == expected
    graphs.check(config)


def test_full_cuda_graphs_must_be_a_bool(pair):
    with pytest.raises(ValueError, match="'full_cuda_graphs' must be true or false"):
        build(pair, "dsbd", full="yes")
