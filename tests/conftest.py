"""Shared fixtures: a seeded ``rng``, ``xp`` (one test body on numpy and on cupy), a tiny
store, the reference LRU; and the ``gpu`` marker's skip where no CUDA GPU is usable.

What a test calls or subclasses (rather than receives) lives in the support modules:
``tests/support.py`` (the judges' runner), ``tests/cache/support.py`` (the cache's
reference and stores), ``tests/cli/support.py``, ``tests/embed/support.py``,
``tests/kernels/support.py``. The folders mirror the packages: store, io, cache, embed,
kernels, tools, cli; bench holds the judges' quick runs.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from rowcache.kernels.loader import gpu_available
from tests.cache.support import RefLRU, make_store


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with cupy (cupy.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def user_cache_root(tmp_path_factory):
    """One temporary directory for rowcache's user cache over the session."""
    return tmp_path_factory.mktemp("user-cache")


@pytest.fixture(autouse=True)
def user_cache_dir(user_cache_root, monkeypatch):
    """``ROWCACHE_CACHE_DIR`` for every test (and the children it starts): a temporary
    directory, never the user's ``~/.cache/rowcache``, where the loaders put the stores of
    checkpoints by default (``rowcache.embed.user_cache``). A test may set its own."""
    monkeypatch.setenv("ROWCACHE_CACHE_DIR", str(user_cache_root))
    return user_cache_root


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261130)


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    """The array module a test body runs on: numpy, then cupy (a ``gpu`` test)."""
    return importlib.import_module(request.param)


@pytest.fixture
def tiny_store(tmp_path, rng):
    """``(store, x)``: a one-table store ``t`` of 3,000 random bf16 rows of width 32 in
    small shards, and the rows it holds; closed after the test."""
    store, x = make_store(tmp_path, rng)
    yield store, x
    store.close()


@pytest.fixture
def ref_lru():
    """The cache's contract in pure Python: ``ref_lru(slots)`` is a reference LRU with pin
    counts (:class:`tests.cache.support.RefLRU`) to run beside a cache."""
    return RefLRU
