"""A DSBD OpenAI server started from a benchmark or a test (the soak of ``benchmarks/engine/soak.py``, the serve
tests): its environment and a free loopback port."""
from __future__ import annotations

import os
import socket


def server_env(multiprocessing: bool = True) -> dict[str, str]:
    """The environment of a DSBD server started by the soak or a serve test. ``multiprocessing``: the engine core
    in a child process, as `vllm serve` runs by default (False: in the server's process, faster to start)."""
    env = dict(os.environ)
    for key in ("VLLM_DSBD_PROMETHEUS_DIR", "VLLM_DSBD_PROMETHEUS_PID"):  # the server is its own front end
        env.pop(key, None)
    # One torch thread and no OpenMP binding: on a few shared CPU cores OpenMP spin-waits make generation far slower
    # otherwise.
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind",
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               PYTHONUNBUFFERED="1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
