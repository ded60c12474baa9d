"""Which shape each request drafts this step: the load budget's levels (``load.plan``) and, with the cost model, each
request's depth and nodes per depth within them (``cost.choose_shapes``), the table the model works from with its
online correction (``step_clock.py``), and what each verified forest tells the estimates. A mixin of the DSBD runner
(``runner.py``), which holds the state it reads (``dsbd_cfg``, ``dsbd_budget``, ``dsbd_cost``, ``dsbd_pass_rates``,
``dsbd_stats``, ``dsbd_requests``). docs/design/cost-model.md §3.6.
"""
from __future__ import annotations

import dataclasses
import logging

from . import bare, cost, load
from .step_clock import BEAM, PLAIN, StepClock

logger = logging.getLogger("vllm.vllm_dsbd.engine")
# the most requests that try in one step (cost.Exploration): a probe step then costs one request's forest beside the
# bare step, not a batch's (what 8 together cost: results/sure-floors-2026-12-07)
MAX_TRIES = 1


class ShapePlanMixin:
    def set_cost_table(self, table: cost.CostTable, origin: str) -> None:
        """Switches the cost model on with ``table`` (logged once with the rule); a measured table is corrected by the
        steps' own timings (``step_clock.py``) without tensor or pipeline parallelism."""
        self.dsbd_cost = self._dsbd_cost_base = table
        # the clock's surpluses are over the passes and ``step`` alone (it measures draft_step and node itself)
        self._dsbd_cost_passes = dataclasses.replace(table, draft_step=0.0, node=0.0)
        self._dsbd_clock = (StepClock() if origin.startswith("measured") and self.parallel_config.world_size == 1
                            else None)
        logger.info("DSBD cost model (%s table): %s; each step every request drafts the depth d <= %d maximising the "
                    "step's expected tokens per second, sum of E(d) = 1 + a + ... + a^d over step + target(tokens) + "
                    "draft passes, a = its layers passed per layer tried in earlier steps (prior %.2f over %.0f "
                    "layers; T = 0 beam requests: per N, from W up), keeping every request at %s of its tokens per "
                    "second without forests while none waits (the one with the most tokens left at %s); depth 0 "
                    "where drafting does not pay", origin, table.describe(), self.dsbd_cfg.depth, cost.PRIOR_RATE,
                    cost.PRIOR_WEIGHT, cost.FLOOR, cost.LAST_FLOOR)

    def _observe(self, st, kind: str, passed: int, depth: int, nodes: int, sub=None, asked: int = 0) -> None:
        """A verified forest (``nodes`` per depth, ``passed`` of ``depth`` layers) into the request's estimate (``sub``:
        a T = 0 beam forest's subforests), the engine-wide rates and the metrics, under the draft's source. ``asked``:
        the depth the model asked where the drafter built less (draft-free sources find no candidate for every
        layer): the estimates then count the first layer not built as tried and failed, so a rate says what a layer
        the model asks for yields (the cost model plans layers, and pays a step's forest work whether they come or
        not); the metrics count the built layers only."""
        at = max(depth, asked)
        st.acceptance.observe(passed, at, sub, None if sub is not None else nodes)
        self.dsbd_pass_rates.observe((cost.DRAFT, kind), nodes, passed, at)
        if depth > 0:
            self.dsbd_stats.record_pass_rate(cost.DRAFT, kind, nodes, passed, min(passed + 1, depth))

    def _dsbd_row_limit(self, reqs: int):
        """With the cost model: each request's most prompt rows in a step of ``reqs`` requests, (state, prompt length)
        -> rows (``cost.prompt_row_limit``: at most ``cost.PROMPT_SHARE`` of its remaining tokens' time without
        forests, a row priced at the LM head's share of the table's marginal token); None without it."""
        table = self.dsbd_cost
        if table is None:
            return None
        if self._dsbd_head_share is None:  # the LM head's share of the target's parameters, once
            head = getattr(getattr(self.model, "lm_head", None), "weight", None)
            total = sum(p.numel() for p in self.model.parameters())
            self._dsbd_head_share = head.numel() / total if head is not None and total else 1.0
        share, room = self._dsbd_head_share, self.dsbd_context_len

        def limit(st, prompt: int) -> int | None:
            left = st.max_tokens if st.max_tokens is not None else room - prompt
            return cost.prompt_row_limit(table, reqs, max(left, 0), share)

        return limit

    def _dsbd_left(self, row: int, st) -> int:
        """The tokens (a beam request: beam steps) the request in batch ``row`` has left at most: ``max_tokens`` less
        its output, within the context left (``cost.request_floors``)."""
        if st.beam is not None:
            return st.beam.params.max_tokens - st.beam.steps
        batch = self.input_batch
        done, prompt = int(batch.num_tokens_no_spec[row]), int(batch.num_prompt_tokens[row])
        room = self.dsbd_context_len - done
        return room if st.max_tokens is None else min(room, st.max_tokens - (done - prompt))

    def _catch_ups(self, results) -> list[int] | None:
        """With the cost model and a draft model, each batch row's catch-up if it drafts this step: the tokens its
        draft's first pass runs besides the prompt's, i.e. those since its draft last ran (a plain request's emitted
        tokens, more after idle steps; a beam request's trie nodes and prefix without draft K/V). The prompt's own
        catch-up (the draft's prefill, which vLLM's drafter runs for every request whatever the choice, and which a
        request pays once) is not priced; it runs in passes of at most ``max_num_batched_tokens``
        (``drafter.catch_up_prefix``). Beam requests' at least their live leaves. ``results``: this step's, by batch
        row (a draft model proposes before vLLM's bookkeeping: the batch's tokens do not hold them yet)."""
        if self.dsbd_cost is None or not self.dsbd_cfg.draft:
            return None
        from .beams.drafter import catch_up_start

        batch, out = self.input_batch, []
        for i, req_id in enumerate(batch.req_ids):
            st = self.dsbd_requests.get(req_id)
            if st is None:
                out.append(1)
            elif st.beam is not None:
                b = st.beam
                out.append(max(b.params.width, b.base + len(b.tokens) - max(catch_up_start(st), b.prompt_len)))
            else:
                res = results[i] if results is not None and i < len(results) else None
                root = int(batch.num_tokens_no_spec[i]) + (bare.emitted(res) if res is not None else 1) - 1
                out.append(max(1, root + 1 - max(min(st.draft_len, root), int(batch.num_prompt_tokens[i]))))
        return out

    def _load_levels(self, discard, results=None) -> list[load.Level]:
        """The draft limits of every request of the batch this step (``load.plan``: from the batch's shapes and the
        budget; with the cost model, each request's depth within them, ``cost.choose_shapes``, its draft's first pass
        priced with its catch-up, :meth:`_catch_ups`; never from a draw of this step); decoding requests' depths go to
        ``vllm:dsbd_draft_depth``."""
        cfg, shapes, states = self.dsbd_cfg, [], []
        for req_id in self.input_batch.req_ids:
            st = self.dsbd_requests.get(req_id)
            states.append(st)
            if st is None:
                shapes.append(load.Shape(leaves=1, width=0, depth=0))
            elif st.beam is not None:
                p = st.beam.params
                depth = cfg.depth if p.depth is None else min(cfg.depth, p.depth)
                shapes.append(load.Shape(leaves=p.width, width=st.beam.nodes, depth=depth, pinned=p.depth is not None))
            else:
                shapes.append(load.Shape(leaves=1, width=st.width, depth=cfg.depth))
        levels = load.plan(shapes, self.dsbd_budget)
        if self.dsbd_cost is not None:
            levels = self._choose_depths(levels, shapes, states, discard, self._catch_ups(results))
        if cfg.drafting:
            self.dsbd_stats.record_levels(
                [lv.depth for lv, s, skip in zip(levels, shapes, discard) if not skip and s.depth and not s.pinned])
        return levels

    def _choose_depths(self, levels, shapes, states, discard, catch_ups=None) -> list[load.Level]:
        """The cost model's depth for every decoding request within its level, and its nodes per depth N: a plain
        request's from 1 up, a beam request's from W up (``cost.choose_shapes``; beam requests' to
        ``vllm:dsbd_beam_draft_nodes_chosen``), from the table, each request's estimate of its earlier steps and the
        engine-wide rates (a try's floor and a new request's rate), no request slowed below its floor of its pace
        without forests while no request waits (patch ``scheduler_queue``; ``cost.request_floors``: ``cost.FLOOR``,
        the one with the most tokens left ``cost.LAST_FLOOR``, and the batch's end, ``batch_end``); tries and forests
        at the prior only within the engine's exploration budget (``cost.Exploration``), one try a step
        (``MAX_TRIES``)."""
        rows, cands, lows, tries, pools = [], [], [], [], []
        explore = self.dsbd_explore.open()  # probes only within the engine's budget (cost.Exploration)

        def candidate(k: int, ex: bool) -> cost.Candidate:
            i, s = rows[k], shapes[rows[k]]
            pool = pools[k]
            c = states[i].acceptance.candidate(s.leaves, min(levels[i].width, s.width), min(levels[i].depth, s.depth),
                                               s.pinned, lows[k], pool and pool[0], ex, pool[1] if pool else 0.0)
            if catch_ups is not None and catch_ups[i] != c.catch_up:  # the draft's first pass as it will run
                c = dataclasses.replace(c, catch_up=catch_ups[i])
            return c

        for i, (lv, s, st) in enumerate(zip(levels, shapes, states)):
            if st is None or discard[i]:
                continue
            w, b = min(lv.width, s.width), st.beam
            low = b.params.width if b is not None else 1  # the fewest nodes per depth: a beam request's W, else 1
            lows.append(low if w >= low else None)
            rows.append(i)
            pools.append(self.dsbd_pass_rates.estimate((cost.DRAFT, "plain" if b is None else "beam"), w))
            tries.append(explore and st.acceptance.idle >= st.acceptance.wait)
            cands.append(candidate(len(rows) - 1, explore))
        if sum(tries) > MAX_TRIES:  # the others plan at their estimates and try in later steps
            keep = _tries_kept(tries, cands, [states[i].acceptance.idle for i in rows])
            for k, t in enumerate(tries):
                if t and k not in keep:
                    tries[k], cands[k] = False, candidate(k, False)
        out, chosen = list(levels), []
        clock = self._dsbd_clock
        beams = sum(states[i].beam is not None for i in rows)  # the batch's kind: its windows are measured apart
        kind = PLAIN if not beams else BEAM if beams == len(rows) else None
        # the engine's first decode steps (unmeasured), or forests measured to lose at this batch size (a mixed batch:
        # by its plain requests' windows) with no probe due (none is while no request waits: the floors promise every
        # request its pace, and forests measured to lose slow them all; the verdict expires, HORIZON): the model is not
        # asked (its host work saved on every such step), none drafts but a pinned beam request
        lose = (clock is not None and not clock.warming() and (not explore or not self._dsbd_waiting)
                and self._dsbd_bare_probe == 0 and clock.forests_lose(len(rows), kind or PLAIN))
        if lose or (clock is not None and clock.warming()):
            shapes, probed = _pinned_only(cands, [(c.width, c.depth) for c in cands]), False
            self.dsbd_stats.vetoed_steps += lose and any(c.width > 0 and c.depth > 0 and not c.pinned for c in cands)
        else:
            # a batch of beam requests priced by its own windows' correction (beam forests cost what plain ones do not)
            table = (clock.corrected(self._dsbd_cost_base, BEAM) if clock is not None and kind == BEAM
                     else self.dsbd_cost)
            # no request slowed by the others' forests while none waits (under a queue, the batch's tokens per second)
            left = None if self._dsbd_waiting else [self._dsbd_left(i, states[i]) for i in rows]
            shapes = cost.choose_shapes(cands, table, floor=None if left is None else cost.request_floors(left),
                                        left=left)
            probed = any(c.probe and not c.pinned and d > 0 for c, (_, d) in zip(cands, shapes))
            if clock is not None:
                shapes, probed = self._measured_veto(clock, cands, shapes, len(rows), explore, probed, kind)
        self.dsbd_explore.step(probed)
        if self._dsbd_clock is not None:
            self._dsbd_clock.planned(cost.draft_seconds(cands, shapes, self._dsbd_cost_passes),
                                     any(d for _, d in shapes), sum(w * d for w, d in shapes))
        for i, c, low, tr, (w, d) in zip(rows, cands, lows, tries, shapes):
            if not c.pinned:
                if c.depth > 0 and c.width > 0:
                    states[i].acceptance.chose(d, tr)
                n = w if low is not None and d > 0 else None  # w nodes per depth: a plain request's width, a beam's N
                beam = states[i].beam is not None
                out[i] = load.Level(levels[i].width if beam or n is None else n, d, n if beam else None)
                chosen += [n] if beam and n is not None else []
        self.dsbd_stats.record_nodes(chosen)
        return out

    def _measured_veto(self, clock, cands, shapes, reqs: int, explore: bool, probed: bool, kind: str | None = PLAIN):
        """The model's ``shapes`` against what the step clock measured at a batch of ``reqs`` requests, on a step the
        early veto in :meth:`_choose_depths` let through: where only forests were measured, a bare probe, a few steps
        without them (``step_clock.needs_bare``; not from the budget: a short run must reach the verdict too), run
        only in a batch of one ``kind`` of request, plain or beam (the clock records no mixed window, so a probe's step
        there would cost forests and measure nothing), and at that kind's windows; forests
        measured to lose there (``step_clock.forests_lose``) reach here only with the exploration budget open and
        requests waiting, and run as its probe: the probes' forests alone (tries, forests at the prior; before
        2026-12-08 every request's, results/kv-pressure-2026-12-08). Returns (shapes, whether the step probes)."""
        if not any(d > 0 and not c.pinned for c, (_, d) in zip(cands, shapes)):
            return shapes, probed
        if self._dsbd_bare_probe == 0 and kind is not None and clock.needs_bare(reqs, kind):
            self._dsbd_bare_probe, self._dsbd_probe_kind = clock.bare_probe(reqs, kind), kind
        if self._dsbd_bare_probe > 0 and kind == self._dsbd_probe_kind:  # else it waits for a batch of its kind
            self._dsbd_bare_probe -= 1
            self.dsbd_stats.vetoed_steps += 1
            return _pinned_only(cands, shapes), probed
        if clock.forests_lose(reqs, kind or PLAIN):  # the budget's probe under a queue: its probes' forests alone
            shapes = _pinned_only(cands, shapes, probes=True)
            return shapes, any(d > 0 and not c.pinned for c, (_, d) in zip(cands, shapes))
        return shapes, probed


def _tries_kept(tries: list[bool], cands: list, idle: list[int]) -> set[int]:
    """Of a step's requests due a try (``tries``), the ``MAX_TRIES`` that try: the likeliest to pay (their candidates'
    rates, the tries'), then the longest idle, then the first."""
    due = sorted((k for k, t in enumerate(tries) if t), key=lambda k: (-cands[k].rate, -idle[k], k))
    return set(due[:MAX_TRIES])


def _pinned_only(cands, shapes, probes: bool = False) -> list[tuple[int, int]]:
    """``shapes`` with every forest dropped but a pinned request's (a beam request that set its own depth) and, with
    ``probes``, a probe's."""
    return [(w, d if c.pinned or (probes and c.probe) else 0) for c, (w, d) in zip(cands, shapes)]
