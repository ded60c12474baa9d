"""The DSBD drafter: beam-samples a forest with the draft model for every decoding (plain) request.

:class:`DSBDDrafter` keeps vLLM's ``DraftModelProposer`` for what vLLM expects of a draft-model proposer (loading, KV
group, dummy runs) and replaces the proposal (:meth:`DSBDDrafter.propose_forests`): a catch-up pass, then one draft pass
per depth under forest attention. Forest nodes are written at the slots where the target will write them, so one commit
after verification moves target and draft K/V alike. An engine without a draft model gets ``no_drafter.NoDrafter``. The
drafting loops (general, chain, static with its bet): docs/design/forests.md §3.4. The draft may be an EAGLE-3 head
(``engine/head.py``): each row then also takes a hidden state, the target's feature for the catch-up rows and the
head's own output at the parent node for forest nodes (docs/design/forests.md, "EAGLE-3 heads as the draft"). With
the draft-free sources beside the draft (``DraftJob.tail``), each depth's rows are mixed with their candidates before
the draft step (``engine/mixing.py``; the general loop only: the chain and static loops are skipped).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_dsbd import envs
from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.core import rng
from vllm_dsbd.core.forest import Forest
from vllm_dsbd.core.joint import NEG_INF
from vllm_dsbd.core.sampling import beam_step
from vllm_dsbd.core.sources import NMAX

from . import head as head_mod
from . import mixing
from .attention import ForestBatch, ForestEntry, drop_chain_queries, forest_scope
from .kv import batch_slots
from .penalties import DraftPenalties
from .grammar import DraftGrammar
from .layout import _layout_np, _pad_cols

from .processors import DraftRows, DraftRules
from .reads import Reader
from .state import PendingForest, RequestState, batch_params


logger = logging.getLogger("vllm.vllm_dsbd.engine")

# the draft loops with one host read per call (``DSBDDrafter._draft_chains`` / ``_draft_static``,
# ``beams.drafter._draft_static``): "1" (default, every device) or "0" (the general loops, one read per draft depth, at
# every width: a fallback)
STATIC_DRAFT_ENV = envs.STATIC_DRAFT


def static_draft_default() -> bool:
    """``VLLM_DSBD_STATIC_DRAFT`` as the environment says now (ValueError when it is neither 1 nor 0); the runner
    passes what it read at start-up instead (``DSBDDrafter(static_drafting=...)``)."""
    return envs.read(only=(STATIC_DRAFT_ENV,)).static_draft


@dataclass
class DraftJob:
    state: RequestState
    row: int  # the request's row in the runner's input batch (its block-table row)
    tokens: list[int]  # tokens at positions [start, root_pos]: the catch-up pass
    start: int
    root_pos: int
    depth: int  # >= 1
    width: int | None = None  # nodes per depth at most (load-aware speculation); None: the request's width
    # with penalties or logits rules: prompt and output tokens, root included
    history: tuple[list[int], list[int]] | None = None
    # a draft mixed with the draft-free sources (mixing.py): the text's last tokens up to the root
    tail: list[int] | None = None


class DSBDDrafter(DraftModelProposer):
    def __init__(self, vllm_config, device, runner, cfg: DSBDConfig, static_drafting: bool | None = None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.cfg = cfg
        self.runner = runner
        self.forward_passes = 0  # statistics
        # wider calls: ``_draft_static`` first (False: the general loop; tests compare the two); after a call whose
        # draws broke its bet, the next ``_static_skip`` calls go straight to the loop (1, 2, 4 .. up to 16 calls)
        # (None: VLLM_DSBD_STATIC_DRAFT now)
        self.static_drafting = static_draft_default() if static_drafting is None else static_drafting
        # every request of a call at width 1: ``_draft_chains`` (False: the general loop; tests compare the two); off
        # with the static loops (VLLM_DSBD_STATIC_DRAFT=0 takes the general loop at every width)
        self.chain_drafting = self.static_drafting
        self.static_misses = 0  # calls whose bet failed and were drafted again by the loop (statistics, tests)
        self._static_skip = 0
        self._static_backoff = 0
        # the same for beam requests' forests (``beams.drafter._draft_static``)
        self.beam_static_misses = 0
        self.beam_static_skip = 0
        self.beam_static_backoff = 0
        # an EAGLE-3 head (engine/head.py): rows take hidden states; ``last_hidden``: the head's pre-norm outputs of
        # every row of the last pass (the next depth's inputs)
        self.head = head_mod.is_head(self.speculative_config.draft_model_config.hf_config)
        self.last_hidden: torch.Tensor | None = None
        # the most tokens one catch-up pass runs (vLLM's drafter dummy run profiles a pass of this many): a longer
        # catch-up runs its linear prefix in passes of at most this many first (:meth:`catch_up_prefix`)
        self.max_catch_up = int(vllm_config.scheduler_config.max_num_batched_tokens)

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        if self.head and not getattr(self.model.model, "use_aux_hidden_state", True):
            raise ValueError("DSBD engine: this EAGLE-3 head does not use the target's auxiliary hidden states "
                             "(eagle_config use_aux_hidden_state: false), which DSBD does not support yet")
        if self.head:  # a public head has no embedding (vLLM's EAGLE heads share the target's); its own LM head
            from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

            SpecDecodeBaseProposer._maybe_share_embeddings(self, target_model)
            SpecDecodeBaseProposer._maybe_share_lm_head(self, target_model)

    def dummy_run(self, num_tokens: int, *args, **kwargs) -> None:
        """vLLM's drafter dummy run; a head's forward needs a hidden state, which vLLM's draft-model path does not pass.
        vLLM's runs one pass per ``num_speculative_tokens`` (DSBD's scheduler slots, up to ``max_beam_width - 1``):
        as many as a full forest step's slots here (``DSBDConfig.forest_slots``), as before beams had slots apart."""
        if not self.head:
            n, self.num_speculative_tokens = self.num_speculative_tokens, min(self.num_speculative_tokens,
                                                                              self.cfg.forest_slots)
            try:
                return super().dummy_run(num_tokens, *args, **kwargs)
            finally:
                self.num_speculative_tokens = n
        H = self.model.config.hidden_size
        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens):
            self.model(input_ids=self.input_ids[:num_tokens], positions=self._get_positions(num_tokens),
                       hidden_states=torch.zeros(num_tokens, H, dtype=self.dtype, device=self.device))

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The head's input feature from the target's auxiliary hidden states ``[n, k * H_target]`` (vLLM's
        ``combine_hidden_states``: ``fc``)."""
        return self.model.combine_hidden_states(aux.to(self.dtype))

    def head_hidden(self) -> int:
        return self.model.config.hidden_size

    # ------------------------------------------------------------------------------------------------------------
    def block_table_host(self):
        """The host block table of the draft's KV group, its block size and the blocks each row owns."""
        bt = self.runner.input_batch.block_table[self.kv_cache_gid]
        return bt.block_table.cpu, bt.block_size, bt.num_blocks_per_row

    def forward_ragged(self, input_ids, positions, slots: np.ndarray, query_lens, seq_lens, block_rows: torch.Tensor,
                 sample_idx, forest: ForestBatch | None, draft_index: int,
                 hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One draft forward pass over a ragged batch (``draft_index``: the forest depth it drafts, 0 = catch-up);
        returns the draft logits [len(sample_idx), V] (float32, on the device). The index arguments are int sequences
        or numpy arrays (one conversion each). A head's rows take ``hidden`` [T, H] (zeros when None) and its pre-norm
        outputs of every row are kept in ``last_hidden``."""
        dev = self.device
        query_lens = np.asarray(query_lens, dtype=np.int64)
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        T, R = len(input_ids), len(query_lens)
        qsl = torch.zeros(R + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.from_numpy(query_lens.astype(np.int32)), 0)
        seq = torch.from_numpy(seq_lens.astype(np.int32))
        pos = torch.from_numpy(np.asarray(positions, dtype=np.int64)).to(dev)
        slot_t = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(dev)
        cad = CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq.to(dev), num_reqs=R,
            num_actual_tokens=T, max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()),
            block_table_tensor=block_rows.to(dev), slot_mapping=slot_t, causal=True, positions=pos,
            _seq_lens_cpu=seq, _num_computed_tokens_cpu=seq - (qsl[1:] - qsl[:-1]),
            seq_lens_cpu_upper_bound=seq)
        per_layer = {}
        for group in self.draft_attn_groups:
            # vLLM's own proposers' entry (``llm_base_proposer``): a fast build, which on FlashAttention 3 skips the
            # ahead-of-time schedule. A full build's schedule, made for this batch, was rejected by FA3 on an H100
            # ("scheduler_metadata must have shape (metadata_size)"; ``docs/notebook``, GPU). Not yet re-run on a GPU.
            md = group.get_metadata_builder().build_for_drafting(common_attn_metadata=cad, draft_index=draft_index)
            for name in group.layer_names:
                per_layer[name] = md
        if isinstance(input_ids, torch.Tensor):  # token ids already on the device (the chain drafter's draws)
            ids = input_ids.to(torch.int32)
        else:
            ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int32)).to(dev)
        with set_forward_context(per_layer, self.vllm_config, num_tokens=T,
                                 slot_mapping={n: slot_t for n in self._draft_attn_layer_names}), forest_scope(forest):
            if self.head:
                if hidden is None:
                    hidden = torch.zeros(T, self.head_hidden(), dtype=self.dtype, device=dev)
                hidden, self.last_hidden = self.model(input_ids=ids, positions=pos, hidden_states=hidden.to(self.dtype))
            else:
                hidden = self.model(input_ids=ids, positions=pos, inputs_embeds=None)
        self.forward_passes += 1
        idx = torch.from_numpy(np.asarray(sample_idx, dtype=np.int64)).to(dev)
        return self.model.compute_logits(hidden[idx]).float()

    # ------------------------------------------------------------------------------------------------------------
    def catch_up_prefix(self, spans: list, block_rows: torch.Tensor, brow_np: np.ndarray, bs: int,
                        owned: np.ndarray) -> list[int]:
        """Bounds a call's catch-up pass by :attr:`max_catch_up` tokens: while the catch-ups of all jobs together are
        longer, runs passes of at most that many over their linear prefixes (plain causal, as a chunked prefill: the
        draft K/V written, no logits kept), earliest tokens first, each job keeping at least its last token for the
        final pass. ``spans``: per job ``(start, linear end, catch-up tokens, tokens(lo, hi), features(lo, hi) or
        None)`` (positions = slots below the linear end). Returns each job's new catch-up start."""
        starts = [sp[0] for sp in spans]
        rest = [sp[2] for sp in spans]
        bound = max(1, self.max_catch_up)
        while sum(rest) > bound:
            left, take = bound, []
            for k, (_, lin_end, _, _, _) in enumerate(spans):
                t = min(max(0, lin_end - starts[k]), max(0, rest[k] - 1), left)
                take.append(t)
                left -= t
            sub = [k for k, t in enumerate(take) if t]
            if not sub:  # nothing linear left to run ahead: the final pass takes the rest
                break
            ids, pos, req, feats = [], [], [], []
            for k in sub:
                lo, hi = starts[k], starts[k] + take[k]
                ids += list(spans[k][3](lo, hi))
                pos += range(lo, hi)
                req += [k] * take[k]
                if self.head:
                    feats.append(spans[k][4](lo, hi))
            pos_np, req_np = np.asarray(pos, dtype=np.int64), np.asarray(req, dtype=np.int64)
            sub_np = np.asarray(sub, dtype=np.int64)
            q = np.asarray([take[k] for k in sub], dtype=np.int64)
            self.forward_ragged(ids, pos_np, batch_slots(brow_np, req_np, pos_np, bs, owned), q,
                                np.asarray([starts[k] + take[k] for k in sub], dtype=np.int64),
                                block_rows[torch.from_numpy(sub_np)], [len(ids) - 1], None, 0,
                                torch.cat(feats) if self.head else None)
            for k in sub:
                starts[k] += take[k]
                rest[k] -= take[k]
        return starts

    @torch.inference_mode()
    def propose_forests(self, jobs: list[DraftJob]) -> Reader[list[PendingForest]]:
        """Drafts one forest per job (batched: one draft pass per depth) and updates each state's draft_len; a reader
        (``engine/reads.py``). Host reads: one per depth in the general loop, one per call in :meth:`_draft_chains` and,
        when the draws fill every width, :meth:`_draft_static`."""
        if not jobs:
            return []
        dev = self.device
        R, W, G = len(jobs), self.cfg.width, max(j.depth for j in jobs)
        table, bs, owned = self.block_table_host()
        rows_np = np.array([j.row for j in jobs], dtype=np.int64)
        owned = np.asarray(owned)[rows_np].astype(np.int64)
        block_rows = table[torch.from_numpy(rows_np)]
        brow_np = block_rows.numpy()
        params = batch_params([j.state for j in jobs], [j.depth for j in jobs], self.cfg)
        if any(j.width is not None for j in jobs):  # load-aware: fewer draws per depth than the request's width
            w = torch.tensor([j.state.width if j.width is None else j.width for j in jobs], dtype=torch.int64)
            params = params.with_(width=w, min_width=torch.minimum(params.min_width, w))
        params = params.to(dev)
        root_pos = np.array([j.root_pos for j in jobs], dtype=np.int64)
        L = torch.from_numpy(root_pos + 1).to(dev)

        # pass 0: catch-up, plain causal attention; logits at each root (a long one's prefix first, in passes of at
        # most ``max_catch_up`` tokens)
        if sum(j.root_pos + 1 - j.start for j in jobs) > self.max_catch_up:
            new = self.catch_up_prefix(
                [(j.start, j.root_pos + 1, j.root_pos + 1 - j.start,
                  lambda lo, hi, j=j: j.tokens[lo - j.start : hi - j.start],
                  lambda lo, hi, j=j: head_mod.window(j.state.head_features, lo - 1, hi - 1, self.head_hidden(),
                                                      dev, self.dtype)) for j in jobs],
                block_rows, brow_np, bs, owned)
            for j, s0 in zip(jobs, new):
                j.tokens, j.start = j.tokens[s0 - j.start :], s0
        start = np.array([j.start for j in jobs], dtype=np.int64)
        qlens = root_pos + 1 - start
        ids = [t for j in jobs for t in j.tokens]
        ntok = np.array([len(j.tokens) for j in jobs], dtype=np.int64)
        assert (qlens > 0).all() and (ntok == qlens).all(), [(j.start, j.root_pos, len(j.tokens)) for j in jobs]
        req = np.repeat(np.arange(R), qlens)  # request of each query token
        ends = np.cumsum(qlens)
        pos = np.arange(len(ids), dtype=np.int64) - np.repeat(ends - qlens, qlens) + start[req]
        root_logits = self.forward_ragged(ids, pos, batch_slots(brow_np, req, pos, bs, owned), qlens, root_pos + 1,
                                    block_rows, ends - 1, None, 0, self._catch_up_features(jobs))
        for j in jobs:
            j.state.draft_len = j.root_pos + 1
        V = root_logits.shape[-1]
        # a head's hidden state of each request's current draft beams [R, W, H] (slot 0: the root)
        hid = None
        if self.head:
            hid = torch.zeros(R, W, self.head_hidden(), dtype=self.dtype, device=dev)
            hid[:, 0] = self.last_hidden[torch.from_numpy(ends - 1).to(dev)]
        full = torch.zeros(R, W, V, device=dev)
        full[:, 0] = root_logits
        # requests with penalties or logits rules: each slot's rows processed by its own history before each beam step
        pen = draft_rows(jobs, W, V, dev)
        scores = torch.zeros(R, W, device=dev)
        live = torch.zeros(R, W, dtype=torch.bool, device=dev)
        live[:, 0] = True
        depth_np = np.array([j.depth for j in jobs], dtype=np.int64)  # host copy of ``depth``
        depth = torch.from_numpy(depth_np.copy()).to(dev)
        eos = (params.eos >= 0)[:, None]
        live_np = np.ones((R, W), dtype=bool)  # host copy of the last step's continuing draws (read from depth 2 on)
        steps, valid_np, parent_np, token_np = [], [], [], []  # the steps' valid, parent and token slots, numpy [R, W]
        # mixed with the draft-free sources (mixing.py): per request, per slot, the slot's last tokens (None: no
        # beam there); the general loop only (it reads each depth's draws, which the next contexts need)
        ctx = [[j.tail] + [None] * (W - 1) for j in jobs] if any(j.tail is not None for j in jobs) else None
        drafted = chains = params.facts.width_max == 1 and self.chain_drafting and ctx is None
        if chains:  # every request at width 1: the same draws, one host copy in all
            steps, valid_np, parent_np, token_np, depth_np, depth = yield from self._draft_chains(
                full, scores, live, params, depth_np, depth, L, root_pos, brow_np, bs, owned, block_rows, pen, hid)
        elif self.static_drafting and G > 1 and ctx is None:  # wider: the same draws, one host copy in all when the bet holds
            if self._static_skip:
                self._static_skip -= 1
            else:
                widths = np.array([j.state.width if j.width is None else j.width for j in jobs], dtype=np.int64)
                got = yield from self._draft_static(full, scores, live, params, widths, depth_np, depth, L, root_pos,
                                                    brow_np, bs, owned, block_rows,
                                                    pen.fork() if pen is not None else None, hid)
                self._static_backoff = 0 if got else min(max(2 * self._static_backoff, 1), 16)
                self._static_skip = self._static_backoff
                if got:
                    drafted = True
                    steps, valid_np, parent_np, token_np, depth_np, depth = got
                else:
                    self.static_misses += 1
        for d in range(1, 1 if drafted else G + 1):  # the general depth loop (skipped when drafted above)
            live = live & (depth >= d)[:, None]
            # a request whose beams all ended (EOS) stops its forest here, as the reference decoder does: ``live``
            # came from the last step's draws, whose host copy says which requests still have a live beam
            if d > 1:
                ended = ~live_np.any(1) & (depth_np >= d)
                if ended.any():
                    depth_np = np.where(ended, d - 1, depth_np)
                    depth = torch.from_numpy(depth_np.copy()).to(dev)
                if not (live_np.any(1) & (depth_np >= d)).any():
                    break
            if ctx is not None:
                full = mixing.mix(full.view(R * W, V), [None if c is None else jobs[r].state.sources.propose(c)
                                                       for r in range(R) for c in ctx[r]]).view(R, W, V)
            if pen is not None:
                full = pen.apply(full)
            st = beam_step(full, scores, live, params.with_(depth=depth), rng.forest_position(L - 1, d),
                           rng.Stream.DRAFT_DRAW)
            if pen is not None:
                pen.advance(st.parent, st.token)
            st.valid &= (depth >= d)[:, None]
            steps.append(st)
            cont = st.valid & ~(eos & (st.token == params.eos[:, None]))
            # one copy to the host per depth: the draws' valid, parent and token slots and which continue
            ws = st.valid.shape[1]
            host, = yield [torch.cat([st.valid.long(), st.parent, st.token, cont.long()], 1)]
            host = host.numpy()
            v_np, p_np, t_np = host[:, :ws].astype(bool), host[:, ws : 2 * ws], host[:, 2 * ws : 3 * ws]
            live_np = _pad_cols(host[:, 3 * ws :].astype(bool), W, False)
            if ctx is not None:  # the draws' contexts: their parents' and their token
                ctx = [[(ctx[r][p_np[r, s]] + [int(t_np[r, s])])[-NMAX:] if live_np[r, s] and ctx[r][p_np[r, s]]
                        is not None else None for s in range(W)] for r in range(R)]
            valid_np.append(_pad_cols(v_np, W, False))
            parent_np.append(_pad_cols(p_np, W, 0))
            token_np.append(_pad_cols(t_np, W, 0))
            # the next step's beams are this step's draws, in W slots (draws of narrower requests padded)
            pad = W - st.score.shape[1]
            scores = torch.nn.functional.pad(st.score, (0, pad), value=NEG_INF)
            live = torch.nn.functional.pad(cont, (0, pad), value=False)
            deeper = depth_np > d
            if not deeper.any():
                continue
            # pass d: the depth-d nodes of the requests that go deeper, under forest attention; query tokens in
            # (request, slot) order
            # the layout of the forest so far (Forest.from_steps(steps, depth.clamp(max=d)) then forest_layout's
            # compact and parent indices), in numpy
            pv = np.stack(valid_np, 1) & (np.arange(d)[None, :] < np.minimum(depth_np, d)[:, None])[:, :, None]
            compact, num_nodes, parents = _layout_np(pv, np.stack(parent_np, 1))
            ri, si = np.nonzero(v_np & deeper[:, None])
            comp = compact[ri, d - 1, si]
            sub = np.nonzero(deeper)[0]
            qlens = np.bincount(ri, minlength=R)[sub]
            node_pos = root_pos[ri] + 1 + comp  # where node (d, s) is written
            entries, t = [], 0
            comp_l = comp.tolist()
            for k, i in enumerate(sub.tolist()):
                q = int(qlens[k])
                entries.append(drop_chain_queries(ForestEntry(
                    req_row=k, token_rows=list(range(t, t + q)), context_len=int(root_pos[i]) + 1,
                    parents=parents[i][pv[i]].tolist(), query_nodes=comp_l[t : t + q])))
                t += q
            fb = ForestBatch.build(entries, max_nodes=W * G)
            ri_t, si_t = torch.from_numpy(ri).to(dev), torch.from_numpy(si).to(dev)
            lg = self.forward_ragged(t_np[ri, si], root_pos[ri] + d, batch_slots(brow_np, ri, node_pos, bs, owned),
                               qlens, root_pos[sub] + 1 + num_nodes[sub], block_rows[torch.from_numpy(sub)],
                               np.arange(t), fb, d,
                               hid[ri_t, torch.from_numpy(p_np[ri, si]).to(dev)] if hid is not None else None)
            full = torch.zeros(R, W, V, device=dev)
            full[ri_t, si_t] = lg
            if hid is not None:  # the depth-d nodes' own hidden states: the next depth's inputs
                hid = torch.zeros_like(hid)
                hid[ri_t, si_t] = self.last_hidden[:t]
        if not steps:
            return [None] * R
        forest = Forest.from_steps(steps, depth, W)
        for st in steps:  # their joints are the forest's now: one copy of the draft joints is held, not two
            st.joint = None
        # each request's nodes in compact (depth-major) order: forest_layout's token, parent and depth rows, in numpy
        g = len(steps)
        fv = np.stack(valid_np, 1)[:, :g] & (np.arange(g)[None, :] < depth_np[:, None])[:, :, None]
        _, _, parents = _layout_np(fv, np.stack(parent_np, 1))
        tokens = np.stack(token_np, 1)
        fdepth = np.repeat(np.arange(1, g + 1)[:, None], W, 1)
        padded = _pad_forest(forest, self.cfg.depth, W, V)
        has = (depth_np > 0) & fv.reshape(R, -1).any(1)
        vdepth_np = np.minimum(fv.any(2).sum(1), depth_np)  # what sampler.truncate gives when uncut
        vdepth = torch.from_numpy(vdepth_np).to(dev)
        out = []
        for i, (j, ok) in enumerate(zip(jobs, has.tolist())):
            if not ok:
                out.append(None)
                continue
            v = fv[i]
            f = Forest(parent=padded.parent[i : i + 1], token=padded.token[i : i + 1], valid=padded.valid[i : i + 1],
                       score=padded.score[i : i + 1], q_joint=padded.q_joint[i : i + 1],
                       depth=forest.depth[i : i + 1].clone())
            uncut = Forest(parent=f.parent, token=f.token, valid=f.valid, score=f.score, q_joint=f.q_joint,
                           depth=vdepth[i : i + 1])
            out.append(PendingForest(forest=f, tokens=tokens[i][v].tolist(), parents=parents[i][v].tolist(),
                                     depths=fdepth[v].tolist(), root_pos=j.root_pos, uncut=uncut,
                                     depth=int(depth_np[i])))
        return out

    def _catch_up_features(self, jobs: list[DraftJob]) -> torch.Tensor | None:
        """A head's inputs of the catch-up rows (positions ``[start, root_pos]``): the target's features of positions
        ``[start - 1, root_pos)``; each request keeps those from ``root_pos`` on (the next catch-up's first)."""
        if not self.head:
            return None
        out = []
        for j in jobs:
            st = j.state
            out.append(head_mod.window(st.head_features, j.start - 1, j.root_pos, self.head_hidden(), self.device,
                                       self.dtype))
            st.head_features = st.head_features.trim(j.root_pos) if st.head_features is not None else None
        return torch.cat(out)

    def beam_features(self, st: RequestState, slots: list[int]) -> torch.Tensor:
        """A head's inputs of a beam request's catch-up rows: the target's features of their parent slots (zeros where
        none is kept: slot -1, a re-layout)."""
        f = st.head_features
        if f is None or not hasattr(f, "gather"):
            return torch.zeros(len(slots), self.head_hidden(), dtype=self.dtype, device=self.device)
        return f.gather(slots)

    def _draft_chains(self, full, scores, live, params, depth_np, depth, L, root_pos, brow_np, bs, owned, block_rows,
                      pen: DraftRows | None = None, hid: torch.Tensor | None = None):
        """The depth loop at width 1 with no host read until the end (draws and token ids stay on the device); an ended
        chain is masked, not skipped: the same draws, bit for bit. Returns (steps, valid, parent, token slots per depth
        as numpy [R, W], the final depths in numpy and on the device)."""
        dev = self.device
        G, W = int(depth_np.max()), full.shape[1]
        eos = (params.eos >= 0)[:, None]
        steps, cont = [], None
        for d in range(1, G + 1):
            live = live & (depth >= d)[:, None]
            if d > 1:  # a request whose chain ended stops its forest at depth d - 1 (the loop's ``ended``)
                depth = torch.where(~cont.any(1) & (depth >= d), d - 1, depth)
            if pen is not None:
                full = pen.apply(full)
            st = beam_step(full, scores, live, params.with_(depth=depth), rng.forest_position(L - 1, d),
                           rng.Stream.DRAFT_DRAW)
            if pen is not None:
                pen.advance(st.parent, st.token)
            st.valid &= (depth >= d)[:, None]
            steps.append(st)
            cont = st.valid & ~(eos & (st.token == params.eos[:, None]))
            scores = torch.nn.functional.pad(st.score, (0, W - 1), value=NEG_INF)
            live = torch.nn.functional.pad(cont, (0, W - 1), value=False)
            sub = np.nonzero(depth_np > d)[0]  # planned deeper: pass d over their depth-d node
            if not sub.size:
                continue
            node_pos = root_pos[sub] + d  # a chain's node d sits at position root + d (no forest batch: causal)
            sub_t = torch.from_numpy(sub)
            lg = self.forward_ragged(st.token[sub_t.to(dev), 0], node_pos, batch_slots(brow_np, sub, node_pos, bs, owned),
                               np.ones(sub.size, dtype=np.int64), node_pos + 1, block_rows[sub_t], np.arange(sub.size),
                               None, d, hid[sub_t.to(dev), 0] if hid is not None else None)
            full = torch.zeros_like(full)
            full[sub_t.to(dev), 0] = lg
            if hid is not None:  # a chain's node d: the next depth's input
                hid = torch.zeros_like(hid)
                hid[sub_t.to(dev), 0] = self.last_hidden
        host = torch.cat([torch.cat([st.valid.long(), st.parent, st.token], 1) for st in steps] + [depth[:, None]], 1)
        host, = yield [host]  # the one copy
        host = host.numpy()
        per = [host[:, 3 * k : 3 * k + 3] for k in range(len(steps))]
        return (steps, [_pad_cols(p[:, :1].astype(bool), W, False) for p in per],
                [_pad_cols(p[:, 1:2], W, 0) for p in per], [_pad_cols(p[:, 2:3], W, 0) for p in per],
                host[:, -1].copy(), depth)


    def _draft_static(self, full, scores, live, params, widths, depth_np, depth, L, root_pos, brow_np, bs, owned,
                      block_rows, pen: DraftRows | None = None, hid: torch.Tensor | None = None):
        """The depth loop at any width with one host read at the end, on a bet that every request's draws fill its width
        (``widths``) wherever a pass runs, so the layout is known in advance. None when the bet failed (the caller runs
        the general loop: the same keyed draws), else what :meth:`_draft_chains` returns."""
        dev = self.device
        R, W, V = full.shape
        G = int(depth_np.max())
        eos = (params.eos >= 0)[:, None]
        w_dev = torch.from_numpy(widths).to(dev)
        cpar = torch.full((R, G, W), -1, dtype=torch.int64, device=dev)  # compact parent of node (d, s)
        steps, cont = [], None
        for d in range(1, G + 1):
            live = live & (depth >= d)[:, None]
            if d > 1:  # a request whose draws all ended stops its forest at depth d - 1 (the loop's ``ended``)
                depth = torch.where(~cont.any(1) & (depth >= d), d - 1, depth)
            if pen is not None:
                full = pen.apply(full)
            st = beam_step(full, scores, live, params.with_(depth=depth), rng.forest_position(L - 1, d),
                           rng.Stream.DRAFT_DRAW)
            if pen is not None:
                pen.advance(st.parent, st.token)
            st.valid &= (depth >= d)[:, None]
            steps.append(st)
            cont = st.valid & ~(eos & (st.token == params.eos[:, None]))
            ws = st.valid.shape[1]
            scores = torch.nn.functional.pad(st.score, (0, W - ws), value=NEG_INF)
            live = torch.nn.functional.pad(cont, (0, W - ws), value=False)
            if d > 1:  # the draws' parents are the depth d - 1 nodes in slot order
                cpar[:, d - 1, :ws] = (d - 2) * w_dev[:, None] + torch.minimum(st.parent, w_dev[:, None] - 1)
            sub = np.nonzero(depth_np > d)[0]  # planned deeper: pass d over their depth-d nodes
            if not sub.size:
                continue
            wsub = widths[sub]
            ri = np.repeat(sub, wsub)
            si = np.concatenate([np.arange(w) for w in wsub.tolist()])
            node_pos = root_pos[ri] + 1 + (d - 1) * widths[ri] + si  # where node (d, s) is written
            # the forest batch: a width-1 request's nodes form a chain (no forest query); a wider one's first node
            # hangs off the context alone (``drop_chain_queries``: its causal outputs stand)
            req_rows, rows, cu, ctx, flen, gather, query, t, n = [], [], [0], [], [], [], [], 0, 0
            for k, i in enumerate(sub.tolist()):
                w = int(widths[i])
                if w > 1:
                    first = 1 if d == 1 else 0
                    req_rows.append(k)
                    rows.extend(range(t + first, t + w))
                    cu.append(cu[-1] + w - first)
                    ctx.append(int(root_pos[i]) + 1)
                    flen.append(d * w)
                    gather.extend(i * G * W + dd * W + s for dd in range(d) for s in range(w))
                    query.extend(n + (d - 1) * w + s for s in range(first, w))
                    n += d * w
                t += w
            fb = None
            if rows:
                par = cpar.reshape(-1)[torch.tensor(gather, dtype=torch.int64, device=dev)]
                fb = ForestBatch.assemble(req_rows, rows, cu, ctx, flen, par, query, max_nodes=W * G)
            ri_t, si_t = torch.from_numpy(ri).to(dev), torch.from_numpy(si).to(dev)
            lg = self.forward_ragged(st.token[ri_t, si_t], root_pos[ri] + d, batch_slots(brow_np, ri, node_pos, bs, owned),
                               wsub, root_pos[sub] + 1 + d * wsub, block_rows[torch.from_numpy(sub)],
                               np.arange(t), fb, d, hid[ri_t, st.parent[ri_t, si_t]] if hid is not None else None)
            full = torch.zeros(R, W, V, device=dev)
            full[ri_t, si_t] = lg
            if hid is not None:  # the depth-d nodes' own hidden states: the next depth's inputs
                hid = torch.zeros_like(hid)
                hid[ri_t, si_t] = self.last_hidden[:t]
        ws = steps[0].valid.shape[1]
        host = torch.cat([torch.cat([st.valid.long(), st.parent, st.token], 1) for st in steps] + [depth[:, None]], 1)
        host, = yield [host]  # the one copy
        host = host.numpy()
        per = [host[:, 3 * ws * k : 3 * ws * (k + 1)] for k in range(len(steps))]
        valid = np.stack([p[:, :ws].astype(bool) for p in per], 1)  # [R, G, ws]
        final = host[:, -1].copy()
        # the bet: full draws at every depth d <= min(planned - 1, final depth), the layouts the passes assumed
        ran = np.arange(1, G + 1)[None, :] <= np.minimum(depth_np - 1, final)[:, None]
        full_w = np.arange(ws)[None, None, :] < widths[:, None, None]
        if (ran[:, :, None] & (valid != full_w)).any():
            return None
        return (steps, [_pad_cols(p[:, :ws].astype(bool), W, False) for p in per],
                [_pad_cols(p[:, ws : 2 * ws], W, 0) for p in per], [_pad_cols(p[:, 2 * ws :], W, 0) for p in per],
                final, depth)


def draft_rows(jobs: list[DraftJob], width: int, vocab: int, device) -> DraftRows | None:
    """The processing of one drafting call's draft rows (``processors.DraftRows``: the penalties of the jobs whose
    requests have them, the logits rules and grammar masks of those that have them), or None when no job has any."""
    pen_sel = [k for k, j in enumerate(jobs) if j.history is not None and j.state.penalties is not None]
    rule_sel = [k for k, j in enumerate(jobs) if j.history is not None and j.state.rules is not None]
    gram_sel = [k for k, j in enumerate(jobs) if j.history is not None and j.state.grammar is not None]
    if not pen_sel and not rule_sel and not gram_sel:
        return None
    pen = DraftPenalties(pen_sel, [jobs[k].history[0] for k in pen_sel], [jobs[k].history[1] for k in pen_sel],
                         [jobs[k].state.penalties for k in pen_sel], width, vocab, device) if pen_sel else None
    rules = DraftRules(rule_sel, [jobs[k].history[1] for k in rule_sel], [jobs[k].state.rules for k in rule_sel],
                       width, vocab, device) if rule_sel else None
    gram = DraftGrammar(gram_sel, [jobs[k].history[1] for k in gram_sel], [jobs[k].state.grammar for k in gram_sel],
                        width) if gram_sel else None
    return DraftRows(pen, rules, gram)


def _pad_forest(forest: Forest, G: int, W: int, V: int) -> Forest:
    """A batched forest padded to [R, G, W] (joint [R, G, W * V]); row i is request i's forest (itself when nothing
    needs padding: no copy of the joints)."""
    g = forest.parent.shape[1]
    if g == G and forest.parent.shape[2] == W and forest.q_joint.shape[2] == W * V:
        return forest
    def pad(t, fill):
        return torch.nn.functional.pad(t, (0, W - t.shape[2], 0, G - g), value=fill)
    qj = torch.nn.functional.pad(forest.q_joint, (0, W * V - forest.q_joint.shape[2], 0, G - g), value=NEG_INF)
    return Forest(parent=pad(forest.parent, 0), token=pad(forest.token, 0), valid=pad(forest.valid, False),
                  score=pad(forest.score, NEG_INF), q_joint=qj, depth=forest.depth)
