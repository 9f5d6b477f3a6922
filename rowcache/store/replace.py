"""Making a finished build the store at ``path``: the atomic switch, build locks, leftovers.

Owns the one moment a build becomes visible. ``switch`` exchanges the finished build
with the store at ``path`` in one ``renameat2(RENAME_EXCHANGE)`` (Linux), so ``path``
holds the complete old or the complete new store at every instant; where the call is
missing it falls back to two renames and ``recover`` finishes a half-done switch on
the next open or build. Also owns the sibling directories builds leave behind
(``.NAME.building-*``, ``.NAME.old-*``, ``.NAME.switch-*``), the ``flock`` by which a
live build marks the ones it owns, and finding and removing the others.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from rowcache.errors import ConfigError

KINDS = ("building", "old", "switch")  # in-progress build; old store being removed; mid-switch
RENAME_EXCHANGE = 2
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}
AT_FDCWD = -100

# Test hook: called with the name of each step of the switch (crash-injection tests
# set it to a function that calls os._exit at one named point). None in production.
test_hook: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if test_hook is not None:
        test_hook(name)


@dataclass(frozen=True)
class Leftover:
    """A sibling directory a build of ``store`` left behind.

    ``kind``: ``"building"`` (an unfinished build), ``"old"`` (a replaced store not yet
    removed) or ``"switch"`` (a store moved away by a non-atomic switch; ``recover``
    puts it back when ``store`` is missing). ``live`` is true while a running build
    holds its lock: such a directory is never removed.
    """

    path: str
    store: str
    kind: str
    bytes: int
    live: bool


# -- renameat2 -------------------------------------------------------------------
def _renameat2() -> Callable[[bytes, bytes], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        return lambda a, b: fn(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)
    nr = _SYS_RENAMEAT2.get(platform.machine())
    if nr is None or not hasattr(libc, "syscall"):
        return None
    sc = libc.syscall
    return lambda a, b: sc(
        ctypes.c_long(nr), AT_FDCWD, a, AT_FDCWD, b, ctypes.c_uint(RENAME_EXCHANGE)
    )


_EXCHANGE = _renameat2() if os.name == "posix" and platform.system() == "Linux" else None


def exchange(a: str, b: str) -> bool:
    """Swap directories ``a`` and ``b`` atomically; False where the platform cannot."""
    if _EXCHANGE is None:
        return False
    if _EXCHANGE(os.fsencode(a), os.fsencode(b)) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # old kernel or file system
        return False
    raise OSError(err, f"renameat2({a!r}, {b!r}, RENAME_EXCHANGE): {os.strerror(err)}")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- locks -----------------------------------------------------------------------
class DirLock:
    """An exclusive ``flock`` on a directory, held while a build owns it.

    The kernel drops it when the process dies (even by SIGKILL), so a leftover whose
    lock can be taken belongs to no live build.
    """

    def __init__(self, path: str, *, block: bool = True) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = -1


def try_lock(path: str) -> DirLock | None:
    """The lock of ``path`` if no live build holds it, else None (also if it vanished)."""
    try:
        return DirLock(path, block=False)
    except BlockingIOError:
        return None
    except (FileNotFoundError, NotADirectoryError):
        return None


def sibling_name(path: str, kind: str) -> str:
    """A fresh ``.NAME.<kind>-<random>`` path beside ``path``."""
    parent, base = os.path.split(path)
    return os.path.join(parent, f".{base}.{kind}-{uuid.uuid4().hex[:12]}")


def new_sibling(path: str, kind: str) -> tuple[str, DirLock]:
    """Create ``.NAME.<kind>-<random>`` beside ``path`` and return it locked."""
    while True:
        tmp = sibling_name(path, kind)
        os.mkdir(tmp)
        lock = DirLock(tmp)
        # A concurrent cleaner may have removed it between mkdir and flock: start again.
        try:
            if os.stat(tmp).st_ino == os.fstat(lock.fd).st_ino:
                return tmp, lock
        except FileNotFoundError:
            pass
        lock.close()


# -- leftovers -------------------------------------------------------------------
def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def find_leftovers(path: str | os.PathLike[str]) -> list[Leftover]:
    """The ``.NAME.building-*`` / ``.NAME.old-*`` / ``.NAME.switch-*`` siblings of ``path``."""
    p = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(p)
    try:
        names = sorted(os.listdir(parent))
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        kind = next((k for k in KINDS if n.startswith(f".{base}.{k}-")), None)
        full = os.path.join(parent, n)
        if kind is None or os.path.islink(full) or not os.path.isdir(full):
            continue
        lock = try_lock(full)
        if lock is not None:
            lock.close()
        out.append(Leftover(full, p, kind, _tree_bytes(full), live=lock is None))
    return out


def remove_tree(path: str, step: str | None = None) -> None:
    """Remove a store directory, a file at a time (``step`` names the point after the first)."""
    names = sorted(os.listdir(path))
    for i, n in enumerate(names):
        full = os.path.join(path, n)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            try:
                os.unlink(full)
            except FileNotFoundError:
                pass
        if i == 0 and step is not None:
            _step(step)
    os.rmdir(path)


def remove_leftovers(path: str | os.PathLike[str]) -> list[Leftover]:
    """Remove every leftover of ``path`` that no live build owns; returns the removed ones.

    A ``switch`` leftover is restored by :func:`recover` first when ``path`` is missing.
    """
    recover(path)
    removed = []
    for lo in find_leftovers(path):
        if lo.live:
            continue
        lock = try_lock(lo.path)
        if lock is None:
            continue
        try:
            remove_tree(lo.path)
        except FileNotFoundError:
            pass
        finally:
            lock.close()
        removed.append(lo)
    return removed


def recover(path: str | os.PathLike[str], wait_s: float = 2.0) -> bool:
    """Finish a half-done non-atomic switch: put the moved-away store back at ``path``.

    Only where ``path`` is missing and a ``.NAME.switch-*`` sibling exists (the state
    between the two renames of the fallback switch). A switch still owned by a live
    build is waited for (it takes microseconds) up to ``wait_s``. True if restored.
    """
    p = os.path.abspath(os.fspath(path))
    deadline = time.monotonic() + wait_s
    while not os.path.lexists(p):
        cands = [lo for lo in find_leftovers(p) if lo.kind == "switch"]
        if not cands:
            return False
        if all(lo.live for lo in cands):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
            continue
        for lo in cands:
            lock = try_lock(lo.path)
            if lock is None:
                continue
            try:
                if not os.path.lexists(p):
                    os.rename(lo.path, p)
                    fsync_dir(os.path.dirname(p))
                    return True
            finally:
                lock.close()
    return False


# -- the switch ------------------------------------------------------------------
def switch(tmp: str, path: str) -> None:
    """Make the finished build ``tmp`` the store at ``path``, removing the old one.

    ``path`` always holds the old or the new store: one ``rename`` when ``path`` does
    not exist, one ``renameat2(RENAME_EXCHANGE)`` when it does. Without renameat2 the
    old store is first moved to ``.NAME.switch-*`` (which :func:`recover` restores if
    the process dies before the second rename). The parent directory is fsynced
    before the old store is removed.
    """
    parent = os.path.dirname(path)
    if not os.path.lexists(path):
        os.rename(tmp, path)
        _step("renamed")
        fsync_dir(parent)
        _step("synced")
        return
    if exchange(tmp, path):
        _step("exchanged")
        # ``tmp`` now holds the old store (unlocked: our build lock followed the new one).
        old_lock = try_lock(tmp)
        if old_lock is None:  # a concurrent cleaner took it: it removes it
            fsync_dir(parent)
            _step("synced")
            return
        old = sibling_name(path, "old")
        os.rename(tmp, old)
        _step("old-renamed")
    else:
        moved = sibling_name(path, "switch")
        old_lock = DirLock(path)
        os.rename(path, moved)  # path is missing from here ...
        _step("old-moved")
        os.rename(tmp, path)  # ... to here; recover() restores `moved` if we die between
        _step("new-moved")
        old = sibling_name(path, "old")
        os.rename(moved, old)
        _step("old-renamed")
    fsync_dir(parent)
    _step("synced")
    try:
        remove_tree(old, step="old-removing")
    except OSError:
        pass  # left for the next build of this path to remove (find_leftovers reports it)
    finally:
        old_lock.close()
    _step("old-removed")


def check_replaceable(path: str, is_store: Callable[[str], bool]) -> None:
    """ConfigError unless ``path`` is a rowcache store or an empty directory."""
    if os.path.islink(path):
        raise ConfigError(
            f"path {path!r} is a symbolic link; refusing to replace it: give the directory "
            f"it points to ({os.path.realpath(path)!r}) or another path"
        )
    if not os.path.isdir(path):
        raise ConfigError(f"path {path!r} exists and is not a directory; refusing to replace it")
    names = sorted(os.listdir(path))
    if names and not is_store(path):
        shown = names[:5] + (["..."] if len(names) > 5 else [])
        raise ConfigError(
            f"path {path!r} is a directory that is not a rowcache store (it holds "
            f"{len(names)} entries: {', '.join(shown)}); overwrite=True replaces only a "
            "rowcache store or an empty directory: remove it yourself or choose another path"
        )
