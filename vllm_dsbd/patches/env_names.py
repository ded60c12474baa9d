"""Patch: vLLM knows DSBD's environment variables, so it does not warn about them in every process.

``vllm.envs.validate_environ`` (envs.py:2090) warns "Unknown vLLM environment variable detected" for every variable
that starts with ``VLLM_`` and is not a key of ``vllm.envs.environment_variables`` (or raises, with
``VLLM_ENGINE_ENVIRONMENT_HARD_FAIL``-style strict checking). DSBD's variables start with ``VLLM_DSBD_``; the plugin
itself exports ``VLLM_DSBD_PROMETHEUS_DIR`` / ``_PID`` to every engine process (``engine/prometheus.py``), so without
this patch every DSBD server logged two such warnings per process.

How: add each name to ``environment_variables`` with a getter that reads it, as vLLM's own entries do. Nothing else
reads these entries. When it can go: vLLM lets plugins declare environment variables (or stops warning about
``VLLM_*`` names it does not own), or DSBD renames its variables without the ``VLLM_`` prefix.
"""

from __future__ import annotations

import os

from vllm_dsbd import envs
from vllm_dsbd.patches._patching import set_item

PATCH_ID = "env_names"

NAMES = envs.NAMES  # every DSBD variable, with its meaning: vllm_dsbd/envs.py


def apply() -> None:
    import vllm.envs as vllm_envs

    for name in NAMES:
        set_item(PATCH_ID, vllm_envs.environment_variables, name, lambda name=name: os.environ.get(name),
                 where="vllm.envs.environment_variables")
