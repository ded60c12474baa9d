"""Patch: vLLM knows DSBD's environment variables, so it does not warn about them in every process.

``vllm.envs.validate_environ`` (envs.py:2090) warns "Unknown vLLM environment variable detected" for every variable
that starts with ``VLLM_`` and is not a key of ``vllm.envs.environment_variables`` (or raises, with
``VLLM_ENGINE_ENVIRONMENT_HARD_FAIL``-style strict checking). DSBD's variables start with ``VLLM_DSBD_``; the plugin
itself exports ``VLLM_DSBD_PROMETHEUS_DIR`` / ``_PID`` to every engine process (``engine/metrics.py``), so without
this patch every DSBD server logged two such warnings per process.

How: add each name to ``environment_variables`` with a getter that reads it, as vLLM's own entries do. Nothing else
reads these entries. When it can go: vLLM lets plugins declare environment variables (or stops warning about
``VLLM_*`` names it does not own), or DSBD renames its variables without the ``VLLM_`` prefix.
"""

from __future__ import annotations

import os

from vllm_dsbd.patches._patching import set_item

PATCH_ID = "env_names"

NAMES = (
    "VLLM_DSBD_DISABLE",  # plugin.py: skip registration
    "VLLM_DSBD_CACHE",  # models.py: where models and drafts are built
    "VLLM_DSBD_FOREST_ATTENTION",  # engine/attention.py: "kernel" or "ref"
    "VLLM_DSBD_BEAM_RELAYOUT",  # engine/state.py: "0" keeps beam requests' dead trie slots (no re-layout)
    "VLLM_DSBD_STATIC_VERIFY",  # engine/sampler.py: "auto", "1" or "0": which verification paths a step takes
    "VLLM_DSBD_FUSED_VERIFY",  # engine/fused.py: "auto" or "0": the fused verification kernel on CUDA
    "VLLM_DSBD_STATIC_DRAFT",  # engine/drafter.py: "1" or "0": the draft loops with one host read per call
    "VLLM_DSBD_PROMETHEUS_DIR",  # engine/metrics.py: multiprocess metrics directory (set by the plugin)
    "VLLM_DSBD_PROMETHEUS_PID",  # engine/metrics.py: the front end's pid (set by the plugin)
)


def apply() -> None:
    import vllm.envs as envs

    for name in NAMES:
        set_item(PATCH_ID, envs.environment_variables, name, lambda name=name: os.environ.get(name),
                 where="vllm.envs.environment_variables")
