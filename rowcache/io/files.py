"""The shard files of a :class:`rowcache.io.reader.RowReader`: names, numbering, descriptors.

Owns the store's shard files as the reader's engines see them: every file numbered once
(table after table, ``file_base[t] + s``), and the descriptor table ``fds`` (int32, -1: not
open), which the native engine reads in place; files are opened on first need (``O_DIRECT``
where asked), under a lock, never through a link and never waiting on a FIFO (``O_NOFOLLOW``,
``O_NONBLOCK``, then a regular file or refused), and named as the user knows them in every
error (the store's path, not ``/proc/self/fd/N``); a ``ShardFiles`` dropped without
:meth:`ShardFiles.close` closes its descriptors when it is collected. It does not read.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import weakref

import numpy as np

from rowcache.errors import ConfigError, CorruptDataError, StoreChangedError
from rowcache.format import layout as fmt


class ShardFiles:
    """The open shard files of one reader.

    ``shard_files[t][s]`` names shard ``s`` of table ``t`` inside ``root``. File ``f``
    (``file_base[t] + s``) is shard ``file_shard[f]`` of table ``file_table[f]``; its
    descriptor is ``fds[f]`` once open. ``store_path`` is the store's path as its user
    gave it, where ``root`` is another name of its directory (``/proc/self/fd/N``, pinned by
    the store handle): errors name it, and a shard missing because ``store_path`` names
    another directory now is a ``StoreChangedError``. Thread-safe.
    """

    def __init__(
        self,
        root: str,
        tables: list[fmt.TableInfo],
        shard_files: list[list[str]],
        direct: bool,
        store_path: str | None = None,
    ) -> None:
        self.root = root
        self.store_path = store_path if store_path is not None else root
        self.tables = tables
        self.shard_files = shard_files
        self.direct = direct
        counts = np.array([len(f) for f in shard_files], dtype=np.int64)
        self.file_base = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.file_table = np.repeat(np.arange(len(shard_files)), counts)
        self.file_shard = np.arange(int(counts.sum())) - self.file_base[self.file_table]
        self.fds = np.full(int(counts.sum()), -1, dtype=np.int32)
        self._open: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        self._opened_all = False  # every shard file open (native batches read apart)
        # a reader dropped without close() releases its descriptors (the finalizer holds
        # the descriptor dict, not self)
        weakref.finalize(self, _close_all, self._open)

    def _where(self, t: int, s: int) -> str:
        return f"shard file {self.shard_files[t][s]} (table {self.tables[t].name!r}, shard {s})"

    def replaced(self) -> bool:
        """True if ``store_path`` no longer names the directory ``root`` names."""
        if self.store_path == self.root:
            return False
        try:
            a, b = os.stat(self.root), os.stat(self.store_path)
        except OSError:
            return True
        return (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino)

    def missing_shard(self, t: int, s: int) -> CorruptDataError:
        if self.replaced():
            return StoreChangedError(
                f"{self.store_path}: the store this reader was made for was replaced or "
                f"removed since, and its {self._where(t, s)} is gone; open the path again"
            )
        return CorruptDataError(
            f"{self._where(t, s)} is missing from {self.store_path}; run `rowcache verify`"
        )

    def _open_file(self, t: int, s: int) -> int:
        """Open shard ``s`` of table ``t``: a regular file, never a link, never waited on."""
        name = self.shard_files[t][s]
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(os.path.join(self.root, name), flags | (os.O_DIRECT if self.direct else 0))
        except FileNotFoundError as e:
            raise self.missing_shard(t, s) from e
        except OSError as e:
            if self.direct and e.errno == errno.EINVAL:
                raise ConfigError(
                    f"direct=True: the file system of {self.store_path} refuses O_DIRECT; "
                    "use direct=False"
                ) from e
            if e.errno == errno.ELOOP:
                raise CorruptDataError(
                    f"{self._where(t, s)} in {self.store_path} is a symbolic link; a store's "
                    "shards are never links (refusing to follow it): run `rowcache verify`"
                ) from None
            shown = os.path.join(self.store_path, name)  # OSError(EACCES, ...) is a PermissionError
            hint = ""
            if e.errno in (errno.EMFILE, errno.ENFILE):
                hint = (
                    " (the process is out of file descriptors; close other stores or "
                    "caches, or raise the limit: `ulimit -n`)"
                )
            raise OSError(
                e.errno, f"cannot open {self._where(t, s)}: {e.strerror}{hint}", shown
            ) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CorruptDataError(
                    f"{self._where(t, s)} in {self.store_path} is not a regular file (a FIFO, "
                    "a device or a directory); refusing to read it: run `rowcache verify`"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def fd(self, t: int, s: int) -> int:
        """The descriptor of shard ``s`` of table ``t``, opened the first time."""
        key = (t, s)
        fd = self._open.get(key)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._open.get(key)
            if fd is None:
                fd = self._open_file(t, s)
                if not self.direct:
                    # Row reads are random: kernel readahead would only read pages nobody asked for.
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                self._open[key] = fd
                self.fds[self.file_base[t] + s] = fd
            return fd

    def fd_of(self, f: int) -> int:
        """The descriptor of file ``f``, opened the first time."""
        return self.fd(int(self.file_table[f]), int(self.file_shard[f]))

    def fds_of(self, files: np.ndarray) -> np.ndarray:
        """The descriptors of ``files`` (file numbers), opening the ones not open yet."""
        fds = self.fds[files]
        if int(fds.min()) < 0:
            for f in np.unique(files[fds < 0]).tolist():  # a loop over files, once each
                self.fd_of(f)
            fds = self.fds[files]
        return fds

    def open_all(self) -> bool:
        """Every shard file open (a native batch then never stops for one): opened here the
        first time; False if one cannot be (a batch that needs it raises its error)."""
        if not self._opened_all:
            try:
                for f in np.flatnonzero(self.fds < 0).tolist():  # once a file, once
                    self.fd_of(f)
            except (OSError, CorruptDataError, ConfigError):
                return False
            self._opened_all = True
        return True

    def close(self) -> None:
        """Close every open file (a later read opens them again)."""
        with self._lock:
            _close_all(self._open)
            self.fds[:] = -1
            self._opened_all = False


def _close_all(open_fds: dict[tuple[int, int], int]) -> None:
    """Close the descriptors of ``open_fds`` and empty it (close() and the finalizer)."""
    for fd in open_fds.values():
        os.close(fd)
    open_fds.clear()
