"""The DSBD runner's last hook of a step: the next forests (``propose_draft_token_ids``), a mixin of
``runner.DSBDRunnerMixin``.

For each plain request a draft job (its depth from the engine, the load plan and the cost model, its catch-up tokens
and, for the draft's rules, its history) and for each beam request that stepped a beam draft job; all drafted side by
side in one device read (``reads.gather``). With an EAGLE-3 head, this step's target features are kept first
(``engine/head.py``); with a draft mixed with the draft-free sources, each job's text is indexed for lookup and its
last tokens go with it (``engine/mixing.py``). The step in vLLM's hooks: docs/design/step.md §3.1.
"""
from __future__ import annotations

import functools

import torch

from . import bare, head, load, mixing, reads
from .beams.drafter import BeamDraftJob, catch_up_start, propose_beam_forests
from .drafter import DraftJob
from .source_drafter import sources_of


class ProposeMixin:
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        results, self._dsbd_results = self._dsbd_results, None
        plan_rows, self._dsbd_last_plan = self._dsbd_last_plan, None
        batch = self.input_batch
        num_reqs = batch.num_reqs
        out: list[list[int]] = [[] for _ in range(num_reqs)]
        if results is None:
            return out
        if isinstance(results, bare.BareTokens):  # vLLM's sampler's tokens: its host lists when it gives them
            results.with_host(sampled_token_ids)
        discard = self.discard_request_mask.np[:num_reqs]
        if self._dsbd_head:
            self._keep_head_features(results, discard)
        cfg, jobs, beam_jobs = self.dsbd_cfg, [], []
        levels = self._load_levels(discard, results)
        for i, req_id in enumerate(batch.req_ids):
            st = self.dsbd_requests.get(req_id)
            if discard[i] or st is None:
                continue
            if st.beam is not None:  # the leaves still to compute, then the forest, are the request's drafts
                step = getattr(plan_rows[i], "beam_result", None) if plan_rows is not None else None
                if step is not None and not step.finished:
                    out[i] = list(step.next_drafts)
                    if step.stepped and (job := self._beam_draft_job(i, st, len(step.next_drafts),
                                                                     levels[i])) is not None:
                        beam_jobs.append(job)
                continue
            res = results[i]
            # vLLM proposes before its bookkeeping for a draft model, after it (this step's tokens already in the
            # batch) for other drafters: the draft-free sources'
            m = bare.emitted(res)  # a bare row's token is read only if needed
            n_before = int(batch.num_tokens_no_spec[i]) - (m if self._dsbd_sources else 0)
            root_pos = n_before + m - 1
            n_out = int(n_before + m - batch.num_prompt_tokens[i])
            depth = min(cfg.depth, levels[i].depth)
            if st.max_tokens is not None:
                depth = min(depth, st.max_tokens - n_out - 1)
            depth = min(depth, (self.dsbd_context_len - 2 - root_pos) // max(st.width, 1))
            if depth <= 0 or (st.eos >= 0 and st.eos in res.tokens):
                continue
            start = min(st.draft_len, root_pos)
            old = batch.token_ids_cpu[i, start:n_before].tolist() if start < n_before else []
            tokens = old + res.tokens[max(0, start - n_before):]
            history = None
            # the draft's rows take the target's grammar, penalties and rules (drafter: processors.DraftRows)
            if st.penalties is not None or st.rules is not None or st.grammar is not None:
                prompt, output = self._history(i, n_before)
                history = (prompt, output + res.tokens)
            tail = (mixing.plain_tail(sources_of(st, cfg), batch.token_ids_cpu[i], n_before, res.tokens)
                    if self._dsbd_mixed else None)
            jobs.append(DraftJob(state=st, row=i, tokens=tokens, start=start, root_pos=root_pos, depth=depth,
                                 width=min(st.width, levels[i].width), history=history, tail=tail))
        if (jobs or beam_jobs) and len(self._dsbd_late_rows):  # bare steps' recycle rows, before the tables are read
            self._dsbd_late_rows.drain()
        # plain and beam requests' forests side by side: one read of the device for both (``engine/reads.py``)
        beam_forests = (self.drafter.propose_beam_forests if self._dsbd_sources
                        else functools.partial(propose_beam_forests, self.drafter))
        forests, _ = reads.run(reads.gather(self.drafter.propose_forests(jobs) if jobs else None,
                                            beam_forests(beam_jobs) if beam_jobs else None))
        for job, pf in zip(jobs, forests or []):
            job.state.pending = pf
            job.state.forest_nodes = job.width or job.state.width
            job.state.asked_depth = job.depth  # what the estimates count as tried where the drafter built less
            out[job.row] = list(pf.tokens) if pf is not None else []
        for job in beam_jobs:
            job.state.forest_nodes = job.width
            if job.state.beam.forest is not None:
                out[job.row] += job.state.beam.forest.tokens
        return out

    def _keep_head_features(self, results: list, discard) -> None:
        """Appends to each plain request's kept target features (``RequestState.head_features``) this pass's rows of
        its new context: the linear rows (a prefill chunk, or the root) and the accepted path's forest nodes, combined
        by the head's ``fc`` in one call."""
        rows_of, aux, self._dsbd_feature_rows, self._dsbd_aux = self._dsbd_feature_rows, self._dsbd_aux, [], None
        beam_rows_of, self._dsbd_beam_feature_rows = self._dsbd_beam_feature_rows, []
        moves, self._dsbd_beam_moves = self._dsbd_beam_moves, []
        if aux is None or not (rows_of or beam_rows_of):
            return
        picks, spans = [], []
        for i, st, q, first, n_lin in rows_of:
            path = [] if discard[i] or results[i] is None else results[i].path
            rows = list(range(q, q + n_lin)) + [q + n_lin + k for k in path]
            spans.append((st, first, len(rows)))
            picks += rows
        for _, _, rows, _ in beam_rows_of:
            picks += rows
        dev = aux[0].device
        feats = self.drafter.combine(torch.cat([h[torch.tensor(picks, dtype=torch.int64, device=dev)] for h in aux], -1))
        at = 0
        for st, first, m in spans:
            rows = feats[at : at + m]
            at += m
            st.head_features = head.Features(first, rows) if st.head_features is None else st.head_features.append(
                first, rows)
        # beam requests: by slot, then moved as this step moved their K/V (a re-layout's moves included: trie.py)
        moved = {i: (src, dst) for i, src, dst in moves}
        for i, st, rows, slots in beam_rows_of:
            f = feats[at : at + len(rows)]
            at += len(rows)
            if not isinstance(st.head_features, head.SlotFeatures):
                st.head_features = head.SlotFeatures(f.shape[1], f.device, f.dtype)
            st.head_features.put(slots, f)
            if i in moved:
                st.head_features.move(*moved[i])

    def _beam_draft_job(self, i: int, st, num_leaf_drafts: int, level: load.Level | None = None) -> BeamDraftJob | None:
        """The draft job of a beam request after a full step, or None: depth up to the steps left (and the request's
        ``depth``), nodes up to the draft slots left after the leaves and the KV blocks the request owns now (the
        drafter writes the forest's draft K/V and may not write past them)."""
        if not self.dsbd_cfg.drafting:  # an engine without a forest source drafts no forest
            return None
        beam = st.beam
        if beam.grammar is not None:  # structured outputs: no forest (engine/beams/grammar.py)
            return None
        depth = min(self.dsbd_cfg.depth, beam.params.max_tokens - beam.steps - 1)
        if beam.params.depth is not None:  # pinned by the request
            depth = min(depth, beam.params.depth)
        elif self.dsbd_cost is None and beam.draft_skip > 0:  # recent forests passed no layer: this step goes
            # without one (trie.py; the cost model has its own estimate and waits, cost.Acceptance)
            beam.draft_skip -= 1
            return None
        elif level is not None:  # load-aware (load.py): fewer depths, and nodes below
            depth = min(depth, level.depth)
        if depth <= 0:
            return None
        bt = self.input_batch.block_table[self.drafter.kv_cache_gid]
        end = beam.base + len(beam.tokens)  # first slot after the trie
        room = int(bt.num_blocks_per_row[i]) * bt.block_size - end
        max_nodes = min(self.dsbd_cfg.num_speculative_slots - num_leaf_drafts, room, self.max_model_len - 1 - end)
        nodes = level.beam_nodes if level is not None and beam.params.depth is None else None  # the cost model's N
        if level is not None and beam.params.depth is None:
            max_nodes = min(max_nodes, level.nodes(load.Shape(beam.params.width, nodes or beam.nodes, depth)))
        if max_nodes <= 0:
            return None
        start = catch_up_start(st)
        P = beam.prompt_len  # the catch-up's linear tokens: the prompt's, then the beams' common prefix
        tail = self.input_batch.token_ids_cpu[i, start:P].tolist() if start < P else []
        tail += beam.prefix[max(0, start - P):]
        linear = (mixing.beam_linear(sources_of(st, self.dsbd_cfg), self.input_batch.token_ids_cpu[i], P, beam.prefix)
                  if self._dsbd_mixed else None)
        return BeamDraftJob(st, i, tail, start, depth, max_nodes, nodes, linear)
