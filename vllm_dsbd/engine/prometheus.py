"""DSBD's Prometheus collectors and how their values cross processes (the counting is ``metrics.py``).

An in-process engine registers in its process's default registry. With the engine core in a child process, the front end
(:func:`setup_frontend`) exports a multiprocess directory (``VLLM_DSBD_PROMETHEUS_DIR`` / ``_PID``) and serves a
``MultiProcessCollector`` over it; the engine creates its collectors memory-mapped there. Not covered:
``--api-server-count > 1``, a rank-0 Ray worker on another machine. The route step by step: docs/design/startup.md §3.7.
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading

from vllm_dsbd import envs

_LOCK = threading.Lock()
_OWNER = None  # the engine whose collectors are registered in this process


# plumbing between the plugin's processes (written and read here, at the moments below; listed in vllm_dsbd/envs.py)
PROMETHEUS_DIR_ENV = envs.PROMETHEUS_DIR
PROMETHEUS_PID_ENV = envs.PROMETHEUS_PID
_FRONTEND_DIR: tempfile.TemporaryDirectory | None = None


def setup_frontend() -> None:
    """In the first process that registers the plugin (the front end): a directory for the DSBD metrics of engines in
    child processes, exported to them, and a collector over it in this process's default registry. Idempotent."""
    global _FRONTEND_DIR
    import multiprocessing

    if _FRONTEND_DIR is not None:
        return
    if os.environ.get(PROMETHEUS_DIR_ENV) and (multiprocessing.parent_process() is not None or _in_ray_actor()):
        # a multiprocessing child of a front end (an engine core, an ``mp`` worker) or a Ray actor it started (a Ray
        # executor's worker, which gets the front end's environment): it writes to the front end's directory
        return
    # a program of its own (even one started by another front end, e.g. a benchmark run from a test): its own
    # directory, replacing any inherited one
    try:
        from prometheus_client import REGISTRY
        from prometheus_client.multiprocess import MultiProcessCollector
    except ImportError:  # pragma: no cover - vLLM depends on prometheus_client
        return
    _FRONTEND_DIR = tempfile.TemporaryDirectory(prefix="vllm-dsbd-metrics-")
    os.environ[PROMETHEUS_DIR_ENV] = _FRONTEND_DIR.name
    os.environ[PROMETHEUS_PID_ENV] = str(os.getpid())
    MultiProcessCollector(REGISTRY, path=_FRONTEND_DIR.name)


def _in_ray_actor() -> bool:
    """Whether this process runs a Ray actor (vLLM's Ray executor makes one per worker). Ray's worker processes are
    not ``multiprocessing`` children; Ray is only looked at when this process has imported it."""
    ray = sys.modules.get("ray")
    try:
        return ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - a partly imported or shut-down Ray: not an actor we can tell of
        return False


def _child_dir() -> str | None:
    """The front end's metrics directory when this process is not the front end (an engine core child)."""
    d, pid = os.environ.get(PROMETHEUS_DIR_ENV), os.environ.get(PROMETHEUS_PID_ENV)
    return d if d and pid and pid != str(os.getpid()) and os.path.isdir(d) else None


def _collectors(mmap_dir: str | None = None, depth: int = 0) -> dict | None:
    """The DSBD collectors (not registered). ``mmap_dir``: memory-mapped values in that directory (multiprocess mode
    only while these are built), with the per-layer width children of layers 1..depth made up front (a child made later
    would not be memory-mapped)."""
    try:
        from prometheus_client import values
    except ImportError:  # pragma: no cover - vLLM depends on prometheus_client
        return None
    if mmap_dir is None:
        return _build_collectors()
    old_cls, old_env = values.ValueClass, os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    values.ValueClass = values.MultiProcessValue()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = mmap_dir
    try:
        out = _build_collectors()
        for d in range(1, depth + 1):
            out["width"].labels(layer=str(d))
        return out
    finally:
        values.ValueClass = old_cls
        if old_env is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = old_env


def _build_collectors() -> dict:
    from prometheus_client import Counter as PCounter, Histogram

    kw = {"registry": None}
    return {
        "iterations": PCounter("vllm:dsbd_iterations", "DSBD iterations that verified a forest", **kw),
        "layers": Histogram("vllm:dsbd_layers_passed", "DSBD layers passed per iteration",
                            buckets=[float(b) for b in range(0, 65)], **kw),
        "width": Histogram("vllm:dsbd_layer_width", "DSBD width of a verified draft layer", ["layer"],
                           buckets=[float(b) for b in range(1, 65)], **kw),
        "passes": PCounter("vllm:dsbd_target_passes", "target passes that emitted tokens for a request (beam "
                           "requests: vllm:dsbd_beam_target_passes)", **kw),
        "tokens": PCounter("vllm:dsbd_emitted_tokens", "tokens emitted by DSBD iterations", **kw),
        "moves": PCounter("vllm:dsbd_kv_commit_slots", "KV slots moved by DSBD commits", **kw),
        "nodes": PCounter("vllm:dsbd_draft_nodes", "draft forest nodes verified by the target", **kw),
        "draft_depth": Histogram("vllm:dsbd_draft_depth", "DSBD draft depth per request per step: chosen by "
                                 "the cost model, or allowed by the verify budget", buckets=[float(b) for b in range(0, 65)], **kw),
        "beam_nodes_chosen": Histogram("vllm:dsbd_beam_draft_nodes_chosen", "DSBD draft nodes per depth (N) of a "
                                       "T = 0 beam request's forest per step, chosen by the cost model",
                                       buckets=[float(b) for b in range(1, 65)] + [96.0, 128.0, 256.0], **kw),
        "beam_passes": PCounter("vllm:dsbd_beam_target_passes", "target passes over beam requests", **kw),
        "beam_steps": PCounter("vllm:dsbd_beam_steps", "beam steps (one token on every live beam)", **kw),
        "beam_requests": PCounter("vllm:dsbd_beam_requests", "beam requests finished", **kw),
        "beam_nodes": PCounter("vllm:dsbd_beam_draft_nodes", "draft forest nodes verified on beam requests", **kw),
        "beam_layers": PCounter("vllm:dsbd_beam_layers_passed",
                                "forest layers whose target beams were all draft nodes (beam requests)", **kw),
        "beam_pass_layers": Histogram("vllm:dsbd_beam_pass_layers", "forest layers passed per target pass over a "
                                      "beam request that verified a forest", buckets=[float(b) for b in range(0, 65)],
                                      **kw),
        "beam_dropped": PCounter("vllm:dsbd_beam_relayout_slots",
                                 "dead trie slots dropped by re-layouts of beam requests", **kw),
        "beam_blocks": Histogram("vllm:dsbd_beam_kv_blocks", "KV blocks held by a beam request when it finished",
                                 buckets=[float(2 ** b) for b in range(0, 14)], **kw),
    }


def collectors_for(stats) -> dict | None:
    """The collectors of one engine's :class:`~vllm_dsbd.engine.metrics.DSBDStats`, created on first use (vLLM
    unregisters every ``vllm:`` collector when it builds its stat logger, after the runner exists); a newer engine in
    the same process takes the names over."""
    global _OWNER
    from prometheus_client import REGISTRY

    if not stats.use_prometheus:
        return None
    with _LOCK:
        if stats.prom is None and (child_dir := _child_dir()) is not None:
            # engine core in a child of the front end: values go to the front end's directory, no registry here
            stats.prom = _collectors(child_dir, stats.cfg.depth)
            stats.prom_mmap = True
        if stats.prom_mmap:
            return stats.prom
        if stats.prom is None:
            stats.prom = _collectors()
            if stats.prom is None:
                return None
            if _OWNER is not None and _OWNER is not stats and _OWNER.prom is not None:
                for c in _OWNER.prom.values():
                    if c in REGISTRY._collector_to_names:
                        REGISTRY.unregister(c)
            _OWNER = stats
        if _OWNER is stats:
            for c in stats.prom.values():
                if c not in REGISTRY._collector_to_names:
                    try:
                        REGISTRY.register(c)
                    except ValueError:  # the name is taken by a collector we do not own: leave it
                        pass
        return stats.prom
