"""``GeneratedRows``: a table the builder streams from a function, a chunk at a time."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import rowcache
from rowcache.errors import ConfigError
from rowcache.store import builder
from rowcache.store.sources import GeneratedRows

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_generated_rows_build_the_store_an_array_builds(tmp_path, rng, monkeypatch, dtype):
    table = rng.standard_normal((1000, 24), dtype=np.float32).astype(BF16)
    calls = []

    def make(start, stop):
        calls.append((start, stop))
        return table[start:stop].copy()

    monkeypatch.setattr(builder, "CHUNK_BYTES", 24 * 2 * 100)  # chunks of ~100 rows
    gen = rowcache.build_store(
        tmp_path / "g", {"t": GeneratedRows(1000, 24, make)}, dtype=dtype, progress=False
    )
    arr = rowcache.build_store(tmp_path / "a", {"t": table}, dtype=dtype, progress=False)
    ids = np.arange(1000)
    assert np.array_equal(gen.read_records("t", ids)[0], arr.read_records("t", ids)[0])
    assert len(calls) > 5 and max(b - a for a, b in calls) < 1000  # streamed, never whole


def test_generated_rows_refuse_a_wrong_block_naming_the_table(tmp_path):
    gen = GeneratedRows(10, 4, lambda a, b: np.zeros((b - a, 5), BF16))
    with pytest.raises(ConfigError, match=r"tables\['t'\].*expected a numpy bfloat16\[10, 4\]"):
        rowcache.build_store(tmp_path / "s", {"t": gen}, progress=False)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"rows": 0}, "rows=0"),
        ({"dim": True}, "dim=True"),
        ({"dtype": np.float16}, "dtype="),
        ({"make": None}, "make=None"),
    ],
)
def test_generated_rows_refuse_bad_fields(kw, match):
    args = {"rows": 4, "dim": 2, "make": lambda a, b: np.zeros((b - a, 2), BF16)} | kw
    with pytest.raises(ConfigError, match=match):
        GeneratedRows(**args)


def test_generated_codes_build_an_fp8_table_scale_store_and_are_refused_as_values(tmp_path, rng):
    from rowcache.store.sources import Fp8TableScaleSource

    codes = rng.integers(0, 0x7E, (1000, 32), dtype=np.uint8)
    scale = ml_dtypes.bfloat16(0.5)
    gen = GeneratedRows(1000, 32, lambda a, b: codes[a:b].copy(), dtype=np.uint8)
    built = rowcache.build_store(
        tmp_path / "g", {"t": Fp8TableScaleSource(gen, scale)}, progress=False
    )
    arr = rowcache.build_store(
        tmp_path / "a", {"t": Fp8TableScaleSource(codes, scale)}, progress=False
    )
    ids = np.arange(1000)
    assert built.tables[0].dtype == "fp8_table_scale"
    assert np.array_equal(built.read_records("t", ids)[0], arr.read_records("t", ids)[0])
    with pytest.raises(ConfigError, match="GeneratedRows is not supported"):
        rowcache.build_store(tmp_path / "v", {"t": gen}, progress=False)  # codes as values
    values = GeneratedRows(10, 4, lambda a, b: np.zeros((b - a, 4), BF16))
    with pytest.raises(ConfigError, match="codes of type GeneratedRows is not supported"):
        rowcache.build_store(
            tmp_path / "w", {"t": Fp8TableScaleSource(values, scale)}, progress=False
        )
