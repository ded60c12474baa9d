"""vLLM's Ray worker actor on the CPU platform (used by the ``cpu_ray_executor`` patch).

``RayExecutorV2`` asks each ``RayWorkerProc`` actor for the accelerator ids Ray gave it
(``get_accelerator_ids()[ray_device_key]``) and then hands every worker the sorted ids of its node. A CPU worker
holds no accelerator: Ray reports none under "CPU" (a KeyError) and the CPU worker never reads the ids. This subclass
answers (node id, no ids). It lives in an importable module because Ray pickles the actor class by reference: the
actor process imports it from here before any plugin is loaded there.
"""
from __future__ import annotations

from vllm.v1.executor.ray_executor_v2 import RayWorkerProc, ray


class CPURayWorkerProc(RayWorkerProc):
    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        return ray.get_runtime_context().get_node_id(), []
