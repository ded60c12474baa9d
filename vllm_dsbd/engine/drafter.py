"""The DSBD drafter: beam-samples a forest with the draft model for every decoding request.

It derives from vLLM's ``DraftModelProposer`` for everything vLLM expects of a draft-model proposer (loading the
draft model next to the target, its attention groups and KV-cache group, profiling dummy runs) and replaces the
proposal itself (:meth:`DSBDDrafter.propose_forests`), which per batch of requests runs:

* pass 0 ("catch-up", causal attention): the tokens whose draft K/V are missing, from ``draft_len`` to the root (the
  last emitted token) at their linear positions: usually the root alone, plus the last accepted node when the whole
  depth was accepted, or the whole prompt after the prefill. Its logits at the root give depth 1.
* depth d = 1..G: ``core.beam_step`` on the draft logits at the live beams (W draws without replacement from the
  draft's joint, keyed randomness ``(seed, position, DRAFT_DRAW)``); then, if deeper depths are needed, pass d runs the
  draft on the depth-d nodes (W query tokens per request) under forest attention: node (d, j) at position
  root + d and at slot ``L + compact index`` (L = root position + 1), seeing the context and its ancestors only.

Forest node (d, j) of a request is written where the target will write it (slot of position L + its compact index),
so after verification one commit moves the accepted path's K/V of target and draft layers alike.

An engine without a draft model gets :class:`NoDrafter` instead (nothing to load, no forest to draft).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.core import rng
from vllm_dsbd.core.forest import Forest, forest_layout
from vllm_dsbd.core.joint import NEG_INF
from vllm_dsbd.core.sampling import beam_step

from .attention import ForestBatch, forest_scope
from .kv import slots_of
from .sampler import _params
from .state import PendingForest, RequestState


logger = logging.getLogger("vllm.vllm_dsbd.engine")


class NoDrafter:
    """The drafter of a DSBD engine without a draft model: loads nothing and drafts no forest (its requests have
    depth 0, so the runner never gives it a job)."""

    def __init__(self, *args, **kwargs):
        pass

    def load_model(self, target_model) -> None:  # vLLM's runner calls it after loading the target
        logger.info("DSBD: engine without a draft model: no draft to load")

    def propose(self, *args, **kwargs):  # what vLLM's custom-class proposer check asks for; never called
        raise RuntimeError("DSBD engine without a draft model: there is nothing to propose")

    def propose_forests(self, jobs: list) -> list:
        if jobs:
            raise RuntimeError("DSBD engine without a draft model was asked to draft a forest")
        return []


@contextlib.contextmanager
def vllm_runner_init(spec, has_draft: bool):
    """Around vLLM's runner ``__init__``: an engine without a draft model is seen as vLLM's method "custom_class" with
    :class:`NoDrafter` as the class. vLLM's runner picks its drafter by method and raises "Unknown speculative
    decoding method" for one it does not know (gpu_model_runner.py:595-653); "dsbd" without a draft is not a
    draft-model engine (patch ``uses_draft_model``). Nothing else in that ``__init__`` (nor in the worker's
    ``init_device``, which builds vLLM's runner: ``worker.py``) reads the method or the model."""
    if has_draft:
        yield
        return
    method, model = spec.method, spec.model
    spec.method, spec.model = "custom_class", f"{__name__}.{NoDrafter.__name__}"
    try:
        yield
    finally:
        spec.method, spec.model = method, model


@dataclass
class DraftJob:
    state: RequestState
    row: int  # the request's row in the runner's input batch (its block-table row)
    tokens: list[int]  # tokens at positions [start, root_pos]: the catch-up pass
    start: int
    root_pos: int
    depth: int  # >= 1


class DSBDDrafter(DraftModelProposer):
    def __init__(self, vllm_config, device, runner, cfg: DSBDConfig):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.cfg = cfg
        self.runner = runner
        self.forward_passes = 0  # statistics

    # ------------------------------------------------------------------------------------------------------------
    def _block_table(self):
        bt = self.runner.input_batch.block_table[self.kv_cache_gid]
        return bt.block_table.cpu, bt.block_size, bt.num_blocks_per_row

    def _forward(self, input_ids: list[int], positions: list[int], slots: np.ndarray, query_lens: list[int],
                 seq_lens: list[int], block_rows: torch.Tensor, sample_idx: list[int],
                 forest: ForestBatch | None, draft_index: int) -> torch.Tensor:
        """One draft forward pass over a ragged batch (``draft_index``: the forest depth it drafts, 0 = catch-up);
        returns the draft logits [len(sample_idx), V] (float32)."""
        dev = self.device
        T, R = len(input_ids), len(query_lens)
        qsl = torch.zeros(R + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        slot_t = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(dev)
        cad = CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq.to(dev), num_reqs=R,
            num_actual_tokens=T, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            block_table_tensor=block_rows.to(dev), slot_mapping=slot_t, causal=True, positions=pos,
            _seq_lens_cpu=seq, _num_computed_tokens_cpu=seq - (qsl[1:] - qsl[:-1]),
            seq_lens_cpu_upper_bound=seq)
        per_layer = {}
        for group in self.draft_attn_groups:
            # vLLM's own proposers' entry (``llm_base_proposer``): a fast build, which on FlashAttention 3 skips the
            # ahead-of-time schedule. A full build's schedule, made for this batch, was rejected by FA3 on an H100
            # ("scheduler_metadata must have shape (metadata_size)"; NOTES.md "GPU"). Not yet re-run on a GPU.
            md = group.get_metadata_builder().build_for_drafting(common_attn_metadata=cad, draft_index=draft_index)
            for name in group.layer_names:
                per_layer[name] = md
        ids = torch.tensor(input_ids, dtype=torch.int32, device=dev)
        with set_forward_context(per_layer, self.vllm_config, num_tokens=T,
                                 slot_mapping={n: slot_t for n in self._draft_attn_layer_names}), forest_scope(forest):
            hidden = self.model(input_ids=ids, positions=pos, inputs_embeds=None)
        self.forward_passes += 1
        idx = torch.tensor(sample_idx, dtype=torch.int64, device=dev)
        return self.model.compute_logits(hidden[idx]).float().cpu()

    # ------------------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_forests(self, jobs: list[DraftJob]) -> list[PendingForest]:
        """Drafts one forest per job (all jobs batched: one draft pass per depth). Updates each state's draft_len."""
        if not jobs:
            return []
        R, W, G = len(jobs), self.cfg.width, max(j.depth for j in jobs)
        table, bs, owned = self._block_table()
        rows = torch.tensor([j.row for j in jobs], dtype=torch.int64)
        owned = [int(owned[j.row]) for j in jobs]
        block_rows = table[rows]
        brow_np = block_rows.numpy()
        params = _params([j.state for j in jobs], [j.depth for j in jobs], self.cfg)
        L = torch.tensor([j.root_pos + 1 for j in jobs], dtype=torch.int64)

        # pass 0: catch-up, plain causal attention; logits at each root
        ids, pos, slots, qlens = [], [], [], []
        for i, j in enumerate(jobs):
            p = list(range(j.start, j.root_pos + 1))
            assert len(p) == len(j.tokens) and p, (j.start, j.root_pos, len(j.tokens))
            ids += j.tokens
            pos += p
            slots.append(slots_of(brow_np[i], p, bs, owned[i]))
            qlens.append(len(p))
        sample = list(np.cumsum(qlens) - 1)
        root_logits = self._forward(ids, pos, np.concatenate(slots), qlens, [j.root_pos + 1 for j in jobs],
                                    block_rows, sample, None, 0)
        for j in jobs:
            j.state.draft_len = j.root_pos + 1
        V = root_logits.shape[-1]
        full = torch.zeros(R, W, V)
        full[:, 0] = root_logits
        scores = torch.zeros(R, W)
        live = torch.zeros(R, W, dtype=torch.bool)
        live[:, 0] = True
        depth = params.depth.clone()
        steps = []
        for d in range(1, G + 1):
            live = live & (depth >= d)[:, None]
            # a request whose beams all ended (EOS) stops its forest here, as the reference decoder does
            depth = torch.where(~live.any(1) & (depth >= d), d - 1, depth)
            if not bool(live.any()):
                break
            st = beam_step(full, scores, live, params.with_(depth=depth), L + d - 1, rng.Stream.DRAFT_DRAW)
            st.valid &= (depth >= d)[:, None]
            steps.append(st)
            not_eos = ~((params.eos >= 0)[:, None] & (st.token == params.eos[:, None]))
            # the next step's beams are this step's draws, in W slots (draws of narrower requests padded)
            pad = W - st.score.shape[1]
            scores = torch.nn.functional.pad(st.score, (0, pad), value=NEG_INF)
            live = torch.nn.functional.pad(st.valid & not_eos, (0, pad), value=False)
            if not bool((depth > d).any()):
                continue
            # pass d: the depth-d nodes of the requests that go deeper, under forest attention
            part = Forest.from_steps(steps, depth.clamp(max=d), W)
            lay = forest_layout(part, L)
            ids, pos, slots, qlens, seqs, entries, which = [], [], [], [], [], [], []
            t = 0
            for i, j in enumerate(jobs):
                if int(depth[i]) <= d:
                    continue
                js = st.valid[i].nonzero().flatten().tolist()
                n = int(lay.num_nodes[i])
                comp = [int(lay.compact[i, d - 1, s]) for s in js]
                ids += [int(st.token[i, s]) for s in js]
                pos += [j.root_pos + d] * len(js)
                slots.append(slots_of(brow_np[i], [j.root_pos + 1 + c for c in comp], bs, owned[i]))
                qlens.append(len(js))
                seqs.append(j.root_pos + 1 + n)
                entries.append((len(entries), list(range(t, t + len(js))), j.root_pos + 1,
                                lay.parent[i, :n].tolist(), comp))
                which += [(i, s) for s in js]
                t += len(js)
            sub_rows = torch.tensor([i for i, j in enumerate(jobs) if int(depth[i]) > d], dtype=torch.int64)
            fb = ForestBatch.build(entries, max_nodes=W * G)
            lg = self._forward(ids, pos, np.concatenate(slots), qlens, seqs, block_rows[sub_rows],
                               list(range(t)), fb, d)
            full = torch.zeros(R, W, V)
            for (i, s), row in zip(which, lg):
                full[i, s] = row
        forest = Forest.from_steps(steps, depth, W) if steps else None
        # one layout for the whole batch: each request's row is its own forest's layout (rows are independent)
        lay = forest_layout(forest, L) if forest is not None else None
        out = []
        for i, j in enumerate(jobs):
            f = _request_forest(forest, i, self.cfg.depth, W, V) if forest is not None else None
            if f is None or int(f.depth[0]) == 0 or not bool(f.valid.any()):
                out.append(None)
                continue
            n = int(lay.num_nodes[i])
            out.append(PendingForest(forest=f, tokens=lay.token[i, :n].tolist(), parents=lay.parent[i, :n].tolist(),
                                     depths=lay.depth[i, :n].tolist(), root_pos=j.root_pos))
        return out


def _request_forest(forest: Forest, i: int, G: int, W: int, V: int) -> Forest:
    """Row i of a batched forest, padded to [1, G, W] (joint [1, G, W * V])."""
    g = forest.parent.shape[1]
    def pad(t, fill):
        t = t[i : i + 1]
        return torch.nn.functional.pad(t, (0, W - t.shape[2], 0, G - g), value=fill)
    qj = forest.q_joint[i : i + 1]
    qj = torch.nn.functional.pad(qj, (0, W * V - qj.shape[2], 0, G - g), value=NEG_INF)
    return Forest(parent=pad(forest.parent, 0), token=pad(forest.token, 0), valid=pad(forest.valid, False),
                  score=pad(forest.score, NEG_INF), q_joint=qj, depth=forest.depth[i : i + 1].clone())
