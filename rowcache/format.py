"""The on-disk layout of a store: record bytes, page packing, shard keys, meta record.

Owns the arithmetic that maps a row id to (shard, byte offset) and the encoding of
rows into fixed-size records; the builder and the readers both use it, so they can
never disagree. Does not do any I/O.

Layout. A row is one *record*: BF16 rows are ``dim * 2`` bytes; FP8 rows are
``dim`` E4M3 codes followed by their float32 scale (little endian), ``dim + 4``
bytes, so one read fetches both. Records are packed into 4 KiB pages without
straddling a page (``rows_per_page = 4096 // record_bytes``; the page tail is
padding); a record larger than a page starts a page of its own. A table is split
into shard files of ``pages_per_shard`` pages each (the last may be shorter).
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from typing import Any, Literal

import ml_dtypes
import numpy as np

from .errors import ConfigError, FormatError

PAGE = 4096
FORMAT_NAME = "rowcache-store"
FORMAT_VERSION = 1
DTYPES = ("bf16", "fp8")
META_KEY = b"M"
SHARD_PREFIX = b"S"
INDEX_NAME = "index.lmdb"

Dtype = Literal["bf16", "fp8"]


def record_bytes(dim: int, dtype: str) -> int:
    """Bytes of one stored row: ``2*dim`` for bf16, ``dim + 4`` (codes + f32 scale) for fp8."""
    if dtype == "bf16":
        return 2 * dim
    if dtype == "fp8":
        return dim + 4
    raise ConfigError(f"dtype={dtype!r} is not supported; allowed: {', '.join(DTYPES)}")


def page_packing(rec: int) -> tuple[int, int]:
    """``(rows_per_page, page_bytes)`` so that no record straddles a 4 KiB page."""
    if rec <= PAGE:
        return PAGE // rec, PAGE
    return 1, -(-rec // PAGE) * PAGE


def shard_key(table: int, shard: int) -> bytes:
    """LMDB key of a shard record; big-endian so keys sort numerically."""
    return SHARD_PREFIX + struct.pack(">IQ", table, shard)


def shard_file_name(table: int, shard: int) -> str:
    return f"t{table:04d}-s{shard:06d}.bin"


@dataclass(frozen=True)
class TableInfo:
    """One table of a store.

    ``rows`` x ``dim`` values of ``dtype``; ``record_bytes`` per stored row, packed
    ``rows_per_page`` to a page of ``page_bytes``; ``pages_per_shard`` pages per
    shard file, ``shards`` files in all.
    """

    name: str
    rows: int
    dim: int
    dtype: str
    record_bytes: int
    rows_per_page: int
    page_bytes: int
    pages_per_shard: int
    shards: int

    @property
    def rows_per_shard(self) -> int:
        return self.rows_per_page * self.pages_per_shard

    @property
    def nbytes(self) -> int:
        """Bytes of the table's values (not counting page padding or scales)."""
        return self.rows * self.dim * (2 if self.dtype == "bf16" else 1)

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """``(first_row, row_count)`` of shard ``shard``."""
        first = shard * self.rows_per_shard
        return first, min(self.rows_per_shard, self.rows - first)

    def shard_bytes(self, shard: int) -> int:
        """File length of shard ``shard`` (the last page is not padded)."""
        _, n = self.shard_rows(shard)
        full, rest = divmod(n, self.rows_per_page)
        return full * self.page_bytes + rest * self.record_bytes

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shard index and byte offset inside the shard of each row (vectorized)."""
        r = np.asarray(rows, dtype=np.int64)
        page, slot = np.divmod(r, self.rows_per_page)
        shard, page_in_shard = np.divmod(page, self.pages_per_shard)
        return shard, page_in_shard * self.page_bytes + slot * self.record_bytes

    @staticmethod
    def make(name: str, rows: int, dim: int, dtype: str, shard_bytes: int) -> TableInfo:
        rec = record_bytes(dim, dtype)
        rpp, page_bytes = page_packing(rec)
        pps = max(1, shard_bytes // page_bytes)
        pages = -(-rows // rpp)
        return TableInfo(
            name=name,
            rows=rows,
            dim=dim,
            dtype=dtype,
            record_bytes=rec,
            rows_per_page=rpp,
            page_bytes=page_bytes,
            pages_per_shard=pps,
            shards=max(1, -(-pages // pps)),
        )


def encode_records(dtype: str, values: np.ndarray | tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Records ``uint8 [n, record_bytes]`` of bf16 rows or of ``(codes, scales)``."""
    if dtype == "bf16":
        v = np.ascontiguousarray(values)
        return v.view(np.uint8).reshape(v.shape[0], -1)
    codes, scales = values
    n, dim = codes.shape
    out = np.empty((n, dim + 4), dtype=np.uint8)
    out[:, :dim] = codes
    out[:, dim:] = np.ascontiguousarray(scales, dtype="<f4").view(np.uint8).reshape(n, 4)
    return out


def decode_records(
    dtype: str, dim: int, records: np.ndarray
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`encode_records`: bf16 ``[n, dim]`` or ``(codes, scales)``."""
    n = records.shape[0]
    if dtype == "bf16":
        return np.ascontiguousarray(records[:, : 2 * dim]).view(ml_dtypes.bfloat16).reshape(n, dim)
    codes = np.ascontiguousarray(records[:, :dim])
    scales = (
        np.ascontiguousarray(records[:, dim : dim + 4]).view("<f4").reshape(n).astype(np.float32)
    )
    return codes, scales


@dataclass(frozen=True)
class ShardRecord:
    """The LMDB record of one shard file."""

    table: int
    shard: int
    first_row: int
    rows: int
    file: str
    offset: int
    length: int
    crc32: int

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @staticmethod
    def from_bytes(raw: bytes) -> ShardRecord:
        try:
            return ShardRecord(**json.loads(raw))
        except (ValueError, TypeError) as e:
            raise FormatError(f"shard record is unreadable: {e}") from e


def meta_to_bytes(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, sort_keys=True).encode()


def parse_meta(raw: bytes | None, path: str) -> tuple[str, list[TableInfo], dict[str, Any]]:
    """Validate a meta record; FormatError naming the field on any mismatch."""
    if raw is None:
        raise FormatError(
            f"{path}: no meta record; this is not a complete rowcache store "
            "(an interrupted build leaves none); rebuild it with overwrite=True"
        )
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise FormatError(f"{path}: meta record is not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise FormatError(f"{path}: meta record is not an object")
    if meta.get("format") != FORMAT_NAME:
        raise FormatError(
            f"{path}: meta field 'format' is {meta.get('format')!r}, expected {FORMAT_NAME!r}"
        )
    if meta.get("version") != FORMAT_VERSION:
        raise FormatError(
            f"{path}: meta field 'version' is {meta.get('version')!r}; this rowcache reads "
            f"version {FORMAT_VERSION}"
        )
    if meta.get("page_size") != PAGE:
        raise FormatError(
            f"{path}: meta field 'page_size' is {meta.get('page_size')!r}, expected {PAGE}"
        )
    dtype = meta.get("dtype")
    if dtype not in DTYPES:
        raise FormatError(f"{path}: meta field 'dtype' is {dtype!r}; allowed: {', '.join(DTYPES)}")
    raw_tables = meta.get("tables")
    if not isinstance(raw_tables, list) or not raw_tables:
        raise FormatError(f"{path}: meta field 'tables' must be a non-empty list")
    tables = []
    for i, t in enumerate(raw_tables):
        try:
            info = TableInfo(**t)
        except TypeError as e:
            raise FormatError(f"{path}: meta field 'tables[{i}]' is malformed ({e})") from e
        expect = TableInfo.make(
            info.name, info.rows, info.dim, dtype, info.pages_per_shard * info.page_bytes
        )
        for field in ("dtype", "record_bytes", "rows_per_page", "page_bytes", "shards"):
            if getattr(info, field) != getattr(expect, field):
                raise FormatError(
                    f"{path}: meta field 'tables[{i}].{field}' is {getattr(info, field)!r}, "
                    f"inconsistent with dim={info.dim} dtype={dtype} (expected {getattr(expect, field)!r})"
                )
        tables.append(info)
    return dtype, tables, meta
