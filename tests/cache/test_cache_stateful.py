"""A stateful (hypothesis) test of NgramRowCache against the reference LRU, with injected
I/O faults: EIO, end of file (a short read) and partial reads that must be retried.

Single and shared arenas, BF16 and FP8. Derandomized and small, so CI runs the same few
hundred operations in a few seconds; raise ``MAX_EXAMPLES`` locally to search harder.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import rowcache
from rowcache import NgramRowCache
from rowcache.cache.config import Tuning
from rowcache.errors import ArenaExhaustedError, CorruptDataError
from rowcache.store.handle import RowStore
from tests.cache.support import RefLRU, check_invariants, check_pieces, python_engine

MAX_EXAMPLES = 25
STEPS = 20
TABLES = {"t0": 600, "t1": 333, "t2": 150}
SHARED = ["t1", "t0", "t2"]


class Faults:
    """Replaces ``os.preadv``: the ``at``-th call from now fails (or reads half) once. The
    caches read through the Python engine (``python_engine``), which calls it."""

    def __init__(self) -> None:
        self.real = os.preadv
        self.mode: str | None = None
        self.countdown = -1
        self.fired = False
        self.count = {"eio": 0, "eof": 0, "partial": 0}

    def arm(self, mode: str | None, at: int) -> None:
        self.mode, self.countdown, self.fired = mode, at, False

    def __call__(self, fd, bufs, off):
        if self.mode is not None and self.countdown >= 0:
            self.countdown -= 1
            if self.countdown < 0:
                self.fired = True
                self.count[self.mode] += 1
                if self.mode == "eio":
                    raise OSError(5, "Input/output error")
                if self.mode == "eof":
                    return 0
                b = memoryview(bufs[0])
                return self.real(fd, [b[: max(1, len(b) // 2)]], off)  # partial: retried
        return self.real(fd, bufs, off)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    rng = np.random.default_rng(11)
    tabs = {
        n: (rng.standard_normal((rows, 16)) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
        for n, rows in TABLES.items()
    }
    out = {}
    for dtype in ("bf16", "fp8"):
        path = tmp_path_factory.mktemp("stateful") / dtype
        rowcache.build_store(path, tabs, dtype=dtype, progress=False, shard_bytes=4 * 4096).close()
        out[dtype] = str(path)
    return out


def truth(store, names):
    """Every global row's stored value: bf16 [rows, dim] or (codes, scales)."""
    got = [store.read_rows(n, np.arange(store.table_info(n).rows)) for n in names]
    if store.dtype == "bf16":
        return np.concatenate(got).view(np.uint16), None
    return np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])


def host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def make_machine(path, names, device, faults):
    class CacheMachine(RuleBasedStateMachine):
        @initialize(slots=st.integers(4, 48), row_map=st.sampled_from(["dense", "hash"]))
        def setup(self, slots, row_map):
            self.store = RowStore.open(path, merge_gap=0)  # one read per row: faults land anywhere
            self.cache = NgramRowCache.assemble(self.store, names, slots=slots, device=device,
                                                queue_depth=1, tuning=Tuning(row_map=row_map),
                                                part_reader=python_engine)  # fmt: skip
            assert self.cache.row_map_kind == row_map
            self.ref = RefLRU(slots)
            self.values, self.scales = truth(self.store, names)
            self.offsets = self.cache.row_offsets

        def teardown(self):
            if hasattr(self, "store"):
                self.store.close()

        @rule(
            data=st.data(),
            fault=st.sampled_from([None, "eio", "eof", "partial"]),
            at=st.integers(0, 3),
        )
        def resolve(self, data, fault, at):
            parts = data.draw(
                st.lists(st.integers(0, len(names) - 1), min_size=1, max_size=3), label="parts"
            )
            ids = np.concatenate(
                [
                    self.cache.global_ids(
                        k,
                        data.draw(
                            st.lists(st.integers(0, int(self.offsets[k + 1] - self.offsets[k]) - 1),
                                     max_size=30 // len(names) + 1),
                            label="rows",
                        ),
                    )
                    for k in parts
                ]
            )  # fmt: skip
            before = self.cache.inspect().slot_map()
            stats = self.cache.stats()
            faults.arm(fault, at)
            try:
                slots = self.cache.resolve(ids)
            except ArenaExhaustedError:
                with pytest.raises(ArenaExhaustedError):
                    self.ref.resolve(ids)
                self.assert_unchanged(before, stats)
                return
            except CorruptDataError:
                assert faults.fired and fault in ("eio", "eof"), "a read failed uninjected"
                self.assert_unchanged(before, stats)
                return
            finally:
                faults.arm(None, -1)
            assert not (faults.fired and fault in ("eio", "eof")), "a failed read went unnoticed"
            self.ref.resolve(ids)
            slots = host(slots)
            if self.scales is None:
                got = host(self.cache.table)[slots].view(np.uint16)
                np.testing.assert_array_equal(got, self.values[ids])
            else:
                np.testing.assert_array_equal(host(self.cache.table)[slots], self.values[ids])
                np.testing.assert_array_equal(host(self.cache.scales)[slots], self.scales[ids])

        def assert_unchanged(self, before, stats):
            after = self.cache.inspect().slot_map()
            np.testing.assert_array_equal(after[0], before[0])
            np.testing.assert_array_equal(after[1], before[1])
            now = self.cache.stats()
            assert (now.lookups, now.hits, now.misses, now.evictions) == (
                stats.lookups,
                stats.hits,
                stats.misses,
                stats.evictions,
            )

        @rule()
        def end_batch(self):
            self.cache.end_step()
            self.ref.end_batch()

        @invariant()
        def matches_reference(self):
            if not hasattr(self, "cache"):
                return
            check_invariants(self.cache, self.ref)
            check_pieces(self.cache)
            assert self.cache.inspect().pinned == len(self.ref.pins)
            assert self.cache.stats().misses == self.ref.faults
            assert self.cache.stats().evictions == self.ref.evictions

    return CacheMachine


def run(stores, monkeypatch, dtype, shared, device):
    faults = Faults()
    monkeypatch.setattr(os, "preadv", faults)
    names = SHARED if shared else ["t0"]
    machine = make_machine(stores[dtype], names, device, faults)
    machine.TestCase.settings = settings(
        max_examples=MAX_EXAMPLES,
        stateful_step_count=STEPS,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    machine.TestCase().runTest()
    for mode in [m for m, c in faults.count.items() if c == 0]:
        inject_once(stores[dtype], names, device, faults, mode)  # every mode, whatever was drawn
    assert min(faults.count.values()) > 0, f"some fault was never injected: {faults.count}"


def inject_once(path, names, device, faults, mode):
    """One resolve with ``mode`` injected into its first read: a failed read maps nothing
    and changes no stats; a partial read is retried and gives the stored rows."""
    store = RowStore.open(path, merge_gap=0)
    try:
        cache = NgramRowCache.assemble(store, names, slots=16, device=device, queue_depth=1,
                                       part_reader=python_engine)  # fmt: skip
        values, scales = truth(store, names)
        ids = np.arange(0, 64, 8)
        before, stats = cache.inspect().slot_map(), cache.stats()
        fired = faults.count[mode]
        faults.arm(mode, 0)
        try:
            if mode in ("eio", "eof"):
                with pytest.raises(CorruptDataError):
                    cache.resolve(ids)
                after = cache.inspect().slot_map()
                np.testing.assert_array_equal(after[0], before[0])
                assert cache.stats().misses == stats.misses
                return
            slots = host(cache.resolve(ids))
        finally:
            faults.arm(None, -1)
        assert faults.count[mode] == fired + 1  # the partial read happened and was retried
        if scales is None:
            np.testing.assert_array_equal(host(cache.table)[slots].view(np.uint16), values[ids])
        else:
            np.testing.assert_array_equal(host(cache.table)[slots], values[ids])
    finally:
        store.close()


@pytest.mark.parametrize("shared", [False, True], ids=["single", "shared"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_cache_stateful_with_injected_io_faults(stores, monkeypatch, dtype, shared):
    run(stores, monkeypatch, dtype, shared, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True], ids=["single", "shared"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_cache_stateful_with_injected_io_faults_gpu(stores, monkeypatch, dtype, shared):
    run(stores, monkeypatch, dtype, shared, "cuda")


@pytest.mark.parametrize("mode", ["eio", "eof", "partial"])
@pytest.mark.parametrize("shared", [False, True], ids=["single", "shared"])
def test_cache_each_injected_fault_once(stores, monkeypatch, mode, shared):
    faults = Faults()
    monkeypatch.setattr(os, "preadv", faults)
    inject_once(stores["fp8"], SHARED if shared else ["t0"], "cpu", faults, mode)
    assert faults.count[mode] == 1
