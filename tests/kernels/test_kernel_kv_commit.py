"""KV commit / copy kernel vs its gather-then-scatter reference, compared bitwise, on every cache layout vLLM uses.

Caches are filled with random bits (NaN patterns included), so any byte moved wrongly, or any plane missed, shows.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernel_utils import DEVICE, assert_bitwise_equal  # sets TRITON_INTERPRET=1 without a GPU
import dsbd_kernels.kv_commit as kvc
from dsbd_kernels.kv_commit import KVCacheTable, copy_kv_blocks, copy_kv_blocks_ref, copy_kv_slots, copy_kv_slots_ref

pytestmark = [pytest.mark.gpu,  # also run compiled on a GPU by benchmarks/gpu/check.sh
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")]

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]


def random_bits(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32}[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(as_int)
    return torch.randint(info.min, info.max, shape, dtype=as_int, generator=gen).view(dtype).to(DEVICE)


def make_planes(layout: str, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """The cache planes of a model in one of the layouts vLLM uses (see KVCacheTable)."""
    gen = torch.Generator().manual_seed(seed)
    nb, bs, h, d = num_blocks, block_size, kv_heads, head_dim
    if layout == "packed-nhd":  # vLLM 0.26 default: logical [nb, h, bs, 2d], memory [nb, bs, h, 2d]
        logical = [random_bits((nb, bs, h, 2 * d), dtype, gen).transpose(1, 2) for _ in range(layers)]
        return [kv.transpose(1, 2) for kv in logical]
    if layout == "packed-hnd":  # VLLM_KV_CACHE_LAYOUT=HND: memory = logical [nb, h, bs, 2d]
        return [random_bits((nb, h, bs, 2 * d), dtype, gen).transpose(1, 2) for _ in range(layers)]
    if layout == "split":  # K and V as the two halves of the packed last dim (two planes per layer)
        packed = [random_bits((nb, bs, h, 2 * d), dtype, gen) for _ in range(layers)]
        return [half for kv in packed for half in (kv[..., :d], kv[..., d:])]
    if layout == "stacked":  # one tensor for the whole model
        return list(random_bits((2 * layers, nb, bs, h, d), dtype, gen).unbind(0))
    if layout == "separate":  # one K and one V tensor per layer
        return [random_bits((nb, bs, h, d), dtype, gen) for _ in range(2 * layers)]
    raise ValueError(layout)


def compaction_pairs(num_reqs: int, num_blocks: int, block_size: int, seed: int, padding: int = 2,
                     sparse: bool = False):
    """Commit pairs of a batch: request r keeps an accepted path n_0 < n_1 < ... of its forest; dst_k = ctx + k,
    src_k = ctx + n_k (n_k >= k), through a random block table; padding pairs (-1) sprinkled in. ``sparse`` takes
    n_k = 2k + 1, so pair k reads the slot that pair 2k + 1 overwrites later."""
    rng = random.Random(seed)
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    src, dst = [], []
    taken = 0
    for _ in range(num_reqs):
        ctx, n = rng.randrange(0, 3 * block_size), rng.randrange(2, 2 * block_size)
        nb = -(-(ctx + n) // block_size)
        table = perm[taken:taken + nb]
        taken += nb
        if sparse:
            path = list(range(1, n, 2))
        else:
            path = sorted(rng.sample(range(n), rng.randrange(1, n + 1)))
        def slot(pos: int, table: list[int] = table) -> int:
            return table[pos // block_size] * block_size + pos % block_size

        for k, nk in enumerate(path):
            src.append(slot(ctx + nk))
            dst.append(slot(ctx + k))
    for _ in range(padding):
        i = rng.randrange(len(src) + 1)
        src.insert(i, -1 if rng.random() < 0.5 else 0)
        dst.insert(i, -1)
    assert taken <= num_blocks
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=DEVICE)  # noqa: E731
    return as_t(src), as_t(dst)


def check_copy(planes: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, **kw) -> KVCacheTable:
    expected = [p.clone() for p in planes]
    copy_kv_slots_ref(expected, src, dst)
    table = KVCacheTable.from_caches(planes)
    copy_kv_slots(table, src, dst, validate=True, **kw)
    for i, (p, e) in enumerate(zip(planes, expected)):
        assert_bitwise_equal(p, e, what=f"plane {i}")
    return table


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_commit_compaction_dtypes(dtype: torch.dtype) -> None:
    planes = make_planes("packed-nhd", 2, num_blocks=40, block_size=16, kv_heads=2, head_dim=64, dtype=dtype)
    check_copy(planes, *compaction_pairs(5, 40, 16, seed=1))


@pytest.mark.parametrize("layout,kv_heads,head_dim,block_size", [
    ("packed-nhd", 4, 128, 16),  # 1024 elements per slot: several element chunks per plane
    ("packed-hnd", 2, 64, 16),  # heads of a slot far apart
    ("split", 3, 40, 16),  # 120 elements per slot, not a power of two; K and V interleaved in memory
    ("stacked", 1, 64, 32),
    ("separate", 2, 32, 8),
], ids=lambda v: str(v))
def test_commit_compaction_layouts(layout: str, kv_heads: int, head_dim: int, block_size: int) -> None:
    planes = make_planes(layout, 3, num_blocks=30, block_size=block_size, kv_heads=kv_heads, head_dim=head_dim,
                         dtype=torch.float16, seed=2)
    table = check_copy(planes, *compaction_pairs(4, 30, block_size, seed=2))
    if layout == "split":  # K and V 40 elements apart: the unaligned addressing path
        assert table.offset_unit == 1
    if layout == "stacked":  # one allocation, planes 16-element multiples apart: the aligned path
        assert table.offset_unit == 16


@pytest.mark.parametrize("tile", [1, 2, 4])
def test_commit_across_pair_tiles(tile: int, monkeypatch) -> None:
    """Compaction spread over many pair tiles: tiles apply in order, and every slot is read before overwritten."""
    monkeypatch.setattr(kvc, "_PAIRS_PER_TILE", tile)
    planes = make_planes("packed-nhd", 2, num_blocks=60, block_size=8, kv_heads=2, head_dim=16,
                         dtype=torch.bfloat16, seed=3)
    src, dst = compaction_pairs(6, 60, 8, seed=3, sparse=True)
    s, d = src.tolist(), dst.tolist()
    late_overwrites = [(i, j) for i in range(len(s)) for j in range(i + 1, len(d))
                       if s[i] >= 0 and s[i] == d[j] and i // tile != j // tile]
    assert late_overwrites, "no slot read by one tile and overwritten by a later one: the test would be vacuous"
    check_copy(planes, src, dst)


def test_any_overlap_inside_one_tile() -> None:
    """A permutation with cycles (swaps included) of up to one tile of pairs: exact gather-then-scatter."""
    planes = make_planes("split", 2, num_blocks=4, block_size=8, kv_heads=2, head_dim=32, dtype=torch.float32, seed=4)
    gen = torch.Generator().manual_seed(4)
    slots = torch.randperm(32, generator=gen)[:kvc._PAIRS_PER_TILE]
    src = slots.to(DEVICE)
    dst = slots[torch.randperm(slots.numel(), generator=gen)].to(DEVICE)
    check_copy(planes, src, dst)
    check_copy(planes, torch.tensor([3, 9], device=DEVICE), torch.tensor([9, 3], device=DEVICE))  # a swap


@pytest.mark.parametrize("may_overlap", [True, False], ids=["ordered", "parallel"])
def test_fork_blocks(may_overlap: bool) -> None:
    """Beam fork: whole blocks to fresh blocks, one source block forked twice, padding entries skipped."""
    planes = make_planes("packed-nhd", 2, num_blocks=12, block_size=16, kv_heads=2, head_dim=64, dtype=torch.float16,
                         seed=5)
    src = torch.tensor([3, 3, 7, -1, 0], device=DEVICE)
    dst = torch.tensor([9, 10, 2, 5, -1], device=DEVICE, dtype=torch.int32)
    expected = [p.clone() for p in planes]
    copy_kv_blocks_ref(expected, src, dst)
    copy_kv_blocks(KVCacheTable.from_caches(planes), src, dst, may_overlap=may_overlap, validate=True)
    for i, (p, e) in enumerate(zip(planes, expected)):
        assert_bitwise_equal(p, e, what=f"plane {i}")


def test_parallel_mode_many_pairs() -> None:
    """may_overlap=False spreads disjoint pairs over several programs."""
    planes = make_planes("separate", 1, num_blocks=16, block_size=16, kv_heads=2, head_dim=16, dtype=torch.float16,
                         seed=6)
    gen = torch.Generator().manual_seed(6)
    slots = torch.randperm(256, generator=gen)[:100].to(DEVICE)
    check_copy(planes, slots[:50], slots[50:], may_overlap=False)


def test_padding_only_and_empty() -> None:
    planes = make_planes("packed-hnd", 1, num_blocks=4, block_size=4, kv_heads=1, head_dim=16, dtype=torch.float16,
                         seed=7)
    check_copy(planes, torch.tensor([-1, 5], device=DEVICE), torch.tensor([2, -1], device=DEVICE))
    check_copy(planes, torch.zeros(0, dtype=torch.int64, device=DEVICE), torch.zeros(0, dtype=torch.int64,
                                                                                    device=DEVICE))


# ---- contracts --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("src,dst,may_overlap", [
    ([1, 2], [3, 3], True),  # duplicate destination
    ([1, 64], [2, 3], True),  # source out of range (16 blocks x 4 slots)
    ([1, 2], [3, 64], True),  # destination out of range
    ([5, 6] + list(range(20, 34)) + [7], [7, 8] + list(range(40, 54)) + [9], True),  # reads slot 7 a tile late
    ([1, 2], [2, 3], False),  # overlap in parallel mode
], ids=["duplicate-dst", "src-range", "dst-range", "read-after-earlier-tile-write", "overlap-in-parallel-mode"])
def test_validate_rejects(src, dst, may_overlap) -> None:
    table = KVCacheTable.from_caches(make_planes("packed-nhd", 1, 16, 4, 1, 16, torch.float16))
    with pytest.raises(ValueError):
        copy_kv_slots(table, torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE),
                      may_overlap=may_overlap, validate=True)


def test_slot_argument_errors() -> None:
    table = KVCacheTable.from_caches(make_planes("packed-nhd", 1, 8, 4, 1, 16, torch.float16))
    i64 = dict(dtype=torch.int64, device=DEVICE)
    for src, dst in [
        (torch.tensor([1], dtype=torch.int32, device=DEVICE), torch.tensor([2], **i64)),  # int32 slots
        (torch.tensor([1, 2], **i64), torch.tensor([3], **i64)),  # lengths differ
        (torch.tensor([[1]], **i64), torch.tensor([[2]], **i64)),  # 2-D
    ]:
        with pytest.raises(ValueError):
            copy_kv_slots(table, src, dst)
    with pytest.raises(ValueError):
        copy_kv_blocks(table, torch.tensor([1.0], device=DEVICE), torch.tensor([2.0], device=DEVICE))


def test_table_rejects_mismatched_caches() -> None:
    a = make_planes("separate", 1, 8, 4, 2, 16, torch.float16)
    for bad in (
        [],
        [a[0], torch.zeros(8, 4, 2, 8, dtype=torch.float16, device=DEVICE)],  # shape
        [a[0], a[1].float()],  # dtype
        [a[0], a[1].transpose(2, 3).contiguous().transpose(2, 3)],  # strides differ
        [torch.zeros(8, 4, 16, 2, dtype=torch.float16, device=DEVICE).transpose(2, 3)],  # last dim not unit stride
        [torch.zeros(8, 4, 16, dtype=torch.float16, device=DEVICE)],  # 3-D
    ):
        with pytest.raises(ValueError):
            KVCacheTable.from_caches(bad)


def test_engine_commit_with_the_kernel_equals_the_torch_switch(monkeypatch) -> None:
    """The engine's commit (``engine/kv.py``): through the kernel (a :class:`PlaneSet` with its table, as on CUDA) and
    with ``VLLM_DSBD_KV_COMMIT=torch`` (the torch reference, the CPU-tested path) the caches end bit for bit the same,
    on planes laid out as vLLM 0.26's GPU backends lay out a layer's cache; the kernel ran only in the first."""
    import numpy as np

    from vllm_dsbd import envs
    from vllm_dsbd.engine import kv

    gen = torch.Generator().manual_seed(4)
    nb, bs, h, d = 30, 16, 2, 64
    caches = [random_bits((nb, bs, h, 2 * d), torch.bfloat16, gen).transpose(1, 2) for _ in range(3)]  # logical
    twin = [c.clone() for c in caches]
    before = caches[0].clone()
    src, dst = compaction_pairs(4, nb, bs, seed=5, padding=0)
    src, dst = src.cpu().numpy(), dst.cpu().numpy()
    assert (src != dst).sum() >= 4
    calls = []
    real = kvc.copy_kv_slots
    monkeypatch.setattr(kvc, "copy_kv_slots", lambda *a, **k: calls.append(1) or real(*a, **k))

    monkeypatch.delenv(envs.KV_COMMIT, raising=False)
    assert envs.read(only=[envs.KV_COMMIT]).kv_commit == "auto"
    kernel_set = kv.PlaneSet([p for c in caches for p in kv.gpu_planes(c)], kernel=True)
    kv.commit(kernel_set, src, dst)
    assert calls == [1]

    monkeypatch.setenv(envs.KV_COMMIT, "torch")
    setting = envs.read(only=[envs.KV_COMMIT]).kv_commit
    torch_set = kv.PlaneSet([p for c in twin for p in kv.gpu_planes(c)], kv.commit_kernel(setting))
    assert torch_set.table is None
    kv.commit(torch_set, src, dst)
    assert calls == [1]  # the switch never reaches the kernel
    for i, (a, b) in enumerate(zip(caches, twin)):
        assert_bitwise_equal(a, b, what=f"layer {i}")
    rows = lambda c: c.transpose(1, 2).reshape(nb * bs, -1).view(torch.int16)  # noqa: E731  (slot rows, as bits)
    moved = torch.from_numpy(np.unique(dst[src != dst]))
    assert not torch.equal(rows(caches[0])[moved], rows(before)[moved])  # the rows really moved

    monkeypatch.setenv(envs.KV_COMMIT, "kernel")
    with pytest.raises(ValueError, match="VLLM_DSBD_KV_COMMIT must be auto or torch, got 'kernel'"):
        envs.read(only=[envs.KV_COMMIT])
