"""The streaming store builder: tables in, shard files + LMDB index out.

Owns ``build_store``: it streams each table in chunks of a few tens of MB (memory
stays bounded whatever the table size), has each chunk checked and made into whole 4 KiB
pages of records (``rowcache.store.pages``: non-finite values refused unless allowed, BF16
as is, encoded rows of a verbatim codec (``fp8_table_scale``: E4M3 codes) as they are, FP8
quantized on build with the per-row absmax rule of ``rowcache.kernels.reference``, on
the GPU when one is usable, else by native C threads over row blocks, the same bits
either way; the engine chosen here, ``FP8_ENGINE``), writes
shard files with a CRC32C per page (the write and CRC of a chunk overlap the next one's
read and quantize), commits the LMDB meta record last and then writes the store's marker
(``rowcache.store.marker``: the index's length and CRC32C). It checks the free space up
front (``needed_bytes``). The build happens in a locked sibling directory, opened as a
store (the one ``build_store`` returns) before ``rowcache.store.replace.switch`` makes it
the store at ``path`` in one atomic exchange, so ``path`` always holds a complete store.
"""

from __future__ import annotations

import datetime as _dt
import errno
import logging
import mmap
import os
import resource
import shutil
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import crc32c
import lmdb
import numpy as np

from rowcache.errors import ConfigError, FormatError
from rowcache.format import layout as fmt
from rowcache.format.codecs import get_codec
from rowcache.io import checksum
from rowcache.kernels.loader import gpu_available
from rowcache.store import replace
from rowcache.store.handle import RowStore, lmdb_error
from rowcache.store.marker import is_store, write_marker
from rowcache.store.pages import Fp8Pages, check_finite, pack_pages, to_records
from rowcache.store.sources import Source, resolve_source

log = logging.getLogger(__name__)

CHUNK_BYTES = 32 << 20  # input bytes per streamed chunk
# FP8 quantize engine: None picks "cuda" when a GPU is usable, else "cpu" (native C over
# row blocks in threads; the reference where rowcache.kernels._quantize is not built); "reference"
# is NumPy's rule in one thread. Every engine writes the same bits (tests/store/test_build_fp8.py).
FP8_ENGINE: str | None = None
FP8_THREADS: int | None = None  # threads of the "cpu" engine; None: this process's cores - 1
# The LMDB index's map is sized from its records (index_map_bytes), not a fixed 16 GiB: a
# process under an address-space limit (ulimit -v) of a few GiB must build a store too.
MAP_GROWS = 6  # times a full map is doubled before the build gives up (MapFullError)
# The file system's free space, asked before a build starts (os.statvfs; a test of a full
# disk sets it to report less, as no file system can be filled here without root).
STATVFS: Callable[[str], Any] = os.statvfs


def _tables_dict(tables: Any) -> dict[str, Any]:
    keys: dict[str, Any] = {}  # each name's key as given
    if isinstance(tables, Mapping):
        items: dict[str, Any] = {}
        for k, v in tables.items():
            name = str(k)
            if name in items:
                raise ConfigError(
                    f"tables has two entries named {name!r} (keys {keys[name]!r} and {k!r}); "
                    "table names are strings and must be distinct"
                )
            items[name], keys[name] = v, k
    elif isinstance(tables, Sequence) and not isinstance(tables, (str, bytes)):
        items = {str(i): v for i, v in enumerate(tables)}
    else:
        raise ConfigError(
            f"tables must be a dict {{name: source}} or a list of sources, got {type(tables).__name__}"
        )
    if not items:
        raise ConfigError("tables is empty; give at least one table")
    if "" in items:  # the index keeps no unnamed table: refused here, before anything is written
        raise ConfigError(
            f"tables has a table named '' (key {keys['']!r}); a table name must be a non-empty "
            "string"
        )
    return items


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


@dataclass(frozen=True)
class ShardWrites:
    """What every shard file of one build is written with."""

    root: str  # the build directory
    dtype: str  # the store's codec (rowcache.format.codecs): "bf16", "fp8", "fp8_table_scale", ...
    allow_nonfinite: bool  # store NaN / Inf as they are (refused otherwise)
    pool: ThreadPoolExecutor  # two threads: a chunk's write beside the next chunk's CRCs
    bar: Any  # the progress bar (tqdm), or None


@dataclass(frozen=True)
class TableWrites:
    """One table of a build: its number, source and layout, and how its rows are streamed."""

    number: int
    src: Source
    info: fmt.TableInfo
    chunk_rows: int  # rows per streamed chunk: whole pages, about CHUNK_BYTES of input
    fp8: Fp8Pages | None  # the FP8 quantizer's buffers, None for bf16


def _write_table(
    build: ShardWrites, t: int, src: Source, info: fmt.TableInfo
) -> list[tuple[fmt.ShardRecord, np.ndarray]]:
    """Write the shard files of table ``t``; per shard its record and page CRCs."""
    row_bytes = src.dim * src.dtype.itemsize
    chunk_rows = max(info.rows_per_page, CHUNK_BYTES // max(1, row_bytes))
    chunk_rows -= chunk_rows % info.rows_per_page  # every chunk but a shard's last is whole pages
    fp8 = Fp8Pages(info, chunk_rows, fp8_engine(), FP8_THREADS) if build.dtype == "fp8" else None
    table = TableWrites(t, src, info, chunk_rows, fp8)
    try:
        return [_write_shard(build, table, s) for s in range(info.shards)]
    finally:
        if fp8 is not None:
            fp8.close()


def fp8_engine() -> str:
    """The FP8 quantize engine a build uses now: :data:`FP8_ENGINE`, checked, or the default."""
    if FP8_ENGINE is not None:
        if FP8_ENGINE not in ("cuda", "cpu", "reference"):
            raise ConfigError(
                f"FP8_ENGINE={FP8_ENGINE!r}; allowed: None, 'cuda', 'cpu', 'reference'"
            )
        return FP8_ENGINE
    return "cuda" if gpu_available() else "cpu"


def _write_shard(
    build: ShardWrites, table: TableWrites, s: int
) -> tuple[fmt.ShardRecord, np.ndarray]:
    """Write shard ``s`` of a table: its record and page CRCs."""
    t, src, info, fp8 = table.number, table.src, table.info, table.fp8
    row_bytes = src.dim * src.dtype.itemsize
    first, count = info.shard_rows(s)
    name = fmt.shard_file_name(t, s)
    fd = os.open(os.path.join(build.root, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    crcs: list[Any] = []  # futures of each chunk's page CRCs, in order
    pending: Any = None  # the write of the previous chunk
    length = 0
    try:
        for start in range(first, first + count, table.chunk_rows):
            stop = min(start + table.chunk_rows, first + count)
            # Prepare this chunk while the previous one is written and checksummed
            # (os.write releases the GIL; the CRC loop runs in the pool's other thread).
            if fp8 is not None:
                data, slot = fp8.encode(src, start, stop, build.allow_nonfinite)
            else:
                block = src.read(start, stop)
                if build.allow_nonfinite:
                    pass
                elif src.codec is None:
                    check_finite(block, src.name, start)
                else:  # rows given encoded: the codec names what would decode to NaN
                    info.codec.check_encoded(block, info.dim, info.params, src.name, start)
                data = pack_pages(info, to_records(build.dtype, block))
            if pending is not None:
                pending.result()
            pending = build.pool.submit(_write_all, fd, memoryview(data.data))
            crcs.append(build.pool.submit(checksum.page_crcs, data))
            if fp8 is not None:
                fp8.busy[slot] = [pending, crcs[-1]]
            length += data.nbytes
            if build.bar is not None:
                build.bar.update((stop - start) * row_bytes)
        if pending is not None:
            pending.result()
        page_crcs = np.concatenate([f.result() for f in crcs]).astype("<u4", copy=False)
        os.fsync(fd)
    finally:
        for f in [pending, *crcs]:  # never close the file under a write still running
            if f is not None:
                f.exception()
        os.close(fd)
    if length != info.shard_bytes(s) or len(page_crcs) != info.shard_pages(s):
        raise AssertionError(  # internal invariant of the layout arithmetic
            f"shard {name}: wrote {length} bytes, layout says {info.shard_bytes(s)}"
        )
    rec = fmt.ShardRecord(
        t, s, first, count, name, 0, length, len(page_crcs), crc32c.crc32c(page_crcs.tobytes())
    )
    return rec, page_crcs


def index_map_bytes(shard_recs: list[Any], meta: bytes) -> int:
    """An upper bound of the LMDB map the index needs: its records (the meta record, one
    shard record and one page-CRC record a shard) each on pages of their own (a value of
    more than a quarter page goes to overflow pages, one more page for its leaf), all of it
    twice (copy-on-write: the meta record's transaction copies the tree's touched pages), and
    64 pages and 1 MiB for the tree's branch pages and free lists. A few MiB for a store of
    a few thousand shards; address space only (the file grows with what is written)."""
    psize = max(4096, mmap.PAGESIZE)  # LMDB's page size is the system's

    def pages(value_bytes: int) -> int:
        return -(-(value_bytes + 64) // psize) + 1

    total = pages(len(meta))
    for recs in shard_recs:
        for r, page_crcs in recs:
            total += pages(len(r.to_bytes())) + pages(page_crcs.nbytes)
    return 2 * (total + 64) * psize + (1 << 20)


def _write_index(tmp: str, path: str, shard_recs: list[Any], meta: dict[str, Any]) -> None:
    """Shard and page-CRC records, then the meta record in its own last transaction, in a
    map sized from them (:func:`index_map_bytes`), doubled should it fill."""
    index = os.path.join(tmp, fmt.INDEX_NAME)
    shown = f"the index of {path} (built in {os.path.basename(tmp)})"
    meta_bytes = fmt.meta_to_bytes(meta)
    map_size = index_map_bytes(shard_recs, meta_bytes)
    for grows in range(MAP_GROWS + 1):
        try:
            _put_records(index, map_size, shard_recs, meta_bytes)
            return
        except lmdb.MapFullError as e:
            if grows == MAP_GROWS:
                raise FormatError(
                    f"{shown}: the LMDB index still filled its map at {map_size:,} bytes "
                    f"(doubled {MAP_GROWS} times from what its records need): {e}"
                ) from e
            map_size *= 2  # an aborted transaction left nothing behind: write all again
        except lmdb.Error as e:
            raise _explain_eio(lmdb_error(e, shown, "writing"), index) from e


def _put_records(index: str, map_size: int, shard_recs: list[Any], meta: bytes) -> None:
    # lock=False: the build directory is ours alone (flocked), and no lock.mdb is
    # mapped, so a disk filling up cannot turn into a SIGBUS on the lock file.
    env = lmdb.open(index, map_size=map_size, subdir=True, lock=False)
    try:
        with env.begin(write=True) as txn:
            for recs in shard_recs:
                for r, page_crcs in recs:
                    txn.put(fmt.shard_key(r.table, r.shard), r.to_bytes())
                    txn.put(fmt.crc_key(r.table, r.shard), page_crcs.tobytes())
        # The meta record goes last, in its own transaction: without it the store never opens.
        with env.begin(write=True) as txn:
            txn.put(fmt.META_KEY, meta)
        env.sync(True)
    finally:
        env.close()


def _explain_eio(err: Exception, index: str) -> Exception:
    """LMDB reports a short write (full disk, ``ulimit -f``) as EIO: name the cause."""
    if not isinstance(err, OSError) or err.errno != errno.EIO:
        return err
    try:
        st = os.statvfs(index)
        if st.f_bavail * st.f_frsize < (1 << 20):
            return OSError(errno.ENOSPC, f"{err.strerror} (the disk is full)")
    except OSError:
        pass
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if soft != resource.RLIM_INFINITY:
        return OSError(
            errno.EFBIG, f"{err.strerror} (the file size limit, ulimit -f, is {soft} bytes)"
        )
    return err


def needed_bytes(infos: list[fmt.TableInfo]) -> int:
    """Disk space a build of ``infos`` needs beside what is there: every shard file, the
    index (its page-CRC records, 4 bytes a page, twice over for LMDB's pages and tree, and
    1 MiB), and 1 % more and 16 MiB for the file system's own blocks. An overwrite keeps the
    old store until the new one is complete, so the old one's space never counts as free."""
    shards = sum(i.shard_bytes(s) for i in infos for s in range(i.shards))
    pages = shards // fmt.PAGE
    index = 2 * (4 * pages + 512 * sum(i.shards for i in infos)) + (1 << 20)
    return shards + index + (shards + index) // 100 + (16 << 20)


def _check_free_space(parent: str, path: str, infos: list[fmt.TableInfo]) -> None:
    """``OSError(ENOSPC)`` before anything is written where the file system holding
    ``parent`` has less free space than the build needs, saying both."""
    need = needed_bytes(infos)
    try:
        st = STATVFS(parent)
    except OSError:
        return  # no figure to compare with: a full disk is still a clean ENOSPC later
    free = st.f_bavail * st.f_frsize
    if free < need:
        old = " (the store there now is removed only once the new one is complete)"
        raise OSError(
            errno.ENOSPC,
            f"building {path} needs {_size(need)} of disk (shards, index and headroom) and "
            f"the file system of {parent} has {_size(free)} free"
            + (old if os.path.lexists(path) else "")
            + ": free space or build elsewhere",
        )


def build_failure(e: OSError, path: str) -> OSError:
    """``e``, a system error while a build of ``path`` wrote its files (a disk filled, a
    quota, an I/O error), as an error of the same errno (``OSError`` or its subclass) that
    names the store: a write's error names no file, and a file's is the build directory's.
    ``e`` itself where it names ``path`` already."""
    text = str(e)
    if path in text:
        return e
    where = f" ({e.filename})" if e.filename else ""
    kept = "the store there is unchanged" if os.path.lexists(path) else "no store was made"
    return OSError(
        e.errno,
        f"building {path}: {e.strerror or text}{where}; {kept} and the build's files were "
        "removed" + (": free space or build elsewhere" if e.errno in _DISK_FULL else ""),
    )


_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"


def build_store(
    path: str | os.PathLike[str],
    tables: Any,
    *,
    dtype: str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    shard_bytes: int = 1 << 30,
    allow_nonfinite: bool = False,
) -> RowStore:
    """Build a store at ``path`` from ``tables`` and return it opened (a ``RowStore``).

    Parameters
    ----------
    path : directory to create (must not exist unless ``overwrite=True``).
    tables : ``{name: source}`` or a list of sources (named ``"0"``, ``"1"``, ...).
        Names are compared as strings: ``{1: a, "1": b}`` is refused.
        A source is a 2-D array ``[rows, dim]`` (``ml_dtypes.bfloat16``, float32 or
        float16), a ``.npy`` path (bf16 may be stored as its uint16 view), or a
        ``(file.safetensors, tensor_name)`` pair / ``"file.safetensors:tensor_name"``,
        or a ``rowcache.store.sources.GeneratedRows`` (rows a function makes a chunk at a time).
        A table given encoded is an ``Fp8TableScaleSource(codes, scale)`` (E4M3 codes and
        the table's one bf16 scale) or an ``Fp8BlockScaleSource(codes, scales)`` (E4M3
        codes and one UE8M0 byte a block of values, two tensors read row-aligned), written
        verbatim; ``DecodedRows(encoded source)`` is its values, for a bf16 or fp8 store; a
        ``ConcatRows([part, ...])`` is one table made of several sources in row order (e.g.
        tensors of several files).
    dtype : the row codec (``rowcache.format.codecs``): ``"bf16"`` (float sources round to
        nearest even), ``"fp8"`` (quantize on build: per row, scale = amax(|x|)/448 in
        float32, 1.0 where that is 0 (all-zero rows, and rows below ~3e-43, which store
        signed zeros); codes = satfinite E4M3 of ``x / scale``, from the source values),
        ``"fp8_table_scale"`` (every table an ``Fp8TableScaleSource``) or
        ``"fp8_block_e8m0"`` (every table an ``Fp8BlockScaleSource``), written verbatim.
        None (the default): the codec of encoded sources, else ``"bf16"``. One codec a store.
    overwrite : replace what is at ``path``, which must be a rowcache store (of any
        format version) or an empty directory; anything else is refused.
    progress : a progress bar (tqdm, on stderr): True, False, or None (the default) for a bar
        only when stderr is a terminal, as the CLI shows them (no ``\r`` lines in logs).
    shard_bytes : target shard file size (rounded down to whole pages, at least one).
    allow_nonfinite : store NaN/Inf values as they are (refused by default, naming
        the table, row and column of the first one; for encoded rows, E4M3 NaN codes and
        UE8M0 NaN scale bytes, 0xFF).

    Crash safety: the store is built in a sibling ``.NAME.building-*`` directory
    (flocked while this build runs) whose meta record is committed last, then
    exchanged with ``path`` in one atomic ``renameat2`` (see ``rowcache.store.replace``);
    ``path`` holds the old or the new store at every instant, and an exception leaves
    it as it was. Leftovers of earlier builds of ``path`` that no live build owns are
    removed first. The store returned is the one this call built, opened before the
    switch: never another build's, whatever runs at ``path`` meanwhile (a build of the same
    path that takes it first is a ``ConfigError`` without ``overwrite``). A file system with
    less free space than the build needs (``needed_bytes``) is an ``OSError(ENOSPC)`` before
    anything is written, saying both figures; disk full or an I/O error later is an
    ``OSError`` with its errno.
    """
    if dtype is not None and dtype not in fmt.DTYPES:
        raise ConfigError(
            f"dtype={dtype!r} is not supported; allowed: None, {', '.join(fmt.DTYPES)}"
        )
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ConfigError(f"shard_bytes={shard_bytes!r}: give a positive number of bytes")
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError(f"path={path!r}: give the directory of the store to build")
    path = os.path.abspath(os.fspath(path))
    replace.recover(path)  # a half-done switch of an earlier build: put its store back first
    if os.path.lexists(path) and not overwrite:
        raise ConfigError(f"path {path!r} already exists; pass overwrite=True to replace it")
    if os.path.lexists(path):
        replace.check_replaceable(path, is_store)
    sources: list[Source] = []
    try:
        for n, s in _tables_dict(tables).items():
            sources.append(resolve_source(n, s))
        dtype = _store_codec(dtype, sources)
        infos = [
            fmt.TableInfo.make(s.name, s.rows, s.dim, dtype, shard_bytes, s.params) for s in sources
        ]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return _build(
            path, sources, infos, dtype, overwrite, progress, shard_bytes, allow_nonfinite
        )
    finally:
        for s in sources:
            s.close()


_FP8_RULES = {
    "fp8": "scale=amax/448 (1 if 0); codes=satfinite_e4m3(x/scale)",
    "fp8_table_scale": "codes verbatim; row=bf16_rn(bf16(e4m3(code))*params.scale)",
    "fp8_block_e8m0": "codes and ue8m0 bytes verbatim; "
    "value j=bf16_rn(e4m3(code_j)*2**(e[j//params.block_size]-127)); e=255 NaN",
}
# the source an encoded codec's rows come from (named in a refusal)
_ENCODED_SOURCES = {
    "fp8_table_scale": "Fp8TableScaleSource(codes, scale)",
    "fp8_block_e8m0": "Fp8BlockScaleSource(codes, scales)",
}


def _store_codec(dtype: str | None, sources: list[Source]) -> str:
    """The store's codec: ``dtype``, or the one the sources' encoding implies; ConfigError
    where sources and codec do not fit (encoded rows are written verbatim, never converted)."""
    encoded = {s.codec for s in sources}
    if len(encoded) > 1:
        mixed = {s.name: s.codec or "values" for s in sources}
        raise ConfigError(
            f"tables mix encoded and value sources ({mixed}); one codec a store: build "
            "them as separate stores"
        )
    given = encoded.pop()
    if given is None:
        if dtype is not None and not get_codec(dtype).from_values:
            want = _ENCODED_SOURCES.get(dtype, dtype)
            raise ConfigError(
                f"dtype={dtype!r} stores rows as given: every table must be a {want}, "
                f"got value sources ({', '.join(s.origin for s in sources)})"
            )
        return dtype or "bf16"
    if dtype is not None and dtype != given:
        raise ConfigError(
            f"dtype={dtype!r}, but the tables are {given} sources (written verbatim, never "
            f"re-encoded): pass dtype={given!r} or None, or wrap each source in "
            "DecodedRows(...) to store its decoded values"
        )
    return given


def _build(
    path: str,
    sources: list[Source],
    infos: list[fmt.TableInfo],
    dtype: str,
    overwrite: bool,
    progress: bool | None,
    shard_bytes: int,
    allow_nonfinite: bool,
) -> RowStore:
    """Build in a locked sibling, open what was built, then switch it in (build_store)."""

    def check_existing(p: str) -> None:
        if not overwrite:
            raise ConfigError(
                f"path {p!r} appeared during the build (another build of it finished first?); "
                "pass overwrite=True to replace it"
            )
        replace.check_replaceable(p, is_store)

    removed = replace.remove_leftovers(path)  # also finishes a half-done switch of a build
    for lo in removed:
        log.info(
            "removed %s, a %s leftover of an earlier build (%d bytes)", lo.path, lo.kind, lo.bytes
        )
    _check_free_space(os.path.dirname(path), path, infos)  # what the leftovers held is free
    tmp, lock = replace.new_sibling(path, "building")
    began = time.monotonic()
    log.info(
        "building %s: %d table(s), %s, %d bytes of shards (in %s)",
        path,
        len(infos),
        dtype,
        sum(i.shard_bytes(s) for i in infos for s in range(i.shards)),
        os.path.basename(tmp),
    )
    if dtype == "fp8":
        log.debug("FP8 quantize engine: %s", fp8_engine())
    store = None
    try:
        try:
            shard_recs = _write_shards(tmp, sources, infos, dtype, allow_nonfinite, progress)
            meta = {
                "format": fmt.FORMAT_NAME,
                "version": fmt.write_version(dtype),
                "page_size": fmt.PAGE,
                "dtype": dtype,
                "store_id": uuid.uuid4().hex,
                "tables": [info.to_meta(fmt.write_version(dtype)) for info in infos],
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "params": {
                    "shard_bytes": shard_bytes,
                    "sources": [s.origin for s in sources],
                    "allow_nonfinite": allow_nonfinite,
                    "fp8_rule": _FP8_RULES.get(dtype),
                },
            }
            _write_index(tmp, path, shard_recs, meta)
            write_marker(tmp)
            replace.mark_step("committed")
            # The store this call built, opened before the switch by its own directory:
            # the call returns it whatever other builds make of `path` afterwards.
            store = RowStore.open_dir(lock.fd, path)
            # (what `path` became during the build is checked by the switch, under its lock:
            # a check here, unlocked, could see another build's switch half done)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise build_failure(e, path) from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            replace.switch(tmp, path, check_existing)
        except BaseException:
            # Whatever `tmp` holds now (our unused build, or the old store after the
            # exchange) is garbage; a missing `path` is restored below.
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except BaseException:
        if store is not None:
            store.close()
        raise
    finally:
        lock.close()
        if not os.path.lexists(path):
            replace.recover(path)
    log.info("built %s in %.1f s", path, time.monotonic() - began)
    return store


def _write_shards(
    tmp: str,
    sources: list[Source],
    infos: list[fmt.TableInfo],
    dtype: str,
    allow_nonfinite: bool,
    progress: bool | None,
) -> list[Any]:
    total = sum(s.rows * s.dim * s.dtype.itemsize for s in sources)
    bar = None
    if progress is not False:
        from tqdm import tqdm

        bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"build {dtype}",
            leave=False,
            disable=None if progress is None else False,  # None: on a terminal only
        )
    try:
        with ThreadPoolExecutor(2) as pool:
            build = ShardWrites(tmp, dtype, allow_nonfinite, pool, bar)
            return [
                _write_table(build, t, s, info) for t, (s, info) in enumerate(zip(sources, infos))
            ]
    finally:
        if bar is not None:
            bar.close()
