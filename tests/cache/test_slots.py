"""The slot table and the LRU as pieces: the slot states and the LRU's statuses agree with
C, and each ``check()`` names what is broken (and nothing on a sound cache)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import rowcache.kernels.host as host
from rowcache import NgramRowCache
from rowcache.cache.plan import LruStatus
from rowcache.cache.slots import SlotState
from tests.cache.support import check_pieces


def test_slot_states_agree_with_the_native_module():
    if host.native is None:
        pytest.skip("rowcache.kernels._host not built")
    for s in SlotState:
        assert getattr(host.native, f"SLOT_{s.name}") == int(s), s.name


def test_lru_statuses_agree_with_the_header_and_the_native_module():
    """``LruStatus`` is ``csrc/lru_status.h``'s, as the header writes it (one code a meaning)
    and as the module exports it."""
    text = (Path(__file__).resolve().parents[2] / "csrc" / "lru_status.h").read_text()
    in_header = {name: int(v) for name, v in re.findall(r"\bRC_LRU_(\w+) = (\d+)", text)}
    assert in_header == {s.name: int(s) for s in LruStatus}
    assert len(set(in_header.values())) == len(in_header)
    if host.native is None:
        pytest.skip("rowcache.kernels._host not built")
    for s in LruStatus:
        assert getattr(host.native, f"LRU_{s.name}") == int(s), s.name


def _cache(tiny_store):
    store, _ = tiny_store
    cache = NgramRowCache(store, "t", slots=40)
    cache.resolve(np.arange(30))
    cache.end_step()
    cache.resolve(np.array([3, 31, 32]))
    check_pieces(cache)
    return cache


@pytest.mark.parametrize(
    "breakage,says",
    [
        (lambda t: t.row_map.set(np.array([5]), np.array([7])), "row -> slot -> row"),
        (lambda t: t.slot_row.__setitem__(0, 9), "slot -> row -> slot"),
        (lambda t: t.state.__setitem__(35, SlotState.RESIDENT), "free without being empty"),
        (lambda t: t.state.__setitem__(1, 9), "outside SlotState"),
        (lambda t: t.state.__setitem__(2, SlotState.READING), "reserved is 0 but 1"),
    ],
)
def test_slot_table_check_names_what_is_broken(tiny_store, breakage, says):
    cache = _cache(tiny_store)
    breakage(cache.inspect().slot_table)
    assert any(says in b for b in cache.inspect().slot_table.check()), cache.inspect().slot_table.check()


@pytest.mark.parametrize(
    "breakage,says",
    [
        (lambda lru: lru.log_pos.__setitem__(4, lru.log_pos[5]), "does not point"),
        (lambda lru: lru.last_used.__setitem__(0, lru.batch + 1), "after the current one"),
        (lambda lru: lru.last_used.__setitem__(20, lru.batch), "pinned is 3 but 4"),
        (lambda lru: lru.log.__setitem__(lru.log_pos[6], 7), "does not point"),
    ],
)
def test_lru_check_names_what_is_broken(tiny_store, breakage, says):
    cache = _cache(tiny_store)
    breakage(cache.inspect().lru)
    assert any(says in b for b in cache.inspect().lru.check()), cache.inspect().lru.check()
