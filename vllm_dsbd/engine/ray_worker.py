"""vLLM's Ray worker actor on the CPU platform (patch ``cpu_ray_executor``): it answers (node id, no ids) where
``RayExecutorV2`` asks for accelerator ids, which Ray has none of under "CPU" (a KeyError). It lives in an importable
module because Ray pickles the actor class by reference, before any plugin is loaded in the actor.
"""
from __future__ import annotations

from vllm.v1.executor.ray_executor_v2 import RayWorkerProc, ray


class CPURayWorkerProc(RayWorkerProc):
    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        return ray.get_runtime_context().get_node_id(), []
