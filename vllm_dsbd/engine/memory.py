"""DSBD's per-step working memory inside vLLM's budget: bounded by chunking, and reserved in vLLM's profiling run.

A DSBD step allocates float32 blocks that grow with the batch: verification's target rows ``[R, G + 1, W, V]``, the
forests' draft joints ``[R, G, W * V]`` (kept from one step to the next: Q of the drafts being verified), the per-layer
joints and their temporaries. vLLM sizes the KV cache from the peak its profiling run sees (``profile_run``: the model
at ``max_num_batched_tokens``, its own sampler at ``max_num_seqs``), which runs none of DSBD's work, so without more a
GPU engine sized by ``--gpu-memory-utilization`` could run out of memory at a large batch. Two parts:

* a bound: plain requests' verification runs over chunks of at most ``chunks.verify_chunk`` requests, sized so that
  a chunk's working set stays under ``chunks.VERIFY_BUDGET`` elements (``sampler.verify``; each request's results do
  not depend on the others, so chunking changes no decision; a step reads the device once per chunk);
* an account: :func:`profile_step`, the DSBD runner's ``profile_run`` on a device, runs vLLM's profiling run inside a
  DSBD step's device work at ``max_num_seqs`` plain requests of full width and depth, for every engine that drafts
  (forests from the engine's own drafter: a draft model's real loops with random draft logits in place of its passes,
  whose own memory vLLM's drafter dummy run profiles, mixed with the sources where the engine mixes them; or the
  draft-free sources' from an index proposing full-width forests; held while vLLM's target pass runs; the recycle
  source's prompt chunk; one layer's forest-attention recompute over them at the longest context; the target's
  logits of every forest row; verification on them with the harvest beside it; the next forests drafted while these
  are still held), so the peak vLLM sizes the KV cache from covers the step.

This module is the account; ``chunks.py`` the bound (a leaf: the sampler imports it, and this module imports the
sampler and the drafter). Penalized requests' target rows are copied and penalized chunk by chunk
(``sampler.penalized_chunk``, sparse counts: ``penalties.penalize_rows_``), the copy counted in
``chunks.verify_blocks``; the draft's rows are penalized sparsely too (``penalties.DraftPenalties``); the dummy step's
requests carry penalties and the longest histories, in drafting and in verification. Beam requests' T = 0 top-N runs in
chunks of requests under the same budget (``beams.drafter.top_n``), which the dummy step reserves while it drafts; the
rest of beam requests' device work is not in the dummy step (docs/design/memory.md §3.8). On a GPU the budget follows
the free memory (``chunks.verify_budget``).
"""
from __future__ import annotations

import contextlib
import logging
import math

import numpy as np
import torch

logger = logging.getLogger("vllm.vllm_dsbd.engine")

# the dummy step in the profiling run on the CPU too (tests; on the CPU vLLM does not size the KV cache from the
# profile)
PROFILE_CPU = False


# ---------------------------------------------------------------------------------------------------------------
# the dummy step of the profiling run
@contextlib.contextmanager
def _dummy_draft_passes(drafter, rows: int, vocab: int, gen: torch.Generator):
    """The drafter with random draft logits instead of its model's passes (there is no KV cache yet while vLLM
    profiles, and the drafter's KV group is not known) and an all-zero block table of ``rows`` rows owning enough
    blocks for a forest; its statistics and back-off state put back after."""
    saved = {k: getattr(drafter, k) for k in ("forward_passes", "static_misses", "_static_skip", "_static_backoff")}
    dev = drafter.device
    block_size = 16
    blocks = -(-(drafter.cfg.num_speculative_slots + 2) // block_size)

    def forward_ragged(input_ids, positions, slots, query_lens, seq_lens, block_rows, sample_idx, forest, index,
                       hidden=None):
        if getattr(drafter, "head", False):  # an EAGLE-3 head's hidden states, read by the next depth
            drafter.last_hidden = torch.zeros(len(input_ids), drafter.head_hidden(), device=dev, dtype=drafter.dtype)
        return torch.randn(len(sample_idx), vocab, device=dev, generator=gen) * 4

    def block_table_host():
        return torch.zeros(rows, blocks, dtype=torch.int32), block_size, np.full(rows, blocks)

    drafter.forward_ragged, drafter.block_table_host = forward_ragged, block_table_host
    try:
        yield
    finally:
        del drafter.forward_ragged, drafter.block_table_host  # the class's methods again
        for k, v in saved.items():
            setattr(drafter, k, v)


# the dummy requests' draft-free candidates: these tokens after any context of them (so every node of every depth
# has RECYCLE_K candidates: full-width forests)
_CANDIDATES = 8


def _full_sources(cfg, vocab: int):
    """A source index under which every context of the dummy forests proposes ``_CANDIDATES`` tokens (a recycled row
    after each pair and each single one of them): the draft-free sources' widest forests."""
    from vllm_dsbd.core.sources import SourceIndex

    src = SourceIndex(recycle=True, lookup="lookup" in cfg.sources)
    toks = list(range(min(_CANDIDATES, vocab)))
    logp = [-math.log(len(toks))] * len(toks)
    for a in toks:
        src.add_row([a], toks, logp)
        for b in toks:
            src.add_row([a, b], toks, logp)
    return src


def _unread_context(vocab: int) -> list[int]:
    """The context the dummy harvests key their rows by: one the dummy forests never look up (their tokens are the
    candidates), so the next forests stay full."""
    return [vocab - 1, vocab - 1]


def _states(num: int, width: int, vocab: int, cfg=None):
    """``num`` plain requests of the widest settings: T = 1 with top-k and top-p (the joint's sort and top-k paths),
    all three penalties (the draft's penalized rows, verification's penalized copy), and the logits rules (the draft
    rows' clones before and after the penalties, which a grammar's clone matches: ``processors.DraftRows``; min_p,
    a whitelist, a bias, min_tokens on the target's rows). With draft-free sources (``cfg.free_sources``) each a
    source index proposing full-width forests (:func:`_full_sources`)."""
    from .penalties import RequestPenalties
    from .processors import RequestRules
    from .state import RequestState

    rules = RequestRules(allowed=tuple(range(max(vocab // 2, min(_CANDIDATES, vocab)))), bad_words=((1, 2),),
                         min_tokens=1 << 30, stop_ids=(vocab - 1,), bias=((0, 0.5),), min_p=0.01, temperature=1.0)
    out = [RequestState(req_id=f"dsbd-profile-{i}", seed=i, width=width, temperature=1.0, top_k=50, top_p=0.9,
                        eos=-1, max_tokens=None, penalties=RequestPenalties(0.5, 0.5, 1.2), rules=rules)
           for i in range(num)]
    if cfg is not None and cfg.free_sources:
        for st in out:
            st.sources = _full_sources(cfg, vocab)
    return out


def _history(vocab: int, max_len: int) -> list[int]:
    """A request's prompt + output as long and as varied as they can be: min(V, max_model_len) distinct tokens."""
    return list(range(min(vocab, max_len)))


def _penalized(plan: list, vocab: int, max_len: int) -> list:
    """The penalties' view of the dummy plan, each request with the longest history (:func:`_history`): the widest
    sparse gather."""
    from .penalties import TargetRows

    hist = _history(vocab, max_len)
    return [TargetRows(r.first_row, r.forest.tokens if r.forest else [], r.forest.parents if r.forest else [],
                       hist[:1], hist[1:], r.state.penalties, r.state.rules) for r in plan]


def _forests(runner, states, vocab: int, gen: torch.Generator) -> list:
    """The dummy requests' forests from the engine's own drafter: a draft model's loops on random draft logits, mixed
    with the sources where the engine mixes them (the general loop, ``mixing.mix``), or the draft-free sources'."""
    from . import reads
    from .drafter import DraftJob

    cfg = runner.dsbd_cfg
    hist = _history(vocab, runner.model_config.max_model_len)  # the draft's penalties over the longest histories
    mixed = cfg.draft and bool(cfg.free_sources)
    jobs = [DraftJob(state=st, row=i, tokens=[0], start=0, root_pos=0, depth=cfg.depth,
                     history=(hist[:1], hist[1:]) if st.penalties is not None else None, tail=[0] if mixed else None)
            for i, st in enumerate(states)]
    passes = (_dummy_draft_passes(runner.drafter, len(states), vocab, gen) if cfg.draft else contextlib.nullcontext())
    with passes:
        return reads.run(runner.drafter.propose_forests(jobs))


def _prompt_chunk(runner, states, vocab: int, gen: torch.Generator) -> None:
    """The recycle source's intake of a prefill's rows (``source_drafter.recycle_prompt``): the LM head over one chunk
    of ``PROMPT_CHUNK`` rows and its harvest, as a prefill step runs them after the target pass."""
    from .source_drafter import PROMPT_CHUNK, recycle_prompt

    n = min(PROMPT_CHUNK, runner.scheduler_config.max_num_batched_tokens)
    hidden = torch.rand(n, runner.model_config.get_hidden_size(), dtype=runner.dtype, device=runner.device,
                        generator=gen)
    recycle_prompt(runner.model, hidden, [(states[k % len(states)], k, _unread_context(vocab)) for k in range(n)],
                   runner.dsbd_verify_elements)


def forest_attention_run(runner, pending: list, gen: torch.Generator, context: int, cache_blocks: int, columns: int,
                         every_layer: bool):
    """A callable running the forest recompute (``attention.recompute_forest_outputs``, the implementation the layers
    were given; the forest metadata built first, as a pass builds it) over the dummy ``pending`` forests, each at
    ``context`` tokens of context (at most ``max_model_len`` less its forest), on a dummy cache of ``cache_blocks``
    blocks with a block table of ``columns`` columns (column k: block k modulo the cache), for the first attention
    layer or ``every_layer``; None where no layer recomputes or no forest is pending."""
    from .attention import ForestBatch, ForestEntry, drop_chain_queries, recompute_forest_outputs

    layers = [m for m in runner.compilation_config.static_forward_context.values()
              if getattr(getattr(m, "impl", None), "__dsbd_base__", None) is not None]
    forests = [pf for pf in pending if pf is not None]
    if not layers or not forests:
        return None
    layers = layers if every_layer else layers[:1]
    impl, dev = layers[0].impl, runner.device
    heads, kv_heads, head = impl.num_heads, impl.num_kv_heads, impl.head_size
    bs = runner.cache_config.block_size
    entries, t = [], 0
    for i, pf in enumerate(forests):
        n = len(pf.tokens)
        ctx = max(min(context, runner.model_config.max_model_len - n - 1), 1)
        entries.append(drop_chain_queries(ForestEntry(req_row=i, token_rows=list(range(t + 1, t + 1 + n)),
                                                      context_len=ctx, parents=pf.parents, query_nodes=list(range(n)))))
        t += 1 + n
    dtype = runner.kv_cache_dtype if isinstance(getattr(runner, "kv_cache_dtype", None), torch.dtype) else runner.dtype
    if torch.device(dev).type == "cpu":  # CPU_ATTN: [blocks, kv heads, block size, 2 * head] contiguous (kv.py)
        cache = torch.zeros(cache_blocks, kv_heads, bs, 2 * head, dtype=dtype, device=dev)
    else:  # the GPU backends' logical shape over NHD memory, as vLLM allocates it
        cache = torch.zeros(cache_blocks, bs, kv_heads, 2 * head, dtype=dtype, device=dev).transpose(1, 2)
    table = (torch.arange(columns, dtype=torch.int32, device=dev) % cache_blocks).repeat(len(forests), 1)
    query = torch.randn(t, heads, head, dtype=runner.dtype, device=dev, generator=gen)
    out = torch.zeros_like(query)
    max_nodes = runner.dsbd_cfg.forest_slots

    def run() -> None:
        batch = ForestBatch.build(entries, max_nodes=max_nodes)
        if batch is not None:
            for layer in layers:
                recompute_forest_outputs(batch, query, cache, table, layer.impl.scale, out,
                                         getattr(layer.impl, "_dsbd_forest_impl", None))

    return run


def _forest_attention(runner, pending: list, gen: torch.Generator) -> None:
    """One attention layer's forest recompute over the dummy forests at the longest context, on a one-block dummy
    cache: its working set (the CPU path's gathered K/V and scores; the Triton kernel's outputs) is sized by the
    requests, nodes and context lengths, not by the cache. The layers recompute one after the other, so one layer's is
    the pass's."""
    max_len = runner.model_config.max_model_len
    run = forest_attention_run(runner, pending, gen, max_len, 1, -(-max_len // runner.cache_config.block_size), False)
    if run is not None:
        run()


def verify_plan(states, pending: list, context_len: int) -> tuple[list, int]:
    """(the sampler's plan verifying the dummy ``pending`` forests of ``states``, its logits rows: a root and the
    forest's nodes per request)."""
    from . import sampler
    from .state import PendingForest

    plan, first = [], 0
    for st, pf in zip(states, pending):
        n = len(pf.tokens) if pf is not None else 0
        row = sampler.RowPlan(state=st, first_row=first, context_len=context_len)
        if pf is not None:
            cut = pf.uncut if pf.uncut is not None else sampler.truncate(pf.forest, 1, n)
            row.forest = PendingForest(forest=cut, tokens=pf.tokens, parents=pf.parents, depths=pf.depths,
                                       root_pos=0, depth=pf.depth)
            row.num_nodes = n
        plan.append(row)
        first += 1 + n
    return plan, first


def verify_dummy(runner, logits: torch.Tensor, plan: list, vocab: int, penalized=None) -> None:
    """Verification of the dummy ``plan`` on ``logits``, and the recycle source's harvest of every row beside it (as
    the runner's ``_sample`` runs them), keyed by a context the dummy forests never look up."""
    from . import reads, sampler
    from .source_drafter import harvest

    rows = []
    if "recycle" in runner.dsbd_cfg.free_sources:
        for r in plan:
            rows += [(r.state, r.first_row + c, _unread_context(vocab)) for c in range(1 + r.num_nodes)]
    reads.run(reads.gather(
        harvest(logits, rows, runner.dsbd_verify_elements) if rows else None,
        sampler.verify(logits, plan, runner.dsbd_cfg, chain_static=runner.dsbd_static,
                       forest_static=runner.dsbd_static, fused=runner.dsbd_fused, budget=runner.dsbd_verify_elements,
                       penalized=penalized)))


@torch.inference_mode()
def profile_step(runner, target_pass) -> None:
    """vLLM's profiling run (``target_pass``: the model at ``max_num_batched_tokens`` and vLLM's sampler dummy) inside
    a DSBD step's device work on dummy data at ``max_num_seqs`` plain requests of full width and depth, so that the
    peak vLLM sizes the KV cache from covers the step (module docstring): the forests the step verifies are held during
    the target pass, then the logits of every forest row are verified and the next forests drafted while those are
    still held. An engine that drafts no forest just runs ``target_pass`` (one row per request, as vLLM's own
    dummy)."""
    cfg = runner.dsbd_cfg
    if not cfg.drafting:  # no forests: one row per request, as vLLM's own dummy
        return target_pass()
    R = runner.scheduler_config.max_num_seqs
    dev = runner.device
    logger.info("DSBD: the profiling run holds a dummy DSBD step of %d requests at width %d, depth %d, drafted from "
                "%s (its working memory is reserved before the KV cache is sized)", R, cfg.width, cfg.depth,
                "+".join(cfg.sources))
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden_size = runner.model_config.get_hidden_size()
    vocab = runner.model.compute_logits(torch.zeros(1, hidden_size, dtype=runner.dtype, device=dev)).shape[-1]
    states = _states(R, cfg.width, vocab, cfg)
    recycle = "recycle" in cfg.free_sources
    # the forests a step verifies (the drafter's real loops: random draft logits, or the sources' widest rows); held
    # until the step's end, as the runner's plan holds them while it drafts the next ones
    pending = _forests(runner, states, vocab, gen)
    out = target_pass()
    if recycle:  # a prefill's rows into the recycle table, after the target pass
        _prompt_chunk(runner, states, vocab, gen)
    _forest_attention(runner, pending, gen)  # what the target pass adds under forest attention, one layer's worth
    plan, first = verify_plan(states, pending, 1)
    # the target's logits of every row (root and forest nodes), from the model's own head
    hidden = torch.rand(first, hidden_size, dtype=runner.dtype, device=dev, generator=gen)
    logits = runner.model.compute_logits(hidden)
    del hidden
    verify_dummy(runner, logits, plan, vocab, _penalized(plan, vocab, runner.model_config.max_model_len))
    # the next step's forests while this step's (and, conservatively, its logits) are still held
    for st in states:
        st.draft_len = 0
    # beam requests' T = 0 top-N chunk (``beams.drafter.top_n``: at most the budget, and 4 elements a (beam, token)
    # pair of R requests' N beams) is drafted with them
    nodes = cfg.max_beam_nodes
    top_n_chunk = torch.empty(min(runner.dsbd_verify_elements, 4 * R * nodes * vocab), dtype=torch.float32,
                              device=dev)
    nxt = _forests(runner, states, vocab, gen)
    del nxt, logits, plan, pending, top_n_chunk
    return out
