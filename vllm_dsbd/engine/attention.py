"""Forest attention inside vLLM's attention layers (vLLM 0.26 has no tree attention).

:func:`install` gives every attention layer's ``impl`` an in-place subclass whose ``forward`` runs the base (causal)
attention, which also writes every query token's K/V, then, while a :class:`ForestBatch` is active
(:func:`forest_scope`), recomputes the forest query tokens' outputs under their ancestor masks over the paged cache and
writes them over the causal ones: the Triton kernel on CUDA, a batched torch path elsewhere (everywhere with
``VLLM_DSBD_FOREST_ATTENTION=torch``), the per-request reference with ``VLLM_DSBD_FOREST_ATTENTION=ref``. vLLM's
classes are not modified. How and why: docs/design/attention.md §3.5.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dsbd_kernels.forest_attention import ancestor_bitmask, forest_attention_ref
from dsbd_kernels.forest_attention.batched import BatchedPlan, forest_attention_planned, plan_forest_batched

from vllm_dsbd import envs

from .kv import layer_planes


class ForestEntry(NamedTuple):
    """One request's forest queries in a pass (:meth:`ForestBatch.build`). A NamedTuple: its fields have names, and
    it still indexes and unpacks as the 5-tuple it replaces."""

    req_row: int  # the request's row in the pass's attention metadata (its block-table row)
    token_rows: list[int]  # rows of the pass's query tokens that are forest nodes, in order (empty: no query)
    context_len: int  # tokens before the forest: positions [0, context_len) are visible to every node
    parents: list[int]  # compact parent index of each of the request's forest nodes so far (-1: off the context)
    query_nodes: list[int]  # the node each token row queries (``token_rows[i]`` queries ``query_nodes[i]``)


@dataclass
class ForestBatch:
    """The forest query tokens of one forward pass, for the requests that have them (Rf requests, Tf tokens).

    token_index: int64 [Tf] rows of the pass's query tokens that are forest nodes (grouped by request, in order).
    cu_seqlens_q: int32 [Rf + 1] offsets of each request's forest queries in ``token_index``.
    req_rows: int64 [Rf] row of each request in the pass's attention metadata (its block-table row).
    context_lens: int32 [Rf] tokens before the forest (positions [0, ctx) are visible to every node).
    forest_lens: int32 [Rf] forest nodes whose K/V are in the cache at logical positions ctx + j.
    ancestor_mask: int64 [Tf, words] ancestor-or-self bits of each query over its request's forest nodes.
    """

    token_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    req_rows: torch.Tensor
    context_lens: torch.Tensor
    forest_lens: torch.Tensor
    ancestor_mask: torch.Tensor

    @staticmethod
    def build(entries: list[ForestEntry], max_nodes: int) -> "ForestBatch | None":
        """From per-request :class:`ForestEntry` s (``parents``: compact parent index of each of the request's forest
        nodes so far, -1 = hangs off the context; ``query_nodes``: which of those nodes the pass queries,
        ``token_rows[i]`` queries node ``query_nodes[i]``). Returns None when no entry has a query token."""
        entries = [e for e in entries if e.token_rows]
        if not entries:
            return None
        rows, cu, ctx, flen, parents, query = [], [0], [], [], [], []
        for e in entries:
            query.extend(len(parents) + q for q in e.query_nodes)  # the node's row among all entries' nodes
            parents.extend(e.parents)
            rows.extend(e.token_rows)
            cu.append(cu[-1] + len(e.token_rows))
            ctx.append(e.context_len)
            flen.append(len(e.parents))
        return ForestBatch.assemble([e.req_row for e in entries], rows, cu, ctx, flen,
                                    torch.tensor(parents, dtype=torch.int64), query, max_nodes)

    @staticmethod
    def assemble(req_rows: list[int], token_rows: list[int], cu: list[int], ctx: list[int], flen: list[int],
                 parents: torch.Tensor, query: list[int], max_nodes: int) -> "ForestBatch":
        """The batch of :meth:`build`'s entries given as their fields: host lists for the pass's layout, ``parents``
        every entry's forest parents concatenated (int64, local indices, on any device: the masks are built there with
        no host read) and ``query`` the query tokens' rows among those nodes."""
        # every entry's forest in one call (the masks of all nodes, then the query nodes' rows): per-entry calls
        # cost ~0.3 ms each on a CPU, and beam requests' tries rarely repeat a shape
        cu_nodes = parents.new_tensor([0, *flen]).cumsum(0)  # int64, where the parents are
        mask = ancestor_bitmask(parents, cu_nodes, max_nodes=max_nodes)
        return ForestBatch(
            token_index=torch.tensor(token_rows, dtype=torch.int64),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            req_rows=torch.tensor(req_rows, dtype=torch.int64),
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            forest_lens=torch.tensor(flen, dtype=torch.int32),
            ancestor_mask=mask[parents.new_tensor(query)],
        )

    def to(self, device: torch.device) -> "ForestBatch":
        """This batch on ``device`` (copied once per device and pass: every attention layer reuses it)."""
        if self.token_index.device == device:
            return self
        cache = self.__dict__.setdefault("_on", {})
        if device not in cache:
            cache[device] = ForestBatch(*(getattr(self, f).to(device, non_blocking=True) for f in
                                          ("token_index", "cu_seqlens_q", "req_rows", "context_lens", "forest_lens",
                                           "ancestor_mask")))
        return cache[device]

    def batched_plan(self, device: torch.device, block_size: int, num_heads: int) -> BatchedPlan:
        """The batched torch path's chunks and visibility masks (``plan_forest_batched``, over the pass's query rows),
        made on the host once per pass and shared by every attention layer (it was most of a layer's operations)."""
        cache = self.__dict__.setdefault("_plans", {})
        key = (device, block_size, num_heads)
        if key not in cache:
            plan = plan_forest_batched(self.cu_seqlens_q, self.context_lens, self.forest_lens, self.ancestor_mask,
                                       block_size, num_heads, token_index=self.token_index, req_rows=self.req_rows)
            cache[key] = plan if device.type == "cpu" else plan.to(device)
        return cache[key]


def drop_chain_queries(entry: ForestEntry) -> ForestEntry:
    """``entry`` without the query tokens causal attention already gets right: nodes 0..q of a chain hanging off the
    context (``parents[j] == j - 1``; every node of a width-1 forest, the first of any), whose causal view is exactly
    their ancestors-or-self. Only for entries whose query for node q sits at causal position ``ctx + q`` (plain
    requests' target pass, the drafter's passes)."""
    parents, nodes = entry.parents, entry.query_nodes
    chain = 0
    while chain < len(parents) and parents[chain] == chain - 1:
        chain += 1
    keep = [k for k, q in enumerate(nodes) if q >= chain]
    if len(keep) == len(nodes):
        return entry
    return entry._replace(token_rows=[entry.token_rows[k] for k in keep], query_nodes=[nodes[k] for k in keep])


_ACTIVE = threading.local()


@contextlib.contextmanager
def forest_scope(batch: ForestBatch | None):
    """Makes ``batch`` the forest of the forward passes run inside the block (None: plain causal attention)."""
    old = getattr(_ACTIVE, "batch", None)
    _ACTIVE.batch = batch
    try:
        yield
    finally:
        _ACTIVE.batch = old


def active_batch() -> ForestBatch | None:
    return getattr(_ACTIVE, "batch", None)


def recompute_forest_outputs(batch: ForestBatch, query: torch.Tensor, kv_cache: torch.Tensor,
                             block_table: torch.Tensor, scale: float, output: torch.Tensor,
                             impl: str | None = None) -> None:
    """Overwrites ``output[batch.token_index]`` with forest attention of those query tokens over the paged cache.

    query, output: [T, H, D] (output may be a view of the layer's output buffer); block_table: the pass's [num_reqs,
    max_blocks] int32 block table (rows in attention-metadata order). ``impl``: "kernel" (the Triton kernel on CUDA,
    the batched torch path elsewhere), "torch" (the batched torch path everywhere) or "ref" (what :func:`install` was
    given; None: ``VLLM_DSBD_FOREST_ATTENTION`` now)."""
    if impl is None:
        impl = envs.read(only=(envs.FOREST_ATTENTION,)).forest_attention
    k_plane, v_plane = layer_planes(kv_cache)
    if query.is_cuda and impl == "kernel":
        from dsbd_kernels.forest_attention import forest_attention

        b = batch.to(query.device)
        q = query[b.token_index]
        out = torch.empty_like(q)
        forest_attention(q, k_plane, v_plane, block_table[b.req_rows].to(torch.int32), b.cu_seqlens_q,
                         b.context_lens, b.forest_lens, b.ancestor_mask, scale, out)
        output[b.token_index] = out.to(output.dtype)
        return
    if impl != "ref":  # requests batched, from the pass's plan (it gathers the used blocks by block id)
        plan = batch.batched_plan(query.device, k_plane.shape[1], query.shape[1])
        forest_attention_planned(plan, query, k_plane, v_plane, block_table, scale, output)
        return
    batch = batch.to(query.device)
    q = query[batch.token_index]
    bt = block_table[batch.req_rows]
    bs = k_plane.shape[1]
    need = int(((batch.context_lens + batch.forest_lens + bs - 1) // bs).max())
    # compact copy of the blocks these requests use: the reference gathers through flatten(), which on a strided
    # plane would copy the whole cache
    uniq, local = torch.unique(bt[:, :need].long(), return_inverse=True)
    out = forest_attention_ref(q, k_plane[uniq].contiguous(), v_plane[uniq].contiguous(), local.to(torch.int32),
                               batch.cu_seqlens_q, batch.context_lens, batch.forest_lens, batch.ancestor_mask, scale)
    output[batch.token_index] = out.to(output.dtype)


_SUBCLASSES: dict[type, type] = {}


def _forest_impl_class(base: type) -> type:
    """A subclass of an attention impl class whose ``forward`` adds the forest recompute."""
    if base in _SUBCLASSES:
        return _SUBCLASSES[base]

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = base.forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        batch = active_batch()
        if batch is not None and attn_metadata is not None:
            out = output.view(output.shape[0], self.num_heads, -1) if output.dim() == 2 else output
            q = query.view(query.shape[0], self.num_heads, -1) if query.dim() == 2 else query
            recompute_forest_outputs(batch, q, kv_cache, attn_metadata.block_table, self.scale, out,
                                     getattr(self, "_dsbd_forest_impl", None))
        return result

    sub = type(f"DSBDForest{base.__name__}", (base,), {"forward": forward, "__dsbd_base__": base})
    _SUBCLASSES[base] = sub
    return sub


def install(layers: dict, impl: str | None = None) -> int:
    """Gives every attention layer in ``layers`` (name -> vLLM ``Attention`` module) the forest-attention forward with
    ``impl`` ("kernel", "torch" or "ref"; None: ``VLLM_DSBD_FOREST_ATTENTION`` at each recompute). Idempotent (a
    wrapped layer takes the latest ``impl``). Returns the number of layers changed. Unsupported layers are refused
    before this (``support.check_attention_layers``)."""
    n = 0
    for layer in layers.values():
        attn = getattr(layer, "impl", None)
        if attn is None or not hasattr(layer, "kv_cache"):
            continue
        if getattr(type(attn), "__dsbd_base__", None) is None:
            attn.__class__ = _forest_impl_class(type(attn))
            n += 1
        attn._dsbd_forest_impl = impl
    return n
