"""Shared fixtures: a seeded rng, the gpu marker's skip, and the xp fixture."""

from __future__ import annotations

import numpy as np
import pytest

from rowcache.kernels.loader import gpu_available


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with cupy (cupy.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261130)
