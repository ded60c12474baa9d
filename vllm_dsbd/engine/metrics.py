"""DSBD statistics: layers passed per iteration and the width of each verified layer, logged and in Prometheus.

Per engine (worker) process, :class:`DSBDStats` counts what the verification sampler did and logs a summary line
(``DSBD: ...``) at most every ``log_interval_s`` seconds, and updates these Prometheus metrics (``prometheus_client``,
default registry of the process that runs the model runner):

* ``vllm:dsbd_iterations_total``: iterations that verified a forest (one per request per engine step);
* ``vllm:dsbd_layers_passed``: histogram of layers passed per iteration (buckets 0..depth); tokens gained per
  iteration = layers passed + 1;
* ``vllm:dsbd_layer_width{layer="d"}``: histogram of the width K of verified draft layer d (1-based; beam requests
  at T > 0 count theirs too);
* ``vllm:dsbd_target_passes_total``: target passes that emitted tokens for a request that is not a beam request (one
  per request per engine step, its prefill's last chunk included, forest or not): target passes per token =
  ``target_passes / emitted_tokens``, counted by the engine;
* ``vllm:dsbd_emitted_tokens_total``: tokens emitted by DSBD iterations (forest or not);
* ``vllm:dsbd_kv_commit_slots_total``: KV slots moved by commits (accepted paths that were not already in place);
* ``vllm:dsbd_draft_nodes_total``: draft forest nodes verified by the target;
* ``vllm:dsbd_draft_depth``: histogram of the draft depth load-aware speculation (``load.py``) allowed each decoding
  request in each step (buckets 0..64; the configured depth when pinned; beam requests that pin their own depth are
  not counted). A request's actual forest can be shallower (its last tokens, EOS).

How they reach ``LLM.get_metrics()`` and ``/metrics``:

* in-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): collectors in the default registry of that process;
* engine core in a child process (the default of ``vllm serve`` and ``LLM``): the plugin's ``register()`` in the
  first (front-end) process calls :func:`setup_frontend`, which makes a temporary directory, exports it to the
  processes it starts (``VLLM_DSBD_PROMETHEUS_DIR``, with its own pid in ``VLLM_DSBD_PROMETHEUS_PID``; a program
  started as a separate program, not by ``multiprocessing`` nor as a Ray actor, makes its own) and registers a
  ``prometheus_client`` ``MultiProcessCollector`` over it in its default registry; an engine in another process then
  creates its collectors with memory-mapped values in that directory (prometheus_client's multiprocess mode, for
  these collectors only), and the front end serves them with its own metrics. vLLM's Ray executor passes the front
  end's environment to its worker actors, so a rank-0 worker on the front end's machine writes there too. Not
  covered: ``--api-server-count > 1`` (vLLM then serves only its own multiprocess directory), and a rank-0 Ray worker
  on another machine (the directory is local; its counters stay in that worker's process).
vLLM's own spec-decode metrics describe a DSBD engine as follows (patches ``spec_stats_depths`` and
``spec_stats_prometheus``): ``vllm:spec_decode_num_drafts`` = forests verified (= ``vllm:dsbd_iterations``),
``..._num_draft_tokens`` = forest nodes verified (= ``vllm:dsbd_draft_nodes``), ``..._num_accepted_tokens`` = layers
passed (= the sum of ``vllm:dsbd_layers_passed``), ``..._num_accepted_tokens_per_pos{position="p"}`` = iterations
that passed depth p + 1 (one series per depth). vLLM's "draft acceptance rate" is accepted / drafted: for a forest
with W nodes per depth it is at most 1/W by construction; the number to read is the mean acceptance length (tokens
per target pass).
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import tempfile
import threading
import time
from collections import Counter

from vllm_dsbd.config import DSBDConfig

logger = logging.getLogger("vllm.vllm_dsbd.engine")

_LOCK = threading.Lock()
_OWNER: "DSBDStats | None" = None  # the engine whose collectors are registered in this process


PROMETHEUS_DIR_ENV = "VLLM_DSBD_PROMETHEUS_DIR"
PROMETHEUS_PID_ENV = "VLLM_DSBD_PROMETHEUS_PID"
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
    """The DSBD collectors (not registered). ``mmap_dir``: create them with memory-mapped values in that directory
    (prometheus_client's multiprocess mode, switched on only while these are built), with the per-layer width
    children of layers 1..depth made up front (a child made later would not be memory-mapped)."""
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
        "draft_depth": Histogram("vllm:dsbd_draft_depth", "DSBD draft depth allowed per request per step by "
                                 "load-aware speculation", buckets=[float(b) for b in range(0, 65)], **kw),
        "beam_passes": PCounter("vllm:dsbd_beam_target_passes", "target passes over beam requests", **kw),
        "beam_steps": PCounter("vllm:dsbd_beam_steps", "beam steps (one token on every live beam)", **kw),
        "beam_requests": PCounter("vllm:dsbd_beam_requests", "beam requests finished", **kw),
        "beam_nodes": PCounter("vllm:dsbd_beam_draft_nodes", "draft forest nodes verified on beam requests", **kw),
        "beam_layers": PCounter("vllm:dsbd_beam_layers_passed",
                                "forest layers whose target beams were all draft nodes (beam requests)", **kw),
        "beam_dropped": PCounter("vllm:dsbd_beam_relayout_slots",
                                 "dead trie slots dropped by re-layouts of beam requests", **kw),
        "beam_blocks": Histogram("vllm:dsbd_beam_kv_blocks", "KV blocks held by a beam request when it finished",
                                 buckets=[float(2 ** b) for b in range(0, 14)], **kw),
    }


class DSBDStats:
    """Counts of one engine (one worker). ``record`` is called once per request per verified engine step."""

    def __init__(self, cfg: DSBDConfig, log_interval_s: float = 10.0, prometheus: bool = True,
                 track_decisions: bool = False):
        self.cfg = cfg
        # False on tensor-parallel ranks other than 0: every rank makes the same decisions, one of them reports them
        # (the front end would otherwise sum the ranks' memory-mapped counters)
        self._use_prometheus = prometheus
        # with tensor parallelism: a hash of every decision this engine made (request, context length, forest nodes,
        # emitted tokens, accepted path, widths), equal on every rank iff the ranks built the same forests and verified
        # them the same way (``DSBDWorker.dsbd_decisions``); None otherwise (nothing to compare, no work per step)
        self.decisions = hashlib.blake2b(digest_size=16) if track_decisions else None
        self.iterations = 0  # target passes over a request (with or without a forest)
        self.forest_iterations = 0  # those that verified a forest
        self.layers_passed = Counter()  # layers passed -> iterations (forest iterations only)
        self.width_per_layer = [Counter() for _ in range(cfg.depth)]  # layer d -> Counter(K)
        self.tokens = 0
        self.draft_nodes = 0  # forest nodes verified (= vLLM's spec_decode_num_draft_tokens)
        self.kv_moves = 0
        self.draft_depths = Counter()  # depth allowed by load-aware speculation -> requests x steps
        self.foreign_drafts = 0  # scheduled draft tokens that were not our forest (ignored: depth 0)
        self.beam_passes = 0  # target passes over beam requests (one per request and pass)
        self.beam_steps = 0  # beam steps done (every live beam grew by one token)
        self.beam_requests = 0  # beam requests finished
        self.beam_blocks: list[int] = []  # KV blocks held by each finished beam request
        self.beam_draft_nodes = 0  # forest nodes verified on beam requests
        self.beam_layers_passed = 0  # forest layers passed on beam requests (each a beam step with no target pass)
        self.beam_dropped = 0  # dead trie slots dropped by re-layouts (BeamRequest._relayout)
        self._log_interval = log_interval_s
        self._last_log = time.monotonic()
        self._prom: dict | None = None

    def _prometheus(self) -> dict | None:
        """This engine's collectors, created on first use (vLLM unregisters every ``vllm:`` collector when it builds
        its stat logger, after the runner exists) and kept registered in the default registry; a newer engine in the
        same process takes the names over."""
        global _OWNER
        from prometheus_client import REGISTRY

        if not self._use_prometheus:
            return None
        with _LOCK:
            if self._prom is None and (child_dir := _child_dir()) is not None:
                # engine core in a child of the front end: values go to the front end's directory, no registry here
                self._prom = _collectors(child_dir, self.cfg.depth)
                self._mmap = True
            if getattr(self, "_mmap", False):
                return self._prom
            if self._prom is None:
                self._prom = _collectors()
                if self._prom is None:
                    return None
                if _OWNER is not None and _OWNER is not self and _OWNER._prom is not None:
                    for c in _OWNER._prom.values():
                        if c in REGISTRY._collector_to_names:
                            REGISTRY.unregister(c)
                _OWNER = self
            if _OWNER is self:
                for c in self._prom.values():
                    if c not in REGISTRY._collector_to_names:
                        try:
                            REGISTRY.register(c)
                        except ValueError:  # the name is taken by a collector we do not own: leave it
                            pass
            return self._prom

    def record_levels(self, depths: list[int]) -> None:
        """The draft depth load-aware speculation allowed each decoding request of a step."""
        if not depths:
            return
        self.draft_depths.update(depths)
        prom = self._prometheus()
        if prom is not None:
            for d in depths:
                prom["draft_depth"].observe(d)

    def record_beam(self, step, blocks: int | None) -> None:
        """One target pass over a beam request (``step``: its ``beams.StepResult``: beam steps made, forest nodes
        verified, layers passed), and the request's KV blocks if it finished."""
        prom = self._prometheus()
        steps = (1 + step.layers_passed) if step.stepped else 0
        self.beam_passes += 1
        self.beam_steps += steps
        self.beam_draft_nodes += step.draft_nodes
        self.beam_layers_passed += step.layers_passed
        self.beam_dropped += step.dropped
        self._record_widths(step.widths, prom)
        if prom is not None:
            prom["beam_passes"].inc()
            for name, v in (("beam_steps", steps), ("beam_nodes", step.draft_nodes),
                            ("beam_layers", step.layers_passed), ("beam_dropped", step.dropped)):
                if v:
                    prom[name].inc(v)
        if blocks is not None:
            self.beam_requests += 1
            self.beam_blocks.append(blocks)
            if prom is not None:
                prom["beam_requests"].inc()
                prom["beam_blocks"].observe(blocks)

    def record(self, row, res) -> None:
        if self.decisions is not None:
            self.decisions.update(repr((row.state.req_id, row.context_len,
                                        list(row.forest.tokens) if row.forest is not None else None,
                                        list(res.tokens), list(res.path), [int(k) for k in res.widths])).encode())
        prom = self._prometheus()
        self.iterations += 1
        self.tokens += len(res.tokens)
        if prom is not None:
            prom["passes"].inc()
            prom["tokens"].inc(len(res.tokens))
        if row.forest is None:
            return
        self.forest_iterations += 1
        self.draft_nodes += row.num_nodes
        self.layers_passed[res.passed] += 1
        if prom is not None:
            prom["iterations"].inc()
            prom["nodes"].inc(row.num_nodes)
            prom["layers"].observe(res.passed)
        self._record_widths(res.widths, prom)
        now = time.monotonic()
        if now - self._last_log >= self._log_interval:
            self._last_log = now
            logger.info("DSBD: %s", self.summary())

    def _record_widths(self, widths, prom) -> None:
        """K of each verified draft layer (index d = layer d + 1; beam requests: the drafted layers of a pass)."""
        for d, k in enumerate(widths):
            if d < len(self.width_per_layer):
                self.width_per_layer[d][int(k)] += 1
            if prom is not None:
                prom["width"].labels(layer=str(d + 1)).observe(int(k))

    def decisions_digest(self) -> dict:
        """What the tensor-parallel test compares across ranks."""
        return {"decisions": self.decisions.hexdigest() if self.decisions is not None else None,
                "iterations": self.iterations,
                "forest_iterations": self.forest_iterations, "draft_nodes": self.draft_nodes, "tokens": self.tokens,
                "layers_passed": dict(self.layers_passed)}

    def record_moves(self, n: int) -> None:
        self.kv_moves += n
        prom = self._prometheus()
        if prom is not None and n:
            prom["moves"].inc(n)

    def mean_layers_passed(self) -> float:
        n = sum(self.layers_passed.values())
        return sum(k * v for k, v in self.layers_passed.items()) / n if n else 0.0

    def mean_width(self) -> list[float]:
        return [sum(k * v for k, v in c.items()) / sum(c.values()) if c else 0.0 for c in self.width_per_layer]

    def summary(self) -> str:
        widths = ", ".join(f"{w:.2f}" for w in self.mean_width())
        return (f"{self.forest_iterations} forest iterations, {self.mean_layers_passed():.2f} layers passed on "
                f"average, mean width per layer [{widths}], {self.tokens} tokens in {self.iterations} iterations, "
                f"{self.kv_moves} KV slots moved"
                + (f"; beams: {self.beam_steps} steps in {self.beam_passes} target passes ({self.beam_layers_passed} "
                   f"forest layers passed of {self.beam_draft_nodes} draft nodes), {self.beam_requests} requests "
                   "finished" if self.beam_passes else ""))
