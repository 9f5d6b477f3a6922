"""The FP8 builder's engines write the same bytes: native C threads, the GPU, the reference.

Every engine's store is compared with the "reference" engine's (NumPy's rule in one
thread, ``rowcache.kernels.reference.quantize_fp8_reference``) file by file and record by record,
on rows of every magnitude (subnormal scales included), bf16 / float32 / float16 sources,
whole and partial pages and chunks, and NaN/Inf rows (refused, or stored by the reference).
"""

from __future__ import annotations

import importlib.util
import os

import ml_dtypes
import numpy as np
import pytest

import rowcache
from rowcache.errors import ConfigError
from rowcache.format import layout as fmt
from rowcache.kernels import quantize as kq
from rowcache.kernels.reference import quantize_fp8_reference
from rowcache.store import builder

BF16 = np.dtype(ml_dtypes.bfloat16)


def mixed_rows(rng, n, d, dtype):
    """Rows from 1e-44 to 1e30 in magnitude: subnormal scales and inputs, zero rows, spikes."""
    lo, hi = (-7, 4) if dtype == np.float16 else (-44, 30)
    mag = (10.0 ** rng.uniform(lo, hi, size=(n, 1))).astype(np.float32)
    x = (rng.standard_normal((n, d), dtype=np.float32) * mag).astype(dtype)
    x[::97] = 0
    x[1::97] = -0.0
    x[2::53, 3 % d] = -448.0 * 3
    return x


def store_bytes(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".bin"):
            with open(os.path.join(path, f), "rb") as fh:
                out[f] = fh.read()
    return out


def build(tmp_path, name, tables, engine, monkeypatch, **kw):
    monkeypatch.setattr(builder, "FP8_ENGINE", engine)
    store = rowcache.build_store(tmp_path / name, tables, dtype="fp8", progress=False, **kw)
    store.close()
    return store_bytes(tmp_path / name)


@pytest.mark.parametrize("engine", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32), np.dtype(np.float16)])
def test_engine_store_equals_reference_store(tmp_path, rng, monkeypatch, engine, dtype):
    # 3 chunks a shard (the last partial), partial pages, d=256 (15 rows a page) and d=7
    monkeypatch.setattr(builder, "CHUNK_BYTES", 64 * 1024)
    tables = {
        "wide": mixed_rows(rng, 5003, 256, dtype),
        "narrow": mixed_rows(rng, 3001, 7, dtype),
        "one": mixed_rows(rng, 1, 256, dtype),
    }
    want = build(tmp_path, "ref", tables, "reference", monkeypatch, shard_bytes=40 * 4096)
    got = build(tmp_path, engine, tables, engine, monkeypatch, shard_bytes=40 * 4096)
    assert got.keys() == want.keys() and len(got) > 3
    for f in want:
        assert got[f] == want[f], f


def test_cpu_engine_reads_back_the_reference_rule(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(builder, "FP8_ENGINE", "cpu")
    x = mixed_rows(rng, 4099, 256, BF16)
    store = rowcache.build_store(tmp_path / "s", {"t": x}, dtype="fp8", progress=False)
    ids = rng.integers(0, x.shape[0], 700)
    codes, scales = store.read_rows("t", ids)
    want_codes, want_scales = quantize_fp8_reference(x[ids])
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(scales.view(np.uint32), want_scales.view(np.uint32))
    assert store.verify().ok
    store.close()


@pytest.mark.parametrize("engine", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_engine_refuses_nonfinite_naming_row_and_column(tmp_path, rng, monkeypatch, engine):
    monkeypatch.setattr(builder, "FP8_ENGINE", engine)
    x = rng.standard_normal((300, 16), dtype=np.float32).astype(BF16)
    x[211, 5] = np.inf
    with pytest.raises(ConfigError, match=r"row 211, column 5"):
        rowcache.build_store(tmp_path / "s", {"t": x}, dtype="fp8", progress=False)
    assert not os.path.exists(tmp_path / "s")


@pytest.mark.parametrize("engine", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_engine_allow_nonfinite_stores_the_reference_bits(tmp_path, rng, monkeypatch, engine):
    x = rng.standard_normal((300, 16), dtype=np.float32)
    x[7, 3], x[100, 0], x[101] = np.nan, -np.inf, np.inf
    kw = {"allow_nonfinite": True}
    want = build(tmp_path, "ref", {"t": x}, "reference", monkeypatch, **kw)
    got = build(tmp_path, engine, {"t": x}, engine, monkeypatch, **kw)
    assert got == want


def test_fp8_engine_setting_is_checked(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(builder, "FP8_ENGINE", "tpu")
    x = rng.standard_normal((10, 4), dtype=np.float32)
    with pytest.raises(ConfigError, match="FP8_ENGINE='tpu'"):
        rowcache.build_store(tmp_path / "s", {"t": x}, dtype="fp8", progress=False)


# --- rowcache.kernels.quantize page writers -----------------------------------------------------


def reference_pages(x, first, rpp, page_bytes):
    n = x.shape[0]
    pages = np.zeros(-(-(first + n) // rpp) * page_bytes, np.uint8)
    codes, scales = quantize_fp8_reference(x)
    kq.place_records(pages, first, codes, scales, rows_per_page=rpp, page_bytes=page_bytes)
    return pages


@pytest.mark.parametrize("d", [1, 7, 130, 256, 1021, 5000])
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)])
def test_quantize_fp8_pages_threads_equal_reference(rng, d, dtype):
    from concurrent.futures import ThreadPoolExecutor

    x = mixed_rows(rng, 1500, d, dtype)
    rpp, page_bytes = fmt.page_packing(d + 4)
    first = 3
    want = reference_pages(x, first, rpp, page_bytes)
    got = np.zeros_like(want)
    with ThreadPoolExecutor(3) as pool:
        bad = kq.quantize_fp8_pages(
            x, got, rows_per_page=rpp, page_bytes=page_bytes, first=first, pool=pool, block_rows=97
        )
    assert bad == 0
    np.testing.assert_array_equal(got, want)


def test_quantize_fp8_pages_every_bf16_value(rng):
    """All 65,280 finite bf16 values, in rows of every scale the shuffle gives."""
    bits = np.arange(65536, dtype=np.uint16)
    bits = bits[(bits & 0x7FFF) < 0x7F80]
    x = rng.permutation(np.resize(bits, 256 * 2000)).reshape(2000, 256).view(BF16)
    got = np.zeros(-(-2000 // 15) * 4096, np.uint8)
    assert kq.quantize_fp8_pages(x, got, rows_per_page=15, page_bytes=4096) == 0
    np.testing.assert_array_equal(got, reference_pages(x, 0, 15, 4096))


def test_quantize_fp8_pages_counts_nonfinite_rows(rng):
    x = rng.standard_normal((40, 8), dtype=np.float32)
    x[3, 1], x[9, 0], x[9, 2] = np.nan, np.inf, -np.inf
    pages = np.zeros(-(-40 // 341) * 4096, np.uint8)
    assert kq.quantize_fp8_pages(x, pages, rows_per_page=341, page_bytes=4096) == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rows_per_page": 0}, "rows_per_page=0"),
        ({"rows_per_page": 16}, "rows_per_page=16"),  # 16 * 260 > 4096
        ({"pages": np.zeros(100, np.uint8)}, "pages must be uint8 with at least"),
        ({"pages": np.zeros(8192, np.int8)}, "pages must be uint8"),
    ],
)
def test_quantize_fp8_pages_rejects_bad_layout(rng, kwargs, match):
    x = rng.standard_normal((20, 256), dtype=np.float32)
    args = {"pages": np.zeros(8192, np.uint8), "rows_per_page": 15, "page_bytes": 4096, **kwargs}
    with pytest.raises(ConfigError, match=match):
        kq.quantize_fp8_pages(x, **args)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [7, 256, 1021, 5000])
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)])
def test_quantize_fp8_pages_device_equals_reference(rng, d, dtype):
    x = mixed_rows(rng, 3000, d, dtype)
    rpp, page_bytes = fmt.page_packing(d + 4)
    want = reference_pages(x, 0, rpp, page_bytes)
    got = np.full_like(want, 0xAB)
    assert kq.quantize_fp8_pages_device(x, got, rows_per_page=rpp, page_bytes=page_bytes) == 0
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
def test_quantize_fp8_pages_device_subnormal_rows(rng):
    """Rows whose scale is subnormal or whose inputs are: the host redoes them, exactly."""
    x = (rng.standard_normal((600, 256), dtype=np.float32) * 1e-39).astype(np.float32)
    x[::2] *= 1e-3  # scale underflows further; some rows all-subnormal, some 0/0
    want = reference_pages(x, 0, 15, 4096)
    got = np.zeros_like(want)
    assert kq.quantize_fp8_pages_device(x, got, rows_per_page=15, page_bytes=4096) == 0
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
def test_quantize_fp8_pages_device_counts_nonfinite(rng):
    x = rng.standard_normal((40, 8), dtype=np.float32).astype(BF16)
    x[3, 1] = np.nan
    pages = np.zeros(4096, np.uint8)
    assert kq.quantize_fp8_pages_device(x, pages, rows_per_page=341, page_bytes=4096) == 1


# --- rows too small for a scale (issue 51, item 1), served in a child process -------------------

TINY_ROWS_CASE = r"""
import numpy as np
import rowcache
from rowcache.kernels import batched_embed_fp8
from rowcache.store import builder

x = np.zeros((6, 16), dtype=np.float32)
x[0, 0] = 1e-45                                   # the issue's row: [1e-45, 0, ...]
x[1, :4] = [-1e-45, 3e-45, -0.0, 2.8e-43]
x[2, 5] = np.float32(448 * 2.0**-150)             # the largest amax whose scale underflows
x[3, 7] = -6e-43                                  # the issue's bound: a subnormal scale
x[4] = np.linspace(-1e-40, 1e-40, 16)
x[5] = np.linspace(-3.0, 2.0, 16)                 # an ordinary row beside them
result = {}
for engine in ENGINES:
    builder.FP8_ENGINE = engine
    for dtype in ("float32", "bfloat16"):
        rows = x if dtype == "float32" else x.astype(rowcache.kernels.reference.BF16)
        path = f"{WORK}/s-{engine}-{dtype}"
        store = rowcache.build_store(path, {"t": rows}, dtype="fp8", progress=False)
        ids = np.arange(6)
        codes, scales = store.read_rows("t", ids)
        disk = batched_embed_fp8(ids, codes, scales).astype(np.float32)
        with rowcache.NgramRowCache(store, "t", slots=6) as cache:
            slots = cache.resolve(ids)
            served = batched_embed_fp8(slots, cache.table, cache.scales).astype(np.float32)
            cache.end_step()
        store.close()
        result[f"{engine}/{dtype}"] = {
            "finite": bool(np.isfinite(disk).all() and np.isfinite(served).all()),
            "scales": [float(s) for s in scales],
            "tiny_rows_zero": bool(not disk[:5].any() and not served[:5].any()),
            "same": bool(np.array_equal(disk.view(np.uint32), served.view(np.uint32))),
            "ordinary_err": float(np.abs(served[5] - rows[5].astype(np.float32)).max()),
        }
"""


def test_an_fp8_store_of_rows_too_small_for_a_scale_serves_zeros_not_nan(tmp_path):
    # Built, read and served through a cache in a child: [1e-45, 0, ...] was stored with
    # scale 0 and NaN codes and served as NaN (issue 51, item 1).
    from tests.store.refusals import run_cases

    native = importlib.util.find_spec("rowcache.kernels._quantize") is not None
    engines = ["reference"] + (["cpu"] if native else [])
    code = f"ENGINES = {engines!r}\nWORK = {str(tmp_path)!r}\n" + TINY_ROWS_CASE
    out = run_cases({"tiny": [("python", code)]}, tmp_path)["tiny"]
    assert out["status"] == 0, out
    (call,) = out["calls"]
    assert "error" not in call, call
    got = call["result"]
    assert len(got) == 2 * len(engines)
    for name, r in got.items():
        assert r["finite"] and r["tiny_rows_zero"] and r["same"], (name, r)
        assert r["scales"][:3] == [1.0, 1.0, 1.0], (name, r["scales"])
        assert all(s > 0 for s in r["scales"]), (name, r["scales"])
        assert r["ordinary_err"] <= 3.0 / 16, (name, r)
