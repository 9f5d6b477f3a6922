"""Opening a store's own files: never through a link, never waiting on a FIFO.

Owns the one way the store package opens what lies inside a store directory (the marker,
the index directory and its data file): relative to the directory's descriptor, with
``O_NOFOLLOW`` (a link put in a file's place is refused, not followed out of the store) and
``O_NONBLOCK`` (a FIFO or a device opens at once instead of waiting for a writer), then
``fstat``: a regular file, or a :class:`FormatError` naming the file as its user knows it.
The shard files the reader opens are held to the same rule by ``rowcache.io.files``.
"""

from __future__ import annotations

import errno
import os
import stat

from rowcache.errors import FormatError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
FILE_FLAGS = os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC


def _refused(e: OSError, dirfd: int, name: str, shown: str, what: str) -> FormatError | None:
    """The error for a link or a non-directory where ``what`` should be (None: another error).
    ``O_NOFOLLOW | O_DIRECTORY`` fails with ``ENOTDIR`` on a link: ``lstat`` tells them apart."""
    link = e.errno == errno.ELOOP
    if e.errno == errno.ENOTDIR:
        try:
            link = stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
        except OSError:
            pass
    if link:
        return FormatError(
            f"{shown}: the {what} is a symbolic link; a store's files are never links "
            "(refusing to follow it): rebuild the store with `rowcache build`"
        )
    if e.errno == errno.ENOTDIR:
        return FormatError(f"{shown}: the {what} is not a directory; the store is damaged")
    return None


# What an open says about the file itself (a socket or a device in a store file's place):
# the store is damaged. Every other errno is about the process or the system.
_NOT_A_FILE = frozenset({errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP})
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})


def open_failure(e: OSError, shown: str, what: str) -> OSError:
    """The ``OSError`` (of ``e``'s errno, so ``PermissionError`` and the like keep their
    class) for a store file that exists but could not be opened for a reason outside the
    store: out of descriptors, permissions, memory, I/O. It names the file and says what
    happened; never a ``FormatError``, which says the store is damaged."""
    hint = ""
    if e.errno in _OUT_OF_DESCRIPTORS:
        hint = (
            ": the process is out of file descriptors (the store is not damaged); close "
            "other stores or caches, or raise the limit (`ulimit -n`)"
        )
    return OSError(e.errno, f"{shown}: cannot open the {what}: {e.strerror}{hint}")


def _open_at(dirfd: int, name: str, flags: int, shown: str, what: str) -> int:
    """``os.open(name, flags, dir_fd=dirfd)``; a missing name stays ``FileNotFoundError``,
    a link, a non-directory or a socket or device where ``what`` should be is a
    ``FormatError``, and any other failure (out of descriptors, permissions) an ``OSError``
    of its errno (:func:`open_failure`), each naming ``shown`` and ``what``."""
    try:
        return os.open(name, flags, dir_fd=dirfd)
    except FileNotFoundError:
        raise
    except OSError as e:
        err = _refused(e, dirfd, name, shown, what)
        if err is not None:
            raise err from None
        if e.errno in _NOT_A_FILE:
            raise FormatError(
                f"{shown}: cannot open the {what} ({e.strerror}): not a regular file; "
                "the store is damaged: rebuild it with `rowcache build`"
            ) from e
        raise open_failure(e, shown, what) from e


def open_dir_at(dirfd: int, name: str, shown: str, what: str) -> int:
    """The descriptor of directory ``name`` inside ``dirfd``; ``FileNotFoundError`` if it is
    missing, ``FormatError`` if it is a link or not a directory."""
    return _open_at(dirfd, name, DIR_FLAGS, shown, what)


def open_file_at(dirfd: int, name: str, shown: str, what: str) -> tuple[int, int]:
    """``(fd, size)`` of regular file ``name`` inside ``dirfd``; ``FileNotFoundError`` if it
    is missing, ``FormatError`` if it is a link, a FIFO, a device or a directory."""
    fd = _open_at(dirfd, name, FILE_FLAGS, shown, what)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(
                f"{shown}: the {what} is not a regular file (a FIFO, a device or a directory); "
                "refusing to read it: rebuild the store with `rowcache build`"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_exact(fd: int, n: int, offset: int, shown: str, what: str) -> bytes:
    """``n`` bytes at ``offset``; ``FormatError`` if the file ends first (cut while read)."""
    parts, got = [], 0
    while got < n:
        try:
            b = os.pread(fd, n - got, offset + got)
        except OSError as e:
            raise OSError(e.errno, f"{shown}: reading the {what}: {e.strerror}") from e
        if not b:
            raise FormatError(
                f"{shown}: the {what} ended at byte {offset + got:,} while being read "
                "(cut short or replaced meanwhile)"
            )
        parts.append(b)
        got += len(b)
    return b"".join(parts)


NOT_REGULAR = "not a regular file (a FIFO, a device or a socket): give a file"


def read_regular_text(path: str | os.PathLike[str], limit: int = 100_000_000) -> str:
    """The text of the regular file ``path`` (at most ``limit`` bytes), for a tool's JSON
    input: opened ``O_NONBLOCK`` and checked with ``fstat`` before any read, so a FIFO is an
    ``OSError`` at once, never a wait for a writer. Errors are ``OSError`` (and
    ``UnicodeDecodeError``), as ``Path.read_text`` raises them."""
    fd = os.open(os.fspath(path), os.O_RDONLY | _NONBLOCK | _CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, NOT_REGULAR)
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{st.st_size:,} bytes, over the limit of {limit:,}")
        return read_exact(fd, st.st_size, 0, os.fspath(path), "file").decode()
    finally:
        os.close(fd)


def write_regular_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path``, created or truncated, refusing (``OSError``) anything but
    a regular file there: opened ``O_NONBLOCK`` (a FIFO with no reader is ``ENXIO`` at once,
    not a wait), then ``fstat`` before the file is truncated."""
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | _NONBLOCK | _CLOEXEC, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{os.fspath(path)}: {NOT_REGULAR}")
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
        data = memoryview(text.encode())
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)
