"""The shard files of a :class:`rowcache.io.reader.RowReader`: names, numbering, descriptors.

Owns the store's shard files as the reader's engines see them: every file numbered once
(table after table, ``file_base[t] + s``), and the descriptor table ``fds`` (int32, -1: not
open), which the native engine reads in place; files are opened on first need (``O_DIRECT``
where asked), under a lock, and named in the error of a missing one. It does not read.
"""

from __future__ import annotations

import errno
import os
import threading

import numpy as np

from rowcache.errors import ConfigError, CorruptDataError
from rowcache.store import format as fmt


class ShardFiles:
    """The open shard files of one reader.

    ``shard_files[t][s]`` names shard ``s`` of table ``t`` inside ``root``. File ``f``
    (``file_base[t] + s``) is shard ``file_shard[f]`` of table ``file_table[f]``; its
    descriptor is ``fds[f]`` once open. Thread-safe.
    """

    def __init__(
        self, root: str, tables: list[fmt.TableInfo], shard_files: list[list[str]], direct: bool
    ) -> None:
        self.root = root
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

    def missing_shard(self, t: int, s: int) -> CorruptDataError:
        return CorruptDataError(
            f"shard file {self.shard_files[t][s]} (table {self.tables[t].name!r}, "
            f"shard {s}) is missing from {self.root}; run `rowcache verify`"
        )

    def fd(self, t: int, s: int) -> int:
        """The descriptor of shard ``s`` of table ``t``, opened the first time."""
        key = (t, s)
        fd = self._open.get(key)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._open.get(key)
            if fd is None:
                path = os.path.join(self.root, self.shard_files[t][s])
                flags = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
                try:
                    fd = os.open(path, flags)
                except FileNotFoundError as e:
                    raise self.missing_shard(t, s) from e
                except OSError as e:
                    if self.direct and e.errno == errno.EINVAL:
                        raise ConfigError(
                            f"direct=True: the file system of {self.root} refuses O_DIRECT; "
                            "use direct=False"
                        ) from e
                    raise
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
            for fd in self._open.values():
                os.close(fd)
            self._open.clear()
            self.fds[:] = -1
            self._opened_all = False
