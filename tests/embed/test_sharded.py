"""ShardedNgramEmbedding: the tables spread over the ranks of a torch.distributed group.

Groups of 2 and 3 CPU processes (gloo, torch.multiprocessing spawn, a FileStore rendezvous)
each run every scenario once and write what they computed; the tests compare it with the
single-process ``NgramEmbedding`` of the same weights: bit for bit with one rank (an
in-process group of one), within 1 bf16 ulp with several (the float32 partial sums are
added in another order before the bf16 cast). Resident and cached tables, row-split tables,
prefetch, ``embed_rows`` and the torch module, and the construction errors.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from rowcache.embed.layer import NgramEmbedding  # noqa: E402
from rowcache.embed.sharded import (  # noqa: E402
    RankFailedError,
    ShardedNgramEmbedding,
    ShardPlacement,
    max_ulps,
)
from rowcache.errors import ConfigError  # noqa: E402
from rowcache.store.builder import build_store  # noqa: E402
from rowcache.store.handle import RowStore  # noqa: E402
from tests.embed.support import DIMS, bits, random_weights, token_stream  # noqa: E402

# tables of DIMS are 60,024..60,168 bytes: this budget splits tables 1..3 in two, not table 0
SPLIT_BYTES = 60_030
#: the bound the sharded output keeps against the single-process one (max_ulps)
ULP_BOUND = 1.0


def weights():
    return random_weights(np.random.default_rng(0))


def steps():
    """Three steps of three sequences: (contexts, seq_lens)."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(3):
        ctxs = [token_stream(rng, int(n)) for n in rng.integers(3, 40, size=3)]
        out.append((ctxs, [len(c) - int(rng.integers(0, 3)) for c in ctxs]))
    return out


def rows_input():
    rng = np.random.default_rng(2)
    return token_stream(rng, 5 * 7).reshape(5, 7), token_stream(rng, 5 * 4).reshape(5, 4)


# --- the ranks' side -------------------------------------------------------------------
def _error(fn):
    try:
        fn()
    except ConfigError as e:
        return str(e)
    return None


def _worker(rank: int, world: int, where: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{where}/rendezvous", rank=rank, world_size=world
    )
    try:
        _scenarios(rank, world, where)
    finally:
        dist.destroy_process_group()


def _scenarios(rank: int, world: int, where: str) -> None:
    from rowcache.embed.torch.sharded import TorchShardedNgramEmbedding

    word, tables, projs = weights()
    res: dict[str, np.ndarray] = {}
    info: dict[str, object] = {}
    resident = ShardedNgramEmbedding.from_arrays(DIMS, word, tables, projs)
    split = ShardedNgramEmbedding.from_arrays(DIMS, word, tables, projs, rank_bytes=SPLIT_BYTES)
    store = RowStore.open(os.path.join(where, "store"))  # one store, opened by every rank
    cached = ShardedNgramEmbedding.from_store(
        DIMS, word if rank == 0 else None, store, projs, slots=1500,
        tables=[f"t{i}" for i in range(DIMS.num_tables)], rank_bytes=SPLIT_BYTES,
    )  # fmt: skip
    info["pieces"] = [[p.table, p.lo, p.hi] for p in split.pieces]
    for k, (ctxs, lens) in enumerate(steps()):
        res[f"resident{k}"] = resident.embed_batch(ctxs, lens)
        res[f"split{k}"] = split.embed_batch(ctxs, lens)
        handle = cached.prefetch_packed(*_packed(ctxs, lens))
        handle.wait()
        res[f"cached{k}"] = cached.embed_batch(ctxs, lens)
    stats = cached.caches[0].stats()
    info["prefetched"], info["misses"] = stats.prefetched, stats.misses
    ids, ctx = rows_input()
    res["rows"] = split.embed_rows(ids, ctx)
    mod = TorchShardedNgramEmbedding(split)
    res["module"] = mod(torch.from_numpy(ids), torch.from_numpy(ctx)).view(torch.int16).numpy()
    res["module"] = res["module"].reshape(-1, DIMS.hidden_size)
    res["empty"] = resident.embed(np.array([5, 6]), 0)
    # errors: every rank raises the same one (no rank is left waiting in a collective)
    wrong = ShardPlacement.plan(DIMS, world + 1)
    info["wrong_size"] = _error(
        lambda: ShardedNgramEmbedding(DIMS, wrong, word if rank == 0 else None, [], projs)
    )
    other = np.stack(projs)
    if rank == world - 1:
        other = other.copy()
        other[0, 0, 0] = other[0, 0, 1]
    info["mismatched"] = _error(
        lambda: ShardedNgramEmbedding.from_arrays(DIMS, word, tables, other)
    )
    budget = SPLIT_BYTES if rank == 0 else None
    info["placements"] = _error(
        lambda: ShardedNgramEmbedding.from_arrays(DIMS, word, tables, projs, rank_bytes=budget)
    )
    # the last rank alone is given tables of the wrong size: it raises its error, the
    # others one that names it (none waits in the construction's collective)
    mine = ShardPlacement.plan(DIMS, world)
    given = [
        tables[p.table][:10] if rank == world - 1 else tables[p.table] for p in mine.of_rank(rank)
    ]
    info["wrong_tables"] = _error(
        lambda: ShardedNgramEmbedding(DIMS, mine, word if rank == 0 else None, given, projs)
    )
    # one rank fails a step (a bad out=): it raises its error, the others RankFailedError,
    # and the group goes on
    bad = np.empty((1, 1), dtype=np.float32) if rank == world - 1 else None
    try:
        resident.embed_batch(*steps()[0], out=bad)
        info["failed"] = None
    except (ConfigError, RankFailedError) as e:
        info["failed"] = type(e).__name__
    res["after"] = resident.embed_batch(*steps()[1])
    np.savez(os.path.join(where, f"rank{rank}.npz"), **{k: bits(v) for k, v in res.items()})
    with open(os.path.join(where, f"rank{rank}.json"), "w") as f:
        json.dump(info, f)


def _packed(ctxs, lens):
    return np.concatenate(ctxs), [len(c) for c in ctxs], lens


# --- the tests' side --------------------------------------------------------------------
def _run_group(tmp_path_factory, world):
    where = str(tmp_path_factory.mktemp(f"sharded{world}"))
    _, tables, _ = weights()
    named = {f"t{i}": t for i, t in enumerate(tables)}
    build_store(os.path.join(where, "store"), named, progress=False)
    mp.spawn(_worker, args=(world, where), nprocs=world, join=True)
    out = []
    for r in range(world):
        with np.load(os.path.join(where, f"rank{r}.npz")) as z:
            arrays = {k: z[k] for k in z.files}
        with open(os.path.join(where, f"rank{r}.json")) as f:
            out.append((arrays, json.load(f)))
    return out


@pytest.fixture(scope="module", params=[2, 3])
def group(request, tmp_path_factory):
    return request.param, _run_group(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def single():
    word, tables, projs = weights()
    return NgramEmbedding(DIMS, word, tables, projs)


def test_every_rank_returns_the_single_process_embedding_within_one_ulp(group, single):
    world, ranks = group
    worst = 0
    for k, (ctxs, lens) in enumerate(steps()):
        ref = single.embed_batch(ctxs, lens)
        for arrays, _ in ranks:
            for name in ("resident", "split", "cached"):
                got = arrays[f"{name}{k}"]
                assert got.shape == ref.shape
                worst = max(worst, max_ulps(got, ref))
    print(f"world {world}: worst {worst} ulp")
    assert worst <= ULP_BOUND
    # the ranks agree with each other bit for bit (one all_reduce: the same sum everywhere)
    for arrays, _ in ranks[1:]:
        for key, a in arrays.items():
            np.testing.assert_array_equal(a, ranks[0][0][key], err_msg=key)


def test_cached_tables_equal_resident_and_prefetch_reads_ahead(group):
    _, ranks = group
    for arrays, info in ranks:
        for k in range(3):  # the same pieces, resident or cached: the same bits
            np.testing.assert_array_equal(arrays[f"cached{k}"], arrays[f"split{k}"])
        assert info["prefetched"] > 0 and info["misses"] == 0  # every row came by prefetch


def test_row_split_places_halves_of_a_table_on_different_ranks(group):
    world, ranks = group
    placement = ShardPlacement.plan(DIMS, world, rank_bytes=SPLIT_BYTES)
    assert placement.split_tables == [1, 2, 3]
    for r, (_, info) in enumerate(ranks):
        assert info["pieces"] == [[p.table, p.lo, p.hi] for p in placement.of_rank(r)]
    halves = [p for p in placement.pieces if p.table == 1]
    assert [(p.lo, p.hi) for p in halves] == [(0, 1251), (1251, 2503)]
    assert halves[0].rank != halves[1].rank


def test_embed_rows_and_the_torch_module(group, single):
    _, ranks = group
    ids, ctx = rows_input()
    ref = single.embed_rows(ids, ctx)
    for arrays, _ in ranks:
        assert max_ulps(arrays["rows"], ref) <= ULP_BOUND
        np.testing.assert_array_equal(arrays["module"], arrays["rows"])
        assert arrays["empty"].shape == (0, DIMS.hidden_size)


def test_bad_groups_and_mismatched_ranks_raise_on_every_rank(group):
    world, ranks = group
    for _, info in ranks:
        assert f"placement is for world_size={world + 1}" in info["wrong_size"]
        assert (
            "projections' CRC32" in info["mismatched"] and f"rank {world - 1}" in info["mismatched"]
        )
        assert "'s placement is" in info["placements"]
        assert "[10, 12]" in info["wrong_tables"]
    for _, info in ranks[:-1]:
        assert f"rank {world - 1} of the group could not build" in info["wrong_tables"]
    names = [info["failed"] for _, info in ranks]
    assert names == ["RankFailedError"] * (world - 1) + ["ConfigError"]
    for arrays, _ in ranks:
        np.testing.assert_array_equal(arrays["after"], arrays["resident1"])


# --- a group of one, in this process -----------------------------------------------------
@pytest.fixture
def group_of_one(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_a_group_of_one_is_bit_identical_to_ngram_embedding(group_of_one, single):
    word, tables, projs = weights()
    emb = ShardedNgramEmbedding.from_arrays(DIMS, word, tables, projs)
    assert emb.pieces == list(ShardPlacement.plan(DIMS, 1).pieces)
    for ctxs, lens in steps():
        np.testing.assert_array_equal(bits(emb.embed_batch(ctxs, lens)),
                                      bits(single.embed_batch(ctxs, lens)))  # fmt: skip
    assert emb.resident_bytes() > sum(t.nbytes for t in tables)


def test_max_ulps_counts_bf16_steps_above_the_rows_floor():
    from rowcache.kernels.reference import BF16

    ref = np.array([[1.0, 0.5, 2.0**-30]], dtype=np.float32).astype(BF16)
    up = ref.view(np.uint16).copy()
    up[0, 0] += 1  # the next bf16 above 1.0: 1 ulp
    assert max_ulps(up, ref) == 1.0
    up[0, 1] += 2  # 2 ulps at 0.5
    assert max_ulps(up, ref) == 2.0
    flip = ref.view(np.uint16).copy()
    flip[0, 2] ^= 0x8000  # -2^-30: 2 * 2^-30 apart, 256 ulps of 2^-30, far below the row's 1.0
    assert max_ulps(flip, ref) < 1e-3
    assert max_ulps(flip, ref, floor=0.0) == 256.0


def test_placement_errors():
    with pytest.raises(ConfigError, match="needs 3 ranks"):
        ShardPlacement.plan(DIMS, 2, rank_bytes=25_000)
    with pytest.raises(ConfigError, match="world_size=0"):
        ShardPlacement.plan(DIMS, 0)
    with pytest.raises(ConfigError, match="one row"):
        ShardPlacement.plan(DIMS, 2, rank_bytes=3)
    with pytest.raises(ConfigError, match=r"torch\.distributed initialized"):
        word, tables, projs = weights()
        ShardedNgramEmbedding(DIMS, ShardPlacement.plan(DIMS, 1), word, tables, projs)


def test_placement_balances_bytes():
    p = ShardPlacement.plan(DIMS, 4)
    assert sorted(q.table for q in p.pieces) == [0, 1, 2, 3]
    assert sorted(q.rank for q in p.pieces) == [0, 1, 2, 3]
    # largest first, each to the least loaded rank: t3 -> r0, t2 -> r1, t1 -> r2, t0 -> r2
    p = ShardPlacement.plan(DIMS, 3)
    assert [[q.table for q in p.of_rank(r)] for r in range(3)] == [[3], [2], [0, 1]]
    assert p.bytes_of(2) == (DIMS.table_rows(0) + DIMS.table_rows(1)) * 2 * DIMS.table_dim


# --- the NCCL path, a group of one on the GPU ----------------------------------------------
@pytest.mark.gpu
def test_nccl_group_of_one_on_the_gpu_matches_the_single_gpu_embedding(tmp_path):
    pytest.importorskip("cupy")
    import cupy as cp

    from rowcache.cache.row_cache import NgramRowCache
    from rowcache.embed.tables import Bf16Table, CachedTable
    from rowcache.embed.torch.sharded import TorchShardedNgramEmbedding

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(0)
    word, tables, projs = weights()
    store = build_store(tmp_path / "store", {f"t{i}": t for i, t in enumerate(tables)},
                        progress=False)  # fmt: skip
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    try:
        single = NgramEmbedding(
            DIMS, Bf16Table(word).to("cuda"), [Bf16Table(t).to("cuda") for t in tables], projs
        )
        resident = ShardedNgramEmbedding.from_arrays(DIMS, word, tables, projs, device="cuda")
        placement = ShardPlacement.plan(DIMS, 1)
        for defer in (False, True):
            cache = NgramRowCache(store, [f"t{i}" for i in range(4)], slots=4000, device="cuda")
            cached = ShardedNgramEmbedding(
                DIMS, placement, Bf16Table(word).to("cuda"),
                [CachedTable(cache, part=k) for k in range(4)], projs, defer_reads=defer,
            )  # fmt: skip
            for ctxs, lens in steps():
                ref = cp.asnumpy(single.embed_batch(ctxs, lens))
                got = cp.asnumpy(cached.embed_batch(ctxs, lens))
                cached.settle()
                assert max_ulps(got, ref) <= ULP_BOUND
                np.testing.assert_array_equal(
                    bits(got), bits(cp.asnumpy(resident.embed_batch(ctxs, lens)))
                )
        ids, ctx = rows_input()
        mod = TorchShardedNgramEmbedding(resident)
        out = mod(torch.from_numpy(ids).cuda(), torch.from_numpy(ctx).cuda())
        got = out.view(torch.int16).cpu().numpy().reshape(-1, DIMS.hidden_size)
        ref = bits(cp.asnumpy(single.embed_rows(cp.asarray(ids), cp.asarray(ctx))))
        assert max_ulps(got, ref) <= ULP_BOUND
    finally:
        dist.destroy_process_group()


def _gpu_worker(rank: int, world: int, where: str) -> None:
    """A rank of an NCCL group, one GPU a rank: resident, row-split and cached (with
    ``defer_reads``) tables; writes its outputs' bits."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    import cupy as cp

    cp.cuda.Device(rank).use()
    dist.init_process_group(
        "nccl", init_method=f"file://{where}/rendezvous", rank=rank, world_size=world
    )
    try:
        word, tables, projs = weights()
        resident = ShardedNgramEmbedding.from_arrays(DIMS, word, tables, projs, device="cuda")
        split = ShardedNgramEmbedding.from_arrays(
            DIMS, word, tables, projs, device="cuda", rank_bytes=SPLIT_BYTES
        )
        store = RowStore.open(os.path.join(where, "store"))
        cached = ShardedNgramEmbedding.from_store(
            DIMS, word if rank == 0 else None, store, projs, slots=1500, device="cuda",
            tables=[f"t{i}" for i in range(DIMS.num_tables)], rank_bytes=SPLIT_BYTES,
            defer_reads=True,
        )  # fmt: skip
        res = {}
        for k, (ctxs, lens) in enumerate(steps()):
            for name, emb in (("resident", resident), ("split", split), ("cached", cached)):
                res[f"{name}{k}"] = bits(cp.asnumpy(emb.embed_batch(ctxs, lens)))
            cached.settle()
        np.savez(os.path.join(where, f"rank{rank}.npz"), **res)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_nccl_groups_over_several_gpus_match_the_single_gpu_embedding(tmp_path):
    pytest.importorskip("cupy")
    import cupy as cp

    from rowcache.embed.tables import Bf16Table

    world = min(4, torch.cuda.device_count())
    if world < 2:
        pytest.skip("needs 2 GPUs or more")
    word, tables, projs = weights()
    build_store(tmp_path / "store", {f"t{i}": t for i, t in enumerate(tables)}, progress=False)
    mp.spawn(_gpu_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    single = NgramEmbedding(
        DIMS, Bf16Table(word).to("cuda"), [Bf16Table(t).to("cuda") for t in tables], projs
    )
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(world)]
    for k, (ctxs, lens) in enumerate(steps()):
        ref = cp.asnumpy(single.embed_batch(ctxs, lens))
        for z in ranks:
            np.testing.assert_array_equal(z[f"cached{k}"], z[f"split{k}"])
            for name in ("resident", "split"):
                assert max_ulps(z[f"{name}{k}"], ref) <= ULP_BOUND
                np.testing.assert_array_equal(z[f"{name}{k}"], ranks[0][f"{name}{k}"])
