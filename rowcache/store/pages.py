"""Rows into the store's pages: what the builder writes for a chunk of a table.

Owns the conversion of a block of source rows into records (BF16 as is, FP8 quantized
with the per-row absmax rule of ``rowcache.kernels.reference``, rows already encoded by a
verbatim codec such as ``fp8_table_scale`` or ``fp8_block_e8m0`` as they are), the refusal of non-finite values
(and NaN E4M3 codes) naming table, row and column, the packing of records into whole 4 KiB pages, and
:class:`Fp8Pages`: FP8 chunks quantized straight into a ring of reused page buffers (on
the GPU, or by native C threads over row blocks; the reference where neither runs, the
same bits every way). ``rowcache.store.builder`` streams chunks through these and writes them.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.format import layout as fmt
from rowcache.format.codecs import get_codec, refuse_nan_codes
from rowcache.kernels import quantize as _quantize
from rowcache.kernels.reference import BF16, quantize_fp8_reference
from rowcache.store.sources import Source


def check_finite(block: np.ndarray, name: str, first_row: int) -> None:
    """ConfigError naming table, row and column of the first NaN/Inf of ``block`` (of the
    first NaN code, 0x7F or 0xFF, of a block of uint8 E4M3 codes)."""
    if block.dtype == np.uint8:  # E4M3FN: no Inf; NaN is S.1111.111
        refuse_nan_codes(block, name, first_row)
        return
    if block.dtype == BF16:  # exponent all ones: Inf or NaN; |bits| >= 0x7F80 (one pass + max)
        bits = block.view(np.uint16) & 0x7FFF
        if block.size == 0 or int(bits.max()) < 0x7F80:
            return
        bad = bits >= 0x7F80
    else:
        if np.isfinite(block).all():
            return
        bad = ~np.isfinite(block)
    r, c = divmod(int(np.flatnonzero(bad.reshape(-1))[0]), block.shape[1])
    count = int(np.count_nonzero(bad))
    raise ConfigError(
        f"tables[{name!r}]: row {first_row + r}, column {c} is {float(block[r, c])} "
        f"({count} non-finite values in rows {first_row}..{first_row + block.shape[0] - 1}); "
        "a NaN or Inf would be stored as a NaN row; fix the source, or pass "
        "allow_nonfinite=True to store it anyway"
    )


def to_records(dtype: str, block: np.ndarray) -> np.ndarray:
    """uint8 [n, record_bytes] for a block of source rows: values of a bf16 or fp8 build
    (rounded or quantized here), or rows already in a verbatim codec's encoding."""
    codec = get_codec(dtype)
    if dtype == "bf16":
        if block.dtype != BF16:
            block = block.astype(np.float32, copy=False).astype(BF16)
        return codec.encode(block)
    if dtype == "fp8":
        return codec.encode(quantize_fp8_reference(block))
    return codec.encode(block)  # encoded rows (codes, or records of codes and scales): verbatim


def pack_pages(info: fmt.TableInfo, records: np.ndarray) -> np.ndarray:
    """Lay records out in whole pages (zero padding at page ends and after the last row)."""
    n, rec = records.shape
    rpp = info.rows_per_page
    if info.page_bytes == rpp * rec and n % rpp == 0:
        return records.reshape(-1)
    full, rest = divmod(n, rpp)
    out = np.zeros(-(-n // rpp) * info.page_bytes, dtype=np.uint8)
    pages = out.reshape(-1, info.page_bytes)
    if full:
        pages[:full, : rpp * rec] = records[: full * rpp].reshape(full, rpp * rec)
    if rest:
        pages[full, : rest * rec] = records[full * rpp :].reshape(-1)
    return out


class Fp8Pages:
    """FP8 chunks straight into reused page buffers (no records array, no packing copy).

    A ring of ``depth`` buffers: a buffer is reused only once the write and the page CRCs
    of the chunk it held are done, so the quantize of chunk k overlaps the write of k-1.
    """

    def __init__(
        self,
        info: fmt.TableInfo,
        chunk_rows: int,
        engine: str,
        threads: int | None = None,
        depth: int = 3,
    ):
        self.info, self.engine = info, engine
        size = -(-chunk_rows // info.rows_per_page) * info.page_bytes
        self.buffers = [np.zeros(size, dtype=np.uint8) for _ in range(depth)]
        self.busy: list[list[Any]] = [[] for _ in range(depth)]
        self.k = 0
        # Every core but one, which the chunk writes and page CRCs keep busy: on the 2-core
        # dev machine 1 quantize thread builds at 2.2x plain write, 2 threads at 1.6x
        # (bench/build.py; docs/benchmarks.md, "Building and the full-size store").
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self.threads = threads or max(1, (cores or 1) - 1)
        self.pool = (
            ThreadPoolExecutor(self.threads) if engine == "cpu" and self.threads > 1 else None
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()

    def encode(
        self, src: Source, start: int, stop: int, allow_nonfinite: bool
    ) -> tuple[np.ndarray, int]:
        """Pages of rows ``[start, stop)`` (a view of a ring buffer) and the ring slot."""
        info, n = self.info, stop - start
        slot = self.k % len(self.buffers)
        self.k += 1
        for f in self.busy[slot]:
            f.result()
        self.busy[slot] = []
        buf = self.buffers[slot][: -(-n // info.rows_per_page) * info.page_bytes]
        block = src.view(start, stop) if self.engine != "cuda" else src.read(start, stop)
        kw = {"rows_per_page": info.rows_per_page, "page_bytes": info.page_bytes}
        if self.engine == "cuda":
            bad = _quantize.quantize_fp8_pages_device(block, buf, **kw)
        elif self.engine == "cpu":
            bad = _quantize.quantize_fp8_pages(block, buf, pool=self.pool, **kw)
        else:
            bad = -1
        if bad:  # the reference (NaN/Inf rows, or the "reference" engine): one path for all
            if bad > 0 and not allow_nonfinite:
                check_finite(np.asarray(block), src.name, start)
            buf[:] = pack_pages(info, to_records("fp8", np.asarray(block)))
        else:
            rest = n % info.rows_per_page  # zero the tail of a last, partial page
            if rest:
                buf[(n // info.rows_per_page) * info.page_bytes + rest * info.record_bytes :] = 0
        return buf, slot
