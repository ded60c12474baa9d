"""Offline ``vllm.LLM`` engines in benchmarks: shut one down so that the next one of the same process starts clean."""
from __future__ import annotations

import gc


def shutdown(llm, cleanup=None) -> None:
    """Stops ``llm``'s engine core and frees vLLM's distributed state. ``cleanup``: vLLM's
    ``cleanup_dist_env_and_memory``, imported here when not given (a caller on an error path passes the one it
    imported beforehand)."""
    if cleanup is None:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory as cleanup
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup()
