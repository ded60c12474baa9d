"""Patch: a "dsbd" engine's workers are the DSBD workers (``vllm_dsbd.engine.worker``), which build the DSBD runner.

vLLM 0.26 has no hook to choose the model runner, but ``parallel_config.worker_cls`` chooses the worker class, and
the platform fills in its own worker when it is "auto" (``CpuPlatform``/``CudaPlatform.check_and_update_config``,
run while ``VllmConfig`` is built). The wrapper of ``EngineArgs.create_engine_config`` (``LLM``, ``vllm serve`` and
``AsyncEngineArgs`` all build their config there) replaces, for "dsbd" configs only, the worker the platform picked by
its DSBD subclass; any other worker class (a user's ``--worker-cls``) is refused for "dsbd".
"""

from __future__ import annotations

import types

from vllm_dsbd.config import uses_dsbd
from vllm_dsbd.patches._patching import when_imported, wrap_method

PATCH_ID = "dsbd_worker"
MODULE = "vllm.engine.arg_utils"


def apply() -> None:
    when_imported(MODULE, _patch)


def _patch(mod: types.ModuleType) -> None:
    def make(orig):
        def create_engine_config(self, *args, **kwargs):
            config = orig(self, *args, **kwargs)
            if uses_dsbd(config):
                from vllm_dsbd.engine.worker import dsbd_worker_cls

                config.parallel_config.worker_cls = dsbd_worker_cls(config.parallel_config.worker_cls)
            return config

        return create_engine_config

    wrap_method(PATCH_ID, mod.EngineArgs, "create_engine_config", make)
