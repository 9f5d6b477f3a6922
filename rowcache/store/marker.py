"""The marker file that makes a directory a rowcache store and records its index checksum.

Owns ``rowcache-store.json`` (``format.MARKER_NAME``), the last file a build writes into
its directory before the switch: the format's name, and the length and CRC32C of the index
file (``index.lmdb/data.mdb``). An open checks the index against it before LMDB reads the
index (LMDB trusts its file: one flipped bit can make it read a node past the end of its
map, a SIGBUS), and ``overwrite=True`` replaces only a directory the format marks as a store
(:func:`is_store`). Stores built before the marker existed have none: they open with the LMDB
header check alone (``rowcache.store.index``), and an overwrite replaces one only where its
layout is exactly a store's, index directory included.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass

import crc32c

from rowcache.errors import FormatError
from rowcache.format import layout as fmt
from rowcache.store.safeopen import DIR_FLAGS, open_dir_at, open_file_at, read_exact

MAX_MARKER_BYTES = 4096
CHUNK = 16 << 20  # bytes read at a time when checksumming an index
_SHARD_NAME = re.compile(r"t\d{4}-s\d{6}\.bin")
_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_FILES = ("data.mdb", "lock.mdb")  # what an index directory may hold


@dataclass(frozen=True)
class Marker:
    """What a store's marker records: its index file's length and CRC32C."""

    index_bytes: int
    index_crc32c: int

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": fmt.FORMAT_NAME,
                "index_bytes": self.index_bytes,
                "index_crc32c": f"{self.index_crc32c:08x}",
            },
            sort_keys=True,
        ).encode()

    @staticmethod
    def from_bytes(raw: bytes, shown: str) -> Marker:
        """The marker in ``raw``; ``FormatError`` naming ``shown`` for anything else."""
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            obj = None
        fields = {"format", "index_bytes", "index_crc32c"}
        crc = obj.get("index_crc32c") if isinstance(obj, dict) else None
        if (
            not isinstance(obj, dict)
            or set(obj) != fields
            or obj["format"] != fmt.FORMAT_NAME
            or type(obj["index_bytes"]) is not int
            or obj["index_bytes"] < 0
            or not isinstance(crc, str)
            or not re.fullmatch(r"[0-9a-f]{8}", crc)
        ):
            raise FormatError(
                f"{shown}: the store's marker is damaged (a JSON object of exactly "
                f"{sorted(fields)} was expected); rebuild the store with `rowcache build`"
            )
        return Marker(obj["index_bytes"], int(crc, 16))


def index_checksum(fd: int, size: int, shown: str, sink: int = -1) -> int:
    """CRC32C of the first ``size`` bytes of ``fd``, copied to ``sink`` on the way (a
    descriptor, or -1). ``FormatError`` if the file ends first."""
    crc, off = 0, 0
    while off < size:
        data = read_exact(fd, min(CHUNK, size - off), off, shown, "index file")
        crc = crc32c.crc32c(data, crc)
        if sink >= 0:
            view = memoryview(data)
            while view:
                view = view[os.write(sink, view) :]
        off += len(data)
    return crc


def write_marker(root: str) -> Marker:
    """Record the index file of the store being built in ``root`` in its marker, and
    fsync both: the builder's last write before the switch. A test that edits a store's
    index on purpose calls it again to record the edited index as the builder's."""
    shown = os.path.join(root, fmt.INDEX_NAME, fmt.INDEX_FILE)
    dirfd = os.open(root, DIR_FLAGS)
    try:
        ifd = open_dir_at(dirfd, fmt.INDEX_NAME, shown, "index directory")
        try:
            fd, size = open_file_at(ifd, fmt.INDEX_FILE, shown, "index file")
        finally:
            os.close(ifd)
        try:
            marker = Marker(size, index_checksum(fd, size, shown))
        finally:
            os.close(fd)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        out = os.open(fmt.MARKER_NAME, flags, 0o644, dir_fd=dirfd)
        try:
            data = memoryview(marker.to_bytes())
            while data:
                data = data[os.write(out, data) :]
            os.fsync(out)
        finally:
            os.close(out)
        os.fsync(dirfd)
    finally:
        os.close(dirfd)
    return marker


def read_marker(dirfd: int, path: str) -> Marker | None:
    """The marker of the store directory ``dirfd`` (shown as ``path``); None where there
    is none (a store built before markers); ``FormatError`` for a marker that is a link, a
    FIFO, too long or not what the builder writes."""
    shown = os.path.join(path, fmt.MARKER_NAME)
    try:
        fd, size = open_file_at(dirfd, fmt.MARKER_NAME, shown, "store's marker")
    except FileNotFoundError:
        return None
    try:
        if size > MAX_MARKER_BYTES:
            raise FormatError(
                f"{shown}: {size:,} bytes, over the {MAX_MARKER_BYTES:,} of a store's marker: "
                "the store is damaged; rebuild it with `rowcache build`"
            )
        raw = read_exact(fd, size, 0, shown, "store's marker")
    finally:
        os.close(fd)
    return Marker.from_bytes(raw, shown)


def is_store(path: str) -> bool:
    """True if ``overwrite=True`` may replace the directory ``path``: it holds the index
    directory, shard files and a marker and nothing else, the index directory holds LMDB's
    files alone, and the marker reads; or, for a store built before markers, no marker and
    an index file that begins with LMDB's header."""
    names = os.listdir(path)
    if fmt.INDEX_NAME not in names:
        return False
    if not all(n in (fmt.INDEX_NAME, fmt.MARKER_NAME) or _SHARD_NAME.fullmatch(n) for n in names):
        return False
    try:
        dirfd = os.open(path, DIR_FLAGS)
    except OSError:
        return False
    try:
        try:
            ifd = open_dir_at(dirfd, fmt.INDEX_NAME, path, "index directory")
        except (OSError, FormatError):
            return False
        try:
            if not set(os.listdir(ifd)) <= set(_LMDB_FILES):
                return False  # someone's files in the index directory: not ours to delete
            if fmt.MARKER_NAME in names:
                read_marker(dirfd, path)
                return True
            fd, _ = open_file_at(ifd, fmt.INDEX_FILE, path, "index file")
            try:
                head = os.pread(fd, 20, 0)
            finally:
                os.close(fd)
            return len(head) == 20 and struct.unpack_from("<I", head, 16)[0] == _LMDB_MAGIC
        except (OSError, FormatError):
            return False
        finally:
            os.close(ifd)
    finally:
        os.close(dirfd)
