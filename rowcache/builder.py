"""The streaming store builder: tables in, shard files + LMDB index out.

Owns ``build_store``: it streams each table in chunks of a few tens of MB (memory
stays bounded whatever the table size), converts rows to records (BF16 as is, FP8
quantized on build with the per-row absmax rule of ``kernels.reference``), packs
records into 4 KiB pages, writes shard files with a CRC32 each, and commits the
LMDB meta record last. The build happens in a sibling temporary directory that is
renamed into place only when complete, so an interrupted build never opens as a
store and never harms the store it was meant to replace.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import uuid
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lmdb
import numpy as np

from kernels.reference import quantize_fp8_reference

from . import format as fmt
from .errors import ConfigError
from .sources import BF16, Source, resolve_source

CHUNK_BYTES = 32 << 20  # input bytes per streamed chunk
MAP_SIZE = 1 << 34  # LMDB map size: address space only, the file grows with data


def _tables_dict(tables: Any) -> dict[str, Any]:
    if isinstance(tables, Mapping):
        items = {str(k): v for k, v in tables.items()}
    elif isinstance(tables, Sequence) and not isinstance(tables, (str, bytes)):
        items = {str(i): v for i, v in enumerate(tables)}
    else:
        raise ConfigError(
            f"tables must be a dict {{name: source}} or a list of sources, got {type(tables).__name__}"
        )
    if not items:
        raise ConfigError("tables is empty; give at least one table")
    return items


def _to_records(dtype: str, block: np.ndarray) -> np.ndarray:
    """uint8 [n, record_bytes] for a block of source rows."""
    if dtype == "bf16":
        if block.dtype != BF16:
            block = block.astype(np.float32, copy=False).astype(BF16)
        return fmt.encode_records("bf16", block)
    return fmt.encode_records("fp8", quantize_fp8_reference(block))


def _pack_pages(info: fmt.TableInfo, records: np.ndarray) -> np.ndarray:
    """Lay records out in pages (zero padding at page ends); the last page is not padded."""
    n, rec = records.shape
    rpp = info.rows_per_page
    if info.page_bytes == rpp * rec:
        return records.reshape(-1)
    full, rest = divmod(n, rpp)
    out = np.zeros(full * info.page_bytes + rest * rec, dtype=np.uint8)
    if full:
        pages = out[: full * info.page_bytes].reshape(full, info.page_bytes)
        pages[:, : rpp * rec] = records[: full * rpp].reshape(full, rpp * rec)
    if rest:
        out[full * info.page_bytes :] = records[full * rpp :].reshape(-1)
    return out


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _write_table(
    root: str,
    t: int,
    src: Source,
    info: fmt.TableInfo,
    dtype: str,
    pool: ThreadPoolExecutor,
    bar: Any,
) -> list[fmt.ShardRecord]:
    row_bytes = src.dim * src.array.dtype.itemsize
    chunk_rows = max(info.rows_per_page, CHUNK_BYTES // max(1, row_bytes))
    chunk_rows -= chunk_rows % info.rows_per_page
    shards = []
    for s in range(info.shards):
        first, count = info.shard_rows(s)
        name = fmt.shard_file_name(t, s)
        fd = os.open(os.path.join(root, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        crc, length = 0, 0
        pending: list[Any] = []  # futures of the chunk being written and checksummed
        try:
            for start in range(first, first + count, chunk_rows):
                stop = min(start + chunk_rows, first + count)
                # Prepare this chunk while the previous one is written and checksummed
                # (os.write and zlib.crc32 release the GIL).
                data = _pack_pages(info, _to_records(dtype, src.read(start, stop)))
                for f in pending:
                    f.result()
                crc = pending[1].result() if pending else crc
                mv = memoryview(data.data)
                pending = [pool.submit(_write_all, fd, mv), pool.submit(zlib.crc32, mv, crc)]
                length += data.nbytes
                if bar is not None:
                    bar.update((stop - start) * row_bytes)
            if pending:
                pending[0].result()
                crc = pending[1].result()
            os.fsync(fd)
        finally:
            for f in pending:  # never close the file under a write still running
                f.exception()
            os.close(fd)
        if length != info.shard_bytes(s):  # internal invariant of the layout arithmetic
            raise AssertionError(
                f"shard {name}: wrote {length} bytes, layout says {info.shard_bytes(s)}"
            )
        shards.append(fmt.ShardRecord(t, s, first, count, name, 0, length, crc))
    return shards


def build_store(
    path: str | os.PathLike[str],
    tables: Any,
    *,
    dtype: str = "bf16",
    overwrite: bool = False,
    progress: bool = True,
    shard_bytes: int = 1 << 30,
) -> Any:
    """Build a store at ``path`` from ``tables`` and return it opened (a ``RowStore``).

    Parameters
    ----------
    path : directory to create (must not exist unless ``overwrite=True``).
    tables : ``{name: source}`` or a list of sources (named ``"0"``, ``"1"``, ...).
        A source is a 2-D array ``[rows, dim]`` (``ml_dtypes.bfloat16``, float32 or
        float16), a ``.npy`` path (bf16 may be stored as its uint16 view), or a
        ``(file.safetensors, tensor_name)`` pair / ``"file.safetensors:tensor_name"``.
    dtype : ``"bf16"`` (float sources round to nearest even) or ``"fp8"``
        (quantize on build: per row, scale = amax(|x|)/448 in float32, 1.0 for an
        all-zero row; codes = satfinite E4M3 of ``x / scale``, from the source values).
    overwrite : replace an existing store at ``path``; the old one stays intact until
        the new one is complete.
    progress : show a progress bar (tqdm, on stderr).
    shard_bytes : target shard file size (rounded down to whole pages, at least one).

    Crash safety: the store is built in a temporary sibling directory whose meta
    record is committed last, then renamed to ``path``. An exception leaves ``path``
    as it was.
    """
    from .store import RowStore

    if dtype not in fmt.DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; allowed: {', '.join(fmt.DTYPES)}")
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ConfigError(f"shard_bytes={shard_bytes!r}: give a positive number of bytes")
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise ConfigError(f"path {path!r} already exists; pass overwrite=True to replace it")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"path {path!r} exists and is not a directory; refusing to replace it")
    sources = [resolve_source(n, s) for n, s in _tables_dict(tables).items()]
    infos = [fmt.TableInfo.make(s.name, s.rows, s.dim, dtype, shard_bytes) for s in sources]

    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.building-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        total = sum(s.rows * s.dim * s.array.dtype.itemsize for s in sources)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"build {dtype}", leave=False)
        try:
            with ThreadPoolExecutor(2) as pool:
                shard_recs = [
                    _write_table(tmp, t, s, info, dtype, pool, bar)
                    for t, (s, info) in enumerate(zip(sources, infos))
                ]
        finally:
            if bar is not None:
                bar.close()
        env = lmdb.open(os.path.join(tmp, fmt.INDEX_NAME), map_size=MAP_SIZE, subdir=True)
        try:
            with env.begin(write=True) as txn:
                for recs in shard_recs:
                    for r in recs:
                        txn.put(fmt.shard_key(r.table, r.shard), r.to_bytes())
            meta = {
                "format": fmt.FORMAT_NAME,
                "version": fmt.FORMAT_VERSION,
                "page_size": fmt.PAGE,
                "dtype": dtype,
                "tables": [info.__dict__ for info in infos],
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "params": {
                    "shard_bytes": shard_bytes,
                    "sources": [s.origin for s in sources],
                    "fp8_rule": "scale=amax/448 (1 if 0); codes=satfinite_e4m3(x/scale)"
                    if dtype == "fp8"
                    else None,
                },
            }
            # The meta record goes last, in its own transaction: without it the store never opens.
            with env.begin(write=True) as txn:
                txn.put(fmt.META_KEY, fmt.meta_to_bytes(meta))
            env.sync(True)
        finally:
            env.close()
        old = None
        if os.path.exists(path):
            old = os.path.join(parent, f".{os.path.basename(path)}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return RowStore.open(path)
