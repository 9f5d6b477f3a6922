"""``RowStore``: a read-only view of a built store, its row reads and its self-check.

Owns opening a store (the index checked before LMDB maps a private copy of it, the meta
record, every shard record and its page CRCs validated, every shard file's size checked up
front, then the LMDB environment closed, so no LMDB handle outlives ``open`` and stores
survive ``fork``; an open that another build's switch overtook starts again at the new
store), holding the opened store directory (``StoreDir``) so a handle, and every reader made
from it, never reads a store that replaced it or through a reused descriptor, refusing every
call once closed, ``read_rows`` (the ground truth the cache is tested against) and
``verify``. The I/O is ``rowcache.io.reader``, the index checks ``rowcache.store.index``,
the layout ``rowcache.format.layout``, the row-id checks ``rowcache.format.rows``, replacing
stores ``rowcache.store.replace``."""

from __future__ import annotations

import os
import stat
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rowcache.errors import (
    ConfigError,
    CorruptDataError,
    FormatError,
    StoreChangedError,
)
from rowcache.format import layout as fmt
from rowcache.format.rows import check_row_ids
from rowcache.io import checksum
from rowcache.io.reader import DEFAULT_MERGE_GAP, ReadStats, RowReader
from rowcache.store import replace
from rowcache.store.index import check_lmdb_header, check_shard_files, lmdb_error, read_index
from rowcache.store.replace import Leftover, find_leftovers, remove_leftovers
from rowcache.store.safeopen import FILE_FLAGS

__all__ = [
    "Leftover",
    "RowStore",
    "StoreDir",
    "VerifyReport",
    "check_lmdb_header",
    "check_row_ids",
    "find_leftovers",
    "lmdb_error",
    "remove_leftovers",
]

MAX_REPORTED_PAGES = 20  # bad pages listed per shard by verify(); the rest are counted


@dataclass(frozen=True)
class VerifyReport:
    """Result of ``RowStore.verify()``: ``ok`` is true when ``problems`` is empty.

    ``problems`` are one line each, starting with the shard file's name (a missing or
    mis-sized shard, one that is not a regular file, a page whose CRC32C does not match,
    with its table and rows); ``damaged_shards`` names each shard file with a problem, in
    the index's order; ``leftovers`` are the sibling directories earlier builds left (they
    do not make the store bad; the next build removes them).
    """

    path: str
    shards_checked: int
    bytes_checked: int
    problems: list[str] = field(default_factory=list)
    pages_checked: int = 0
    bad_pages: int = 0
    leftovers: list[Leftover] = field(default_factory=list)
    damaged_shards: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _pinned_root(dirfd: int, path: str) -> str:
    """A path that names the directory behind ``dirfd`` whatever is renamed to ``path``
    later (Linux ``/proc/self/fd``); ``path`` itself where there is no such path."""
    p = f"/proc/self/fd/{dirfd}"
    try:
        if os.stat(p).st_ino == os.fstat(dirfd).st_ino:
            return p
    except OSError:
        pass
    return path


def _replaced(dirfd: int, path: str) -> bool:
    """True if ``path`` no longer names the directory ``dirfd`` (another build replaced
    or removed it)."""
    try:
        st = os.fstat(dirfd)
        cur = os.stat(path)
    except OSError:
        return True
    return st.st_nlink == 0 or (cur.st_dev, cur.st_ino) != (st.st_dev, st.st_ino)


OPEN_ATTEMPTS = 3  # opens of a path that another build replaces meanwhile, before giving up


class StoreDir:
    """The descriptor of an opened store directory, the one way its files are reached.

    Readers open shard files through ``root`` (``/proc/self/fd/N``), so the descriptor must
    outlive every reader that may open one: the handle holds it until ``close()``, and
    every reader made from the handle pins it for the reader's life (:meth:`pin`). It is
    closed when the last of them is gone, never while a reader could open a file through a
    reused descriptor number.
    """

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.root = _pinned_root(fd, path)
        self._close = weakref.finalize(self, os.close, fd)

    def pin(self, reader: RowReader) -> RowReader:
        """Keep this directory open while ``reader`` lives; returns ``reader``."""
        weakref.finalize(reader, _unpin, self)
        return reader


def _unpin(directory: StoreDir) -> None:
    """Drops the finalizer's reference to ``directory`` (see :meth:`StoreDir.pin`)."""


class RowStore:
    """A store opened read-only. Use :meth:`open`; see ``rowcache.build_store``.

    A handle reads the store it opened: it holds the store's directory from ``open``
    on, so a build that replaces ``path`` meanwhile is never read through it; if the
    replaced store's files are gone when a read needs them, the read raises
    ``StoreChangedError`` (open ``path`` again). ``page_crcs[t][s]`` is the uint32
    CRC32C of every 4 KiB page of shard ``s`` of table ``t``. After :meth:`close`, every
    read, check and new reader is refused (``ConfigError``); readers made before it keep
    reading the store they were made for.

    Thread safety: ``read_rows``/``read_records`` may be called from several
    threads at once (the reader owns per-call buffers).
    """

    def __init__(
        self,
        path: str,
        dtype: str,
        tables: list[fmt.TableInfo],
        shards: list[list[fmt.ShardRecord]],
        meta: dict[str, Any],
        reader: RowReader,
        *,
        page_crcs: list[list[np.ndarray]] | None = None,
        directory: StoreDir | None = None,
    ) -> None:
        self.path = path
        self.dtype = dtype
        self.tables = tables
        self.shards = shards
        self.meta = meta
        self.reader = reader
        self.page_crcs = page_crcs if page_crcs is not None else []
        self.root = directory.root if directory is not None else path  # where its files are
        self._dir = directory
        self._dirfd = directory.fd if directory is not None else -1
        self.closed = False

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        queue_depth: int = 32,
        direct: bool = False,
        merge_gap: int = DEFAULT_MERGE_GAP,
        engine: str = "auto",
        check_shards: bool = True,
    ) -> RowStore:
        """Open the store at ``path``; FormatError naming the field if anything is off.

        ``queue_depth``, ``direct``, ``merge_gap`` and ``engine`` configure the row reader
        (see ``rowcache.io.reader.RowReader``), which the caches over the store copy.
        ``engine="uring+threads"`` reads a batch longer than the queue depth by pread
        threads, which read it 1.2-1.4x faster than io_uring from one thread on the H100
        VM's virtio disk (docs/qwen4.md, "The read engine"; check a disk with
        ``bench.qwen4 --engine``). ``check_shards``: a missing shard file or one of the wrong
        size is a ``CorruptDataError`` (pass False to open a damaged store anyway, to
        ``verify`` it). A half-done switch of an interrupted build is finished first (see ``rowcache.store.replace.recover``). A store that another
        build replaces while it is being opened is opened again (the new one); after
        ``OPEN_ATTEMPTS`` such replacements, ``StoreChangedError``.
        """
        path = os.path.abspath(os.fspath(path))
        last: Exception | None = None
        for _ in range(OPEN_ATTEMPTS):
            if not os.path.lexists(path):
                replace.recover(path)
            try:
                dirfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                replace.recover(path)  # waits for a fallback switch that has `path` away
                if os.path.lexists(path):
                    continue
                raise FormatError(f"{path}: no such directory, so no rowcache store") from None
            except NotADirectoryError:
                raise FormatError(f"{path}: not a directory, so not a rowcache store") from None
            try:
                return cls.open_dir(
                    dirfd,
                    path,
                    queue_depth=queue_depth,
                    direct=direct,
                    merge_gap=merge_gap,
                    engine=engine,
                    check_shards=check_shards,
                )
            except (FormatError, CorruptDataError) as e:
                if not _replaced(dirfd, path):
                    raise
                last = e  # what was read was a store being replaced: open the new one
            finally:
                os.close(dirfd)
        raise StoreChangedError(
            f"{path}: the store was replaced {OPEN_ATTEMPTS} times while being opened (builds "
            f"of the path are running; the last open saw: {last}); open the path again"
        )

    @classmethod
    def open_dir(
        cls,
        dirfd: int,
        path: str,
        *,
        queue_depth: int = 32,
        direct: bool = False,
        merge_gap: int = DEFAULT_MERGE_GAP,
        engine: str = "auto",
        check_shards: bool = True,
    ) -> RowStore:
        """Open the store in the directory ``dirfd`` (which stays the caller's: the handle
        opens the directory again through it), named ``path`` in its messages and :attr:`path`: the builder
        opens the store it built before the switch makes it ``path``, so that it returns
        that store and never another build's. Otherwise as :meth:`open`."""
        # A descriptor of its own (not a dup: a dup would share the builder's flock).
        own = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dirfd)
        directory = StoreDir(own, path)
        dtype, tables, shards, crcs, meta = read_index(directory.fd, path)
        check_shard_files(directory.fd, path, tables, shards, missing_ok=not check_shards)
        reader = RowReader(
            directory.root,
            tables,
            [[r.file for r in recs] for recs in shards],
            queue_depth=queue_depth,
            direct=direct,
            merge_gap=merge_gap,
            engine=engine,
            page_crcs=crcs,
            store_path=path,
        )
        directory.pin(reader)
        return cls(path, dtype, tables, shards, meta, reader, page_crcs=crcs, directory=directory)

    def _check_open(self) -> None:
        if self.closed:
            raise ConfigError(
                f"RowStore({self.path!r}) is closed; open the store again with RowStore.open"
            )

    def new_reader(self, cls: type[RowReader] = RowReader, **kw: Any) -> RowReader:
        """Another reader (``cls``: RowReader or a subclass) over this handle's files,
        with its page CRCs where ``cls`` takes them; ``kw`` are its settings. The reader
        keeps the store's directory open for its life (it reads this store, even after
        the handle is closed)."""
        self._check_open()
        files = [[r.file for r in recs] for recs in self.shards]
        kw.setdefault("page_crcs", self.page_crcs)
        kw.setdefault("store_path", self.path)
        reader = cls(self.root, self.tables, files, **kw)
        return self._dir.pin(reader) if self._dir is not None else reader

    @property
    def store_id(self) -> str | None:
        """The random id the build gave this store (differs between any two builds)."""
        return self.meta.get("store_id")

    def changed(self) -> bool:
        """True if ``path`` no longer holds the store this handle opened."""
        self._check_open()
        return self._dirfd >= 0 and _replaced(self._dirfd, self.path)

    def _changed_error(self, e: CorruptDataError) -> CorruptDataError:
        msg = str(e)
        if self.root != self.path:  # name the store, not /proc/self/fd/N
            msg = msg.replace(self.root, self.path)
        if isinstance(e, StoreChangedError) or not self.changed():
            return type(e)(msg) if msg != str(e) else e
        return StoreChangedError(
            f"{self.path}: the store this handle opened was replaced or removed since "
            f"(a read needed a file it no longer has: {msg}); open the path again"
        )

    # -- tables ------------------------------------------------------------
    def table_index(self, table: str | int) -> int:
        """Index of ``table`` given by name or index; ConfigError listing the tables."""
        if isinstance(table, (int, np.integer)) and not isinstance(table, bool):
            if 0 <= int(table) < len(self.tables):
                return int(table)
        elif isinstance(table, str):
            for i, t in enumerate(self.tables):
                if t.name == table:
                    return i
        names = [t.name for t in self.tables]
        shown = names if len(names) <= 16 else [*names[:16], "..."]
        raise ConfigError(
            f"table={table!r} is not in this store; it has {len(names)} tables: {shown} "
            f"(or an index 0..{len(names) - 1})"
        )

    def table_info(self, table: str | int) -> fmt.TableInfo:
        return self.tables[self.table_index(table)]

    # -- reads -------------------------------------------------------------
    def read_records(
        self, table: str | int, rows: np.ndarray, out: np.ndarray | None = None
    ) -> tuple[np.ndarray, ReadStats]:
        """Raw records of **sorted unique, in-range** ``rows`` (the cache's fault path)."""
        self._check_open()
        try:
            return self.reader.read_records(self.table_index(table), rows, out)
        except CorruptDataError as e:
            err = self._changed_error(e)
            if err is e:
                raise
            raise err from e

    def read_rows(self, table: str | int, row_ids: Any) -> Any:
        """Rows ``row_ids`` of ``table``, straight from disk, in request order.

        Parameters
        ----------
        table : name or index.
        row_ids : int[n], any order, duplicates allowed.

        Returns
        -------
        What the store's codec decodes (``rowcache.format.codecs``): bfloat16[n, dim] for a
        BF16 store, ``(codes uint8[n, dim], scales float32[n])`` for an FP8 store, the codes
        uint8[n, dim] as stored for an ``fp8_table_scale`` store (the table's scale is
        ``table_info(table).params["scale"]``).
        """
        self._check_open()
        t = self.table_index(table)
        info = self.tables[t]
        ids = check_row_ids(row_ids, info.rows)
        uniq, inverse = np.unique(ids, return_inverse=True)
        records, _ = self.read_records(t, uniq)
        decoded = info.codec.decode(info.dim, records)
        if isinstance(decoded, tuple):  # values and their per-row scales
            return tuple(part[inverse] for part in decoded)
        return decoded[inverse]

    # -- checks ------------------------------------------------------------
    def leftovers(self) -> list[Leftover]:
        """Sibling directories earlier builds of this path left (see ``find_leftovers``)."""
        return find_leftovers(self.path)

    def verify(self, *, progress: bool = False) -> VerifyReport:
        """Check every shard file: present, a regular file of the right size, every
        page's CRC32C.

        Each bad page is one problem naming the shard file, page, offset, table and
        rows (at most ``MAX_REPORTED_PAGES`` per shard, the rest counted). A damaged
        shard is reported, never raised: open a damaged store with
        ``RowStore.open(path, check_shards=False)`` to verify it.
        """
        self._check_open()
        problems: list[str] = []
        total = sum(r.length for recs in self.shards for r in recs)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc="verify", leave=False)
        checked = pages = bad_pages = nshards = 0
        damaged: list[str] = []
        buf = np.empty(16 << 20, dtype=np.uint8)
        try:
            for t, recs in enumerate(self.shards):
                for r in recs:
                    nshards += 1
                    before = len(problems)
                    got = self._verify_shard(t, r, buf, problems, bar)
                    if len(problems) > before:
                        damaged.append(r.file)
                    if got is not None:
                        checked += got[0]
                        pages += got[1]
                        bad_pages += got[2]
        finally:
            if bar is not None:
                bar.close()
        return VerifyReport(
            self.path, nshards, checked, problems, pages, bad_pages, self.leftovers(), damaged
        )

    def _verify_shard(
        self, t: int, r: fmt.ShardRecord, buf: np.ndarray, problems: list[str], bar: Any
    ) -> tuple[int, int, int] | None:
        """(bytes, pages, bad pages) of one shard, appending its problems."""
        where = f"(table {self.tables[t].name!r}, shard {r.shard})"
        # O_NONBLOCK: a FIFO put in a shard's place opens at once (to be refused below)
        # instead of waiting for a writer; a regular file's reads ignore it.
        flags = FILE_FLAGS
        try:
            fd = (
                os.open(r.file, flags, dir_fd=self._dirfd)
                if self._dirfd >= 0
                else os.open(os.path.join(self.path, r.file), flags)
            )
        except FileNotFoundError:
            problems.append(f"{r.file}: missing {where}")
            return None
        except OSError as e:
            problems.append(f"{r.file}: cannot be read {where}: {e}")
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                problems.append(f"{r.file}: not a regular file {where}; refusing to read it")
                return None
            size = st.st_size
            if size != r.length:
                cut = "cut short" if size < r.length else "too long"
                problems.append(f"{r.file}: {size} bytes, expected {r.length} ({cut}) {where}")
                return None
            want = self.page_crcs[t][r.shard]
            bad: list[int] = []
            off = 0
            while off < r.length:
                n = os.preadv(fd, [memoryview(buf.data)[: min(buf.size, r.length - off)]], off)
                n -= n % fmt.PAGE
                if n <= 0:
                    problems.append(f"{r.file}: shrank to {off} bytes while being read {where}")
                    return off, off // fmt.PAGE, len(bad)
                p0 = off // fmt.PAGE
                got = checksum.page_crcs(buf[:n])
                for p in np.flatnonzero(got != want[p0 : p0 + len(got)]).tolist():
                    if len(bad) < MAX_REPORTED_PAGES:
                        problems.append(self._bad_page(t, r, p0 + p, int(got[p])))
                    bad.append(p0 + p)
                off += n
                if bar is not None:
                    bar.update(n)
            if len(bad) > MAX_REPORTED_PAGES:
                problems.append(
                    f"{r.file}: {len(bad) - MAX_REPORTED_PAGES} more bad pages {where} "
                    f"(pages {bad[MAX_REPORTED_PAGES]}..{bad[-1]})"
                )
            return r.length, r.pages, len(bad)
        finally:
            os.close(fd)

    def _bad_page(self, t: int, r: fmt.ShardRecord, page: int, got: int) -> str:
        info = self.tables[t]
        lp = page * fmt.PAGE // info.page_bytes  # the layout page holding this 4 KiB page
        first = r.first_row + lp * info.rows_per_page
        last = min(first + info.rows_per_page, r.first_row + r.rows) - 1
        rows = f"rows {first}..{last}" if last > first else f"row {first}"
        want = int(self.page_crcs[t][r.shard][page])
        return (
            f"{r.file}: page {page} (offset {page * fmt.PAGE}) CRC32C {got:08x} != recorded "
            f"{want:08x}: table {info.name!r} {rows} (shard {r.shard}) are corrupt"
        )

    def close(self) -> None:
        """Close the handle's reader and let go of the store's directory (closed once no
        reader made from this handle is left). Every later read, check or new reader of
        this handle raises ``ConfigError``; closing twice is harmless."""
        if self.closed:
            return
        self.closed = True
        self.reader.close()
        self._dir = None
        self._dirfd = -1

    def __enter__(self) -> RowStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RowStore({self.path!r}, dtype={self.dtype!r}, tables={len(self.tables)})"
