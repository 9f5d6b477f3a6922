"""Reading a store's LMDB index and checking its shard files, so nothing can crash or escape.

Owns the checks made before and while LMDB reads the index (a private copy of the index
file, checked against the length and CRC32C the store's marker records and against its own
LMDB header, so a damaged or truncated ``data.mdb`` is a ``FormatError`` and never a SIGBUS;
the store's files opened without following a link or waiting on a FIFO), mapping LMDB
errors to the project's (``OSError`` with errno, ``FormatError``), validating every
meta, shard and page-CRC record, and checking that every shard file is a regular file
of its recorded size inside the store. ``rowcache.store.handle`` builds handles from it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import struct
import tempfile
from typing import Any

import crc32c
import lmdb
import numpy as np

from rowcache.errors import CorruptDataError, FormatError
from rowcache.format import layout as fmt
from rowcache.store.marker import index_checksum, read_marker
from rowcache.store.safeopen import open_dir_at, open_file_at

_ERRNO_OF_TEXT = {os.strerror(n): n for n in sorted(errno.errorcode)}
_LMDB_MAGIC = 0xBEEFC0DE


def lmdb_error(e: lmdb.Error, index: str, doing: str) -> Exception:
    """A project error for an LMDB error: ``OSError`` with its errno for system errors
    (disk full, I/O error, file size limit), ``FormatError`` for everything else."""
    msg = str(e)
    text = msg.rsplit(": ", 1)[-1].strip()
    code = _ERRNO_OF_TEXT.get(text)
    if code is not None and not isinstance(e, (lmdb.CorruptedError, lmdb.InvalidError)):
        return OSError(code, f"{doing} {index}: {msg}")
    return FormatError(
        f"{index}: the LMDB index is unreadable or corrupt while {doing} it "
        f"({type(e).__name__}: {msg}); rebuild the store with `rowcache build`"
    )


def check_lmdb_header(head: bytes, size: int, shown: str) -> None:
    """FormatError unless an index file of ``size`` bytes that begins with ``head`` (at
    least its first 128 KiB, or all of it) is long enough for what its meta pages say.

    LMDB maps the file and trusts its header: a truncated file makes the first read
    past its end a SIGBUS, which kills the process. Reading the two meta pages here
    (magic, page size, last page number) turns that into an error.
    """
    need, seen = 0, 0
    psize = struct.unpack_from("<I", head, 40)[0] if len(head) >= 44 else 0
    if psize not in (4096, 8192, 16384, 32768, 65536):
        raise FormatError(
            f"{shown}: data.mdb ({size} bytes) has no valid LMDB header "
            "(truncated or corrupt); rebuild the store with `rowcache build`"
        )
    for m in (0, 1):
        off = m * psize
        if len(head) < off + 152:
            continue
        (magic,) = struct.unpack_from("<I", head, off + 16)
        if magic != _LMDB_MAGIC:
            continue
        seen += 1
        last_pg = struct.unpack_from("<Q", head, off + 136)[0]
        need = max(need, (last_pg + 1) * psize)
    if seen == 0 or size < max(need, 2 * psize):
        raise FormatError(
            f"{shown}: data.mdb is {size} bytes but its LMDB header says at least "
            f"{max(need, 2 * psize)} (truncated or corrupt); rebuild the store with "
            "`rowcache build`"
        )


def _private_file() -> tuple[int, str]:
    """A descriptor and a path of a new private file for the index's copy: a memfd
    (through ``/proc/self/fd``) where the system has them, else a temporary file, removed
    when the copy is closed."""
    if hasattr(os, "memfd_create"):
        try:
            fd = os.memfd_create("rowcache-index", os.MFD_CLOEXEC)
        except OSError:
            fd = -1
        if fd >= 0:
            name = f"/proc/self/fd/{fd}"
            if os.path.exists(name):
                return fd, name
            os.close(fd)
    return tempfile.mkstemp(prefix="rowcache-index-")


class IndexCopy:
    """A private copy of a store's index file, checked before LMDB maps it.

    The store's ``index.lmdb/data.mdb`` is opened relative to the store's directory (never
    through a link, never waiting on a FIFO: ``rowcache.store.safeopen``), copied into a
    private file (a memfd) while its CRC32C is computed, and the copy checked: against the
    length and CRC32C the store's marker records (``rowcache.store.marker``; a store built
    before markers has none, and gets the header check alone) and against its own LMDB
    header. LMDB then maps the copy, which nothing else can cut short, replace or change, and
    which no other open of the same store in this process shares (LMDB refuses to open one
    file twice in a process). ``path`` is the copy's path for ``lmdb.open(subdir=False)``.
    """

    def __init__(self, dirfd: int, path: str) -> None:
        shown = os.path.join(path, fmt.INDEX_NAME)
        marker = read_marker(dirfd, path)
        try:
            ifd = open_dir_at(dirfd, fmt.INDEX_NAME, shown, "index directory")
        except FileNotFoundError:
            raise FormatError(
                f"{path}: no {fmt.INDEX_NAME}; this is not a rowcache store "
                "(or its build did not finish)"
            ) from None
        try:
            fd, size = open_file_at(ifd, fmt.INDEX_FILE, shown, "index file data.mdb")
        except FileNotFoundError:
            raise FormatError(
                f"{shown}: no data.mdb; the store is damaged: rebuild it with `rowcache build`"
            ) from None
        finally:
            os.close(ifd)
        self.fd, self.path = -1, ""
        try:
            if marker is not None and size != marker.index_bytes:
                raise FormatError(
                    f"{shown}: data.mdb is {size:,} bytes, the store's marker "
                    f"{fmt.MARKER_NAME} records {marker.index_bytes:,}: the index is damaged; "
                    "rebuild the store with `rowcache build`"
                )
            self.fd, self.path = _private_file()
            crc = index_checksum(fd, size, shown, sink=self.fd)
            if marker is not None and crc != marker.index_crc32c:
                raise FormatError(
                    f"{shown}: data.mdb's CRC32C is {crc:08x}, the store's marker "
                    f"{fmt.MARKER_NAME} records {marker.index_crc32c:08x}: the index is "
                    "damaged; rebuild the store with `rowcache build`"
                )
            check_lmdb_header(os.pread(self.fd, 2 * 65536, 0), size, shown)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            if not self.path.startswith("/proc/"):
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            self.fd = -1


def read_index(
    dirfd: int, path: str
) -> tuple[str, list[fmt.TableInfo], list[list[fmt.ShardRecord]], list[list[np.ndarray]], dict]:
    """Meta, shard and page-CRC records of the index of the store directory ``dirfd``
    (shown as ``path``), read from a checked private copy (:class:`IndexCopy`), all
    validated."""
    shown = os.path.join(path, fmt.INDEX_NAME)
    copy = IndexCopy(dirfd, path)
    try:
        try:
            # map_size left at py-lmdb's 10 MiB: read-only, LMDB maps that or the file's
            # used pages, whichever is more (a few MiB of address space, not the 16 GiB the
            # builder once gave: tests/store/test_store_limits.py opens under ulimit -v 2 GiB)
            env = lmdb.open(copy.path, readonly=True, lock=False, subdir=False, max_readers=8)
        except lmdb.Error as e:
            raise lmdb_error(e, shown, "opening") from e
        try:
            with env.begin(buffers=False) as txn:
                dtype, tables, meta = fmt.parse_meta(txn.get(fmt.META_KEY), path)
                shards: list[list[fmt.ShardRecord]] = []
                crcs: list[list[np.ndarray]] = []
                for t, info in enumerate(tables):
                    recs, arrs = [], []
                    for s in range(info.shards):
                        r, a = _read_shard(txn, path, t, s, info)
                        recs.append(r)
                        arrs.append(a)
                    shards.append(recs)
                    crcs.append(arrs)
        except lmdb.Error as e:
            raise lmdb_error(e, shown, "reading") from e
        finally:
            env.close()
    finally:
        copy.close()
    files = [r.file for recs in shards for r in recs]
    if len(set(files)) != len(files):
        dup = next(f for f in files if files.count(f) > 1)
        raise FormatError(f"{path}: shard file {dup!r} is named by two shard records")
    return dtype, tables, shards, crcs, meta


def _read_shard(
    txn: Any, path: str, t: int, s: int, info: fmt.TableInfo
) -> tuple[fmt.ShardRecord, np.ndarray]:
    where = f"{path}: shard record (table {t}, shard {s})"
    raw = txn.get(fmt.shard_key(t, s))
    if raw is None:
        raise FormatError(f"{where} is missing")
    r = fmt.ShardRecord.from_bytes(raw, where)
    first, count = info.shard_rows(s)
    for fname, want in (
        ("table", t),
        ("shard", s),
        ("first_row", first),
        ("rows", count),
        ("offset", 0),
        ("length", info.shard_bytes(s)),
        ("pages", info.shard_pages(s)),
    ):
        if getattr(r, fname) != want:
            raise FormatError(
                f"{where} field {fname!r} is {getattr(r, fname)}, the layout says {want}"
            )
    raw_crc = txn.get(fmt.crc_key(t, s))
    if raw_crc is None:
        raise FormatError(f"{where}: its page-CRC record is missing")
    if len(raw_crc) != 4 * r.pages or crc32c.crc32c(raw_crc) != r.page_crc32c:
        raise FormatError(
            f"{where}: its page-CRC record ({len(raw_crc)} bytes) does not match the "
            f"record's pages={r.pages} and page_crc32c={r.page_crc32c:08x}: the index is corrupt"
        )
    return r, np.frombuffer(raw_crc, dtype="<u4").astype(np.uint32)


def check_shard_files(
    dirfd: int,
    path: str,
    tables: list[fmt.TableInfo],
    shards: list[list[fmt.ShardRecord]],
    *,
    missing_ok: bool,
) -> None:
    """Every shard a regular file (never a link out of the store) of the recorded size."""
    for t, recs in enumerate(shards):
        for r in recs:
            where = f"shard file {r.file} (table {tables[t].name!r}, shard {r.shard})"
            try:
                st = os.stat(r.file, dir_fd=dirfd, follow_symlinks=False)
            except FileNotFoundError:
                if missing_ok:
                    continue
                raise CorruptDataError(
                    f"{path}: {where} is missing; the store is damaged: rebuild it with "
                    "`rowcache build`"
                ) from None
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(
                    f"{path}: {where} is not a regular file (a link or a directory); "
                    "refusing to read it"
                )
            if st.st_size != r.length and not missing_ok:
                raise CorruptDataError(
                    f"{path}: {where} is {st.st_size} bytes, the index says {r.length} "
                    "(truncated or overwritten); rebuild the store with `rowcache build`"
                )
