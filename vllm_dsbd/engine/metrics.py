"""DSBD statistics: layers passed per iteration, the width of each verified layer, beam requests' passes and steps, KV
commits, the draft depth the cost model chose (or load-aware speculation allowed), the nodes per depth it chose for
beam requests, and every forest source's layers passed and tried by kind of request and nodes per depth.

Per engine (worker) process :class:`DSBDStats` counts what verification did, logs a ``DSBD: ...`` summary at most every
``log_interval_s`` seconds and updates the ``vllm:dsbd_*`` Prometheus collectors (``prometheus.py`` carries them across
processes). vLLM's own spec-decode metrics count plain requests' forests, nodes and layers passed (patches
``spec_stats_depths``, ``spec_stats_prometheus``; beam requests only in the ``beam_*`` counters here): its "draft
acceptance rate" is at most 1/W by construction. What each metric means:
docs/usage/metrics.md; docs/design/startup.md §3.7.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter

from vllm_dsbd.config import DSBDConfig

from .prometheus import child, collectors_for

logger = logging.getLogger("vllm.vllm_dsbd.engine")

class DSBDStats:
    """Counts of one engine (one worker). ``record`` is called once per request per verified engine step."""

    def __init__(self, cfg: DSBDConfig, log_interval_s: float = 10.0, prometheus: bool = True,
                 track_decisions: bool = False):
        self.cfg = cfg
        # False on tensor-parallel ranks other than 0: every rank makes the same decisions, one of them reports them
        # (the front end would otherwise sum the ranks' memory-mapped counters)
        self.use_prometheus = prometheus
        # with tensor parallelism: a hash of every decision this engine made (request, context length, forest nodes,
        # emitted tokens, accepted path, widths), equal on every rank iff the ranks built the same forests and verified
        # them the same way (``DSBDWorker.dsbd_decisions``); None otherwise (nothing to compare, no work per step)
        self.decisions = hashlib.blake2b(digest_size=16) if track_decisions else None
        self.iterations = 0  # target passes over a request (with or without a forest)
        self.forest_iterations = 0  # those that verified a forest
        self.bare_steps = 0  # steps sampled by vLLM's sampler: no forest, no beam step (engine/bare.py)
        self.vetoed_steps = 0  # steps whose forests the step clock vetoed: they lose at this batch size (shapes.py)
        self.prompt_rows = 0  # prompt rows the recycle source took into its tables (runner._model_forward)
        self.layers_passed = Counter()  # layers passed -> iterations (forest iterations only)
        self.width_per_layer = [Counter() for _ in range(cfg.depth)]  # layer d -> Counter(K)
        self.tokens = 0
        self.draft_nodes = 0  # forest nodes verified (= vLLM's spec_decode_num_draft_tokens)
        self.kv_moves = 0
        self.draft_depths = Counter()  # depth chosen by the cost model (or allowed by the budget) -> requests x steps
        self.beam_nodes_chosen = Counter()  # N the cost model chose for a beam forest -> requests x steps
        # (source, kind, N) -> [layers passed, layers tried] of the verified forests (the cost model's pass rates)
        self.pass_rates: dict[tuple[str, str, int], list[int]] = {}
        self.foreign_drafts = 0  # scheduled draft tokens that were not our forest (ignored: depth 0)
        self.beam_passes = 0  # target passes over beam requests (one per request and pass)
        self.beam_steps = 0  # beam steps done (every live beam grew by one token)
        self.beam_requests = 0  # beam requests finished
        self.beam_blocks: list[int] = []  # KV blocks held by each finished beam request
        self.beam_draft_nodes = 0  # forest nodes verified on beam requests
        self.beam_layers_passed = 0  # forest layers passed on beam requests (each a beam step with no target pass)
        self.beam_pass_layers = Counter()  # layers passed -> target passes over a beam request that verified a forest
        self.beam_dropped = 0  # dead trie slots dropped by re-layouts (BeamRequest._relayout)
        self._log_interval = log_interval_s
        self._last_log = time.monotonic()
        self.prom: dict | None = None  # this engine's collectors (prometheus.py)
        self.prom_mmap = False  # they write to the front end's directory

    def _prometheus(self) -> dict | None:
        """This engine's collectors (``prometheus.collectors_for``)."""
        return collectors_for(self)

    def record_levels(self, depths: list[int]) -> None:
        """The draft depth the cost model chose (or the budget allowed) each decoding request of a step."""
        self._record(self.draft_depths, "draft_depth", depths)

    def record_nodes(self, nodes: list[int]) -> None:
        """The nodes per depth N the cost model chose for each beam request it drafts for this step."""
        self._record(self.beam_nodes_chosen, "beam_nodes_chosen", nodes)

    def record_pass_rate(self, source: str, kind: str, nodes: int, passed: int, tried: int) -> None:
        """A verified forest of ``source`` drafted with ``nodes`` per depth for a ``kind`` ("plain" or "beam")
        request: ``passed`` of its ``tried`` layers passed (a layer is tried when the one before it passed)."""
        pt = self.pass_rates.setdefault((source, kind, nodes), [0, 0])
        pt[0] += passed
        pt[1] += tried
        prom = self._prometheus()
        if prom is not None:
            labels = {"source": source, "kind": kind, "nodes": str(nodes)}
            child(self, "draft_tried", labels).inc(tried)
            if passed:
                child(self, "draft_passed", labels).inc(passed)

    def _record(self, counts, histogram: str, values: list[int]) -> None:
        """``values`` into a count and into the Prometheus histogram of that name (when this engine reports)."""
        if not values:
            return
        counts.update(values)
        prom = self._prometheus()
        if prom is not None:
            for v in values:
                prom[histogram].observe(v)

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
        if step.draft_nodes:
            self.beam_pass_layers[step.layers_passed] += 1
        self._record_widths(step.widths, prom)
        if prom is not None:
            prom["beam_passes"].inc()
            if step.draft_nodes:
                prom["beam_pass_layers"].observe(step.layers_passed)
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
        """One plain request's verified iteration (``row``: its ``sampler.RowPlan``, ``res``: its ``RowResult``)."""
        self.record_all([(row, res)])

    def record_all(self, pairs) -> None:
        """:meth:`record` of every (row, result) of a step, the collectors looked up and the per-step counters
        incremented once."""
        if not pairs:
            return
        prom = self._prometheus()
        tokens = sum(len(res.tokens) for _, res in pairs)
        self.iterations += len(pairs)
        self.tokens += tokens
        if prom is not None:
            prom["passes"].inc(len(pairs))
            prom["tokens"].inc(tokens)
        for row, res in pairs:
            self._record_row(row, res, prom)

    def record_bare(self, n: int) -> None:
        """A step of ``n`` requests without forests sampled by vLLM's sampler (engine/bare.py): one token each."""
        if n <= 0:
            return
        self.bare_steps += 1
        self.iterations += n
        self.tokens += n
        prom = self._prometheus()
        if prom is not None:
            prom["passes"].inc(n)
            prom["tokens"].inc(n)

    def _record_row(self, row, res, prom) -> None:
        if self.decisions is not None:
            self.decisions.update(repr((row.state.req_id, row.context_len,
                                        list(row.forest.tokens) if row.forest is not None else None,
                                        list(res.tokens), list(res.path), [int(k) for k in res.widths])).encode())
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
