"""The on-disk layout of a store: record bytes, page packing, shard keys, meta record.

Owns the arithmetic that maps a row id to (shard, byte offset) and the encoding of
rows into fixed-size records; the builder (``rowcache.store``) and the readers
(``rowcache.io``) both import it from here, beneath both, so they can never disagree. Does
not do any I/O; the page checksums themselves are computed by ``rowcache.io.checksum``.

Layout. A row is one *record*, encoded by the store's codec (``rowcache.format.codecs``):
BF16 rows are ``dim * 2`` bytes; FP8 rows are ``dim`` E4M3 codes followed by their float32
scale (little endian), ``dim + 4`` bytes, so one read fetches both; ``fp8_table_scale`` rows
are their ``dim`` E4M3 codes, the table's one bf16 scale in the meta record; ``fp8_block_e8m0``
rows their ``dim`` E4M3 codes then one UE8M0 byte a block (``dim + dim / block_size``,
the block size in the meta record). Records are packed into 4 KiB pages without
straddling a page (``rows_per_page = 4096 // record_bytes``; the page tail is
padding); a record larger than a page starts a page of its own. A table is split
into shard files of ``pages_per_shard`` pages each (the last may be shorter); every
shard file is padded with zeros to a whole number of 4 KiB pages.

Checksums (format version 2). Every 4 KiB page of every shard file has a CRC32C
(Castagnoli, initial value 0: ``crc32c.crc32c(page)``). The CRCs of shard ``s`` of
table ``t`` are one LMDB record, key ``b"C" + >IQ(t, s)``, value the little-endian
uint32 array (one entry per page); its shard record carries ``pages`` (the array's
length) and ``page_crc32c`` (the CRC32C of the array's bytes), checked at open. Why
in LMDB and not a sidecar file per shard: they are committed in the same transaction
as the shard records, before the meta record, so a store can never be valid with
missing or stale checksums, there is no second kind of file whose presence, name and
own integrity must be tracked, and an opened handle holds every CRC in memory (4
bytes per 4 KiB page: 61 MB for the 62.8 GB LongCat table set).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from rowcache.errors import FormatError
from rowcache.format.codecs import CODECS, get_codec

PAGE = 4096
FORMAT_NAME = "rowcache-store"
FORMAT_VERSION = 3  # 2: shard files padded to whole pages, a CRC32C per page; 3: codecs
READ_VERSIONS = (2, 3)  # what this rowcache opens
DTYPES = tuple(CODECS)  # the codecs' names, the meta record's `dtype`
DTYPES_V2 = ("bf16", "fp8")  # the codecs a version 2 store may name (its tables have no params)
META_KEY = b"M"
SHARD_PREFIX = b"S"
CRC_PREFIX = b"C"
INDEX_NAME = "index.lmdb"
INDEX_FILE = "data.mdb"  # the LMDB data file inside INDEX_NAME
MARKER_NAME = "rowcache-store.json"  # the marker a build writes last (``rowcache.store.marker``)

Dtype = Literal["bf16", "fp8", "fp8_table_scale", "fp8_block_e8m0"]


def write_version(dtype: str) -> int:
    """The format version a build of codec ``dtype`` writes: the lowest that describes it
    (2 for bf16 and fp8, whose bytes version 3 did not change, so rowcaches before codecs
    still read them; 3 for the codecs that came with it)."""
    return 2 if dtype in DTYPES_V2 else FORMAT_VERSION


def record_bytes(dim: int, dtype: str, params: dict[str, Any] | None = None) -> int:
    """Bytes of one stored row of codec ``dtype`` (of a table of ``params``): ``2*dim`` for
    bf16, ``dim + 4`` (codes + f32 scale) for fp8, ``dim`` for fp8_table_scale, ``dim + dim /
    block_size`` for fp8_block_e8m0 (``rowcache.format.codecs``)."""
    return get_codec(dtype).record_bytes(dim, params)


def page_packing(rec: int) -> tuple[int, int]:
    """``(rows_per_page, page_bytes)`` so that no record straddles a 4 KiB page."""
    if rec <= PAGE:
        return PAGE // rec, PAGE
    return 1, -(-rec // PAGE) * PAGE


def shard_key(table: int, shard: int) -> bytes:
    """LMDB key of a shard record; big-endian so keys sort numerically."""
    return SHARD_PREFIX + struct.pack(">IQ", table, shard)


def crc_key(table: int, shard: int) -> bytes:
    """LMDB key of the page-CRC record of a shard (uint32 little endian, one per 4 KiB page)."""
    return CRC_PREFIX + struct.pack(">IQ", table, shard)


def shard_file_name(table: int, shard: int) -> str:
    return f"t{table:04d}-s{shard:06d}.bin"


def check_file_name(name: Any, where: str) -> str:
    """``name`` if it is a plain file name inside the store directory, else FormatError.

    A store can come from someone else: its records must never make a reader open a
    file outside the store (an absolute path, ``..``, a separator) or the index itself.
    """
    ok = (
        type(name) is str
        and name not in ("", ".", "..", INDEX_NAME, MARKER_NAME)
        and not name.startswith(".")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and (os.altsep is None or os.altsep not in name)
    )
    if not ok:
        raise FormatError(
            f"{where}: field 'file' is {name!r}; a shard file must be a plain file name "
            "inside the store (no directory, no '..', not hidden, not the index or the marker)"
        )
    return name


def _check_int(obj: dict[str, Any], key: str, where: str, low: int = 0) -> int:
    """``obj[key]`` if it is a JSON integer >= ``low`` (not a float, string or bool)."""
    v = obj.get(key)
    if type(v) is not int or v < low:
        raise FormatError(f"{where}: field {key!r} is {v!r}; expected an integer >= {low}")
    return v


@dataclass(frozen=True)
class TableInfo:
    """One table of a store.

    ``rows`` x ``dim`` values of ``dtype`` (the codec's name); ``record_bytes`` per stored
    row, packed ``rows_per_page`` to a page of ``page_bytes``; ``pages_per_shard`` pages per
    shard file, ``shards`` files in all; ``params`` the codec's table-level parameters
    (``{}``, ``{"scale": s}`` for ``fp8_table_scale``, ``{"block_size": B}`` for
    ``fp8_block_e8m0``).
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
    params: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def codec(self) -> Any:
        """The table's :class:`rowcache.format.codecs.RowCodec`."""
        return get_codec(self.dtype)

    def to_meta(self, version: int) -> dict[str, Any]:
        """The table's entry of a meta record of format ``version`` (2: no ``params``)."""
        entry = {**asdict(self), "params": dict(self.params)}
        if version < 3:
            del entry["params"]
        return entry

    @property
    def rows_per_shard(self) -> int:
        return self.rows_per_page * self.pages_per_shard

    @property
    def nbytes(self) -> int:
        """Bytes of the table's values (not counting page padding or scales)."""
        return self.rows * self.codec.value_bytes(self.dim)

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """``(first_row, row_count)`` of shard ``shard``."""
        first = shard * self.rows_per_shard
        return first, min(self.rows_per_shard, self.rows - first)

    def shard_bytes(self, shard: int) -> int:
        """File length of shard ``shard``: whole pages (the last one zero-padded)."""
        _, n = self.shard_rows(shard)
        return -(-n // self.rows_per_page) * self.page_bytes

    def shard_pages(self, shard: int) -> int:
        """Number of 4 KiB checksum pages of shard ``shard``."""
        return self.shard_bytes(shard) // PAGE

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shard index and byte offset inside the shard of each row (vectorized)."""
        r = np.asarray(rows, dtype=np.int64)
        page, slot = np.divmod(r, self.rows_per_page)
        shard, page_in_shard = np.divmod(page, self.pages_per_shard)
        return shard, page_in_shard * self.page_bytes + slot * self.record_bytes

    @staticmethod
    def make(
        name: str,
        rows: int,
        dim: int,
        dtype: str,
        shard_bytes: int,
        params: dict[str, Any] | None = None,
    ) -> TableInfo:
        rec = record_bytes(dim, dtype, params)
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
            params=dict(params or {}),
        )


def encode_records(dtype: str, values: Any) -> np.ndarray:
    """Records ``uint8 [n, record_bytes]`` of rows in codec ``dtype``'s encoding (bf16
    rows, ``(codes, scales)`` for fp8, codes for fp8_table_scale)."""
    return get_codec(dtype).encode(values)


def decode_records(dtype: str, dim: int, records: np.ndarray) -> Any:
    """Inverse of :func:`encode_records`: bf16 ``[n, dim]``, ``(codes, scales)`` or codes."""
    return get_codec(dtype).decode(dim, records)


_SHARD_INT_FIELDS = ("table", "shard", "first_row", "rows", "offset", "length", "pages")


@dataclass(frozen=True)
class ShardRecord:
    """The LMDB record of one shard file.

    ``pages`` 4 KiB pages of ``length`` bytes; ``page_crc32c`` is the CRC32C of the
    shard's page-CRC record (see the module docstring), so that record is checked too.
    """

    table: int
    shard: int
    first_row: int
    rows: int
    file: str
    offset: int
    length: int
    pages: int
    page_crc32c: int

    @property
    def crc32(self) -> int:
        """The shard's digest (``page_crc32c``), under the name format 1 used."""
        return self.page_crc32c

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @staticmethod
    def from_bytes(raw: bytes, where: str = "shard record") -> ShardRecord:
        """Parse and type-check a record: every field present, ints are ints, a plain file."""
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
            raise FormatError(f"{where} is not valid JSON ({e})") from e
        if not isinstance(obj, dict):
            raise FormatError(f"{where} is not a JSON object")
        want = {*_SHARD_INT_FIELDS, "file", "page_crc32c"}
        if set(obj) != want:
            extra, missing = sorted(set(obj) - want), sorted(want - set(obj))
            raise FormatError(f"{where} has unknown fields {extra} / lacks fields {missing}")
        ints = {k: _check_int(obj, k, where) for k in _SHARD_INT_FIELDS}
        crc = obj["page_crc32c"]
        if type(crc) is not int or not 0 <= crc < 1 << 32:
            raise FormatError(f"{where}: field 'page_crc32c' is {crc!r}; expected a uint32")
        return ShardRecord(file=check_file_name(obj["file"], where), page_crc32c=crc, **ints)


def meta_to_bytes(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, sort_keys=True).encode()


_TABLE_INT_FIELDS = {
    "rows": 1,
    "dim": 1,
    "record_bytes": 1,
    "rows_per_page": 1,
    "page_bytes": PAGE,
    "pages_per_shard": 1,
    "shards": 1,
}


def _parse_table(t: Any, i: int, dtype: str, path: str, version: int) -> TableInfo:
    where = f"{path}: meta field 'tables[{i}]'"
    if not isinstance(t, dict):
        raise FormatError(f"{where} is {type(t).__name__}, expected an object")
    want = {"name", "dtype", *_TABLE_INT_FIELDS} | ({"params"} if version >= 3 else set())
    if set(t) != want:
        extra, missing = sorted(set(t) - want), sorted(want - set(t))
        raise FormatError(f"{where} is malformed (unknown fields {extra}, missing {missing})")
    if type(t["name"]) is not str or not t["name"]:
        raise FormatError(f"{where}: field 'name' is {t['name']!r}; expected a non-empty string")
    ints = {k: _check_int(t, k, where, low) for k, low in _TABLE_INT_FIELDS.items()}
    params = get_codec(dtype).check_params(t.get("params", {}), f"{where}", ints["dim"])
    info = TableInfo(name=t["name"], dtype=t["dtype"], params=params, **ints)
    expect = TableInfo.make(
        info.name, info.rows, info.dim, dtype, info.pages_per_shard * info.page_bytes, params
    )
    for name in ("dtype", "record_bytes", "rows_per_page", "page_bytes", "shards"):
        if getattr(info, name) != getattr(expect, name):
            raise FormatError(
                f"{path}: meta field 'tables[{i}].{name}' is {getattr(info, name)!r}, "
                f"inconsistent with dim={info.dim} dtype={dtype} (expected {getattr(expect, name)!r})"
            )
    return info


def parse_meta(raw: bytes | None, path: str) -> tuple[str, list[TableInfo], dict[str, Any]]:
    """Validate a meta record; FormatError naming the field on any mismatch."""
    if raw is None:
        raise FormatError(
            f"{path}: no meta record; this is not a complete rowcache store "
            "(an interrupted build leaves none); rebuild it with `rowcache build`"
        )
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
        raise FormatError(f"{path}: meta record is not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise FormatError(f"{path}: meta record is not an object")
    if meta.get("format") != FORMAT_NAME:
        raise FormatError(
            f"{path}: meta field 'format' is {meta.get('format')!r}, expected {FORMAT_NAME!r}"
        )
    version = meta.get("version")
    if version not in READ_VERSIONS or type(version) is not int:
        age = (
            "an older format"
            if type(version) is int and version < min(READ_VERSIONS)
            else "not a format this rowcache knows"
        )
        raise FormatError(
            f"{path}: meta field 'version' is {version!r} ({age}); this rowcache reads "
            f"format versions {', '.join(map(str, READ_VERSIONS))}; rebuild the store with "
            "`rowcache build`"
        )
    if meta.get("page_size") != PAGE or type(meta.get("page_size")) is not int:
        raise FormatError(
            f"{path}: meta field 'page_size' is {meta.get('page_size')!r}, expected {PAGE}"
        )
    dtype = meta.get("dtype")
    allowed = DTYPES if version >= 3 else DTYPES_V2
    if not isinstance(dtype, str) or dtype not in allowed:
        raise FormatError(
            f"{path}: meta field 'dtype' is {dtype!r}; allowed in format version {version}: "
            f"{', '.join(allowed)}"
        )
    raw_tables = meta.get("tables")
    if not isinstance(raw_tables, list) or not raw_tables:
        raise FormatError(f"{path}: meta field 'tables' must be a non-empty list")
    tables = [_parse_table(t, i, dtype, path, version) for i, t in enumerate(raw_tables)]
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise FormatError(f"{path}: meta field 'tables' names table {dup!r} twice")
    return dtype, tables, meta
