"""Patch: vLLM's Ray executor (``RayExecutorV2``, ``--distributed-executor-backend ray``) runs on the CPU platform.

vLLM 0.26's ``CpuPlatform`` has no ``ray_device_key`` (the empty string means "no Ray"), so the Ray executor stops
in ``initialize_ray_cluster`` with "current platform cpu does not support ray" (vllm-project/vllm#21602; the fix
proposed upstream, #25386, was closed unmerged). Setting the key to "CPU" alone is not enough:

* the placement group then has one ``{"CPU": 1}`` bundle per rank (ray_utils.py:637-639), which is what we want;
* ``RayExecutorV2._get_actor_resource_kwargs`` (ray_executor_v2.py:254-261) asks for ``resources={"CPU": 1}`` for
  every key other than "GPU", and Ray refuses "CPU" there (ValueError "Use the 'num_cpus' and 'num_gpus' keyword
  instead of 'CPU' and 'GPU' in 'resources' keyword"); the actor is created
  with ``num_cpus=0`` inside its bundle, so it needs no resource of its own (the bundle holds the rank's CPU), and
* each actor's ``get_node_and_physical_gpu_ids`` reads ``get_accelerator_ids()["CPU"]`` (no such accelerator).

How: ``CpuPlatform.ray_device_key = "CPU"``; on the CPU platform only, ``_get_actor_resource_kwargs`` returns
``{"num_gpus": 0}`` and ``ray_executor_v2.RayWorkerProc`` (the class ``_init_executor`` makes actors of) is
``vllm_dsbd.engine.ray_worker.CPURayWorkerProc``, which reports no accelerator ids. GPU platforms are untouched.
"""

from __future__ import annotations

import types

from vllm_dsbd.patches._patching import set_attr, when_imported, wrap_method

PATCH_ID = "cpu_ray_executor"
PLATFORM_MODULE = "vllm.platforms.cpu"
EXECUTOR_MODULE = "vllm.v1.executor.ray_executor_v2"


def apply() -> None:
    when_imported(PLATFORM_MODULE, _patch_platform)
    when_imported(EXECUTOR_MODULE, _patch_executor)


def _patch_platform(mod: types.ModuleType) -> None:
    if mod.CpuPlatform.__dict__.get("ray_device_key"):  # vLLM gained its own key: leave it
        return
    set_attr(PATCH_ID, mod.CpuPlatform, "ray_device_key", "CPU")


def _patch_executor(mod: types.ModuleType) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm_dsbd.engine.ray_worker import CPURayWorkerProc

    def make(orig):
        def _get_actor_resource_kwargs():
            if current_platform.ray_device_key == "CPU":
                return {"num_gpus": 0}  # the rank's CPU is its placement-group bundle; the actor has num_cpus=0
            return orig()

        return _get_actor_resource_kwargs

    wrap_method(PATCH_ID, mod.RayExecutorV2, "_get_actor_resource_kwargs", make)
    set_attr(PATCH_ID, mod, "RayWorkerProc", CPURayWorkerProc)
