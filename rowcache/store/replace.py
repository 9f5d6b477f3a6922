"""Making a finished build the store at ``path``: the atomic switch, build locks, leftovers.

Owns the one moment a build becomes visible. ``switch`` exchanges the finished build
with the store at ``path`` in one ``renameat2(RENAME_EXCHANGE)`` (Linux), so ``path``
holds the complete old or the complete new store at every instant; where the call is
missing it falls back to two renames and ``recover`` finishes a half-done switch on
the next open or build (and only then: a store the new one replaced is never put back).
Also owns the sibling directories builds leave behind
(``.NAME.building-*``, ``.NAME.old-*``, ``.NAME.switch-*``), the ``flock`` by which a
live build marks the ones it owns, and finding and removing the others.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import platform
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rowcache.errors import ConfigError

KINDS = ("building", "old", "switch")  # in-progress build; old store being removed; mid-switch
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}
AT_FDCWD = -100

# Test hook: called with the name of each step of a build or switch (crash-injection tests
# set it to a function that calls os._exit at one named point). None in production.
test_hook: Callable[[str], None] | None = None


def mark_step(name: str) -> None:
    """Pass the step of a build or switch just done to :data:`test_hook`, where one is set."""
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
def _renameat2() -> Callable[[bytes, bytes, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        return lambda a, b, flags: fn(AT_FDCWD, a, AT_FDCWD, b, flags)
    nr = _SYS_RENAMEAT2.get(platform.machine())
    if nr is None or not hasattr(libc, "syscall"):
        return None
    sc = libc.syscall
    return lambda a, b, flags: sc(ctypes.c_long(nr), AT_FDCWD, a, AT_FDCWD, b, ctypes.c_uint(flags))


# renameat2 where the platform has it; None gives the two-rename fallback (the switch's
# tests set it to None to run the fallback; it is not an option of the public API).
_EXCHANGE = _renameat2() if os.name == "posix" and platform.system() == "Linux" else None


def _renameat2_call(a: str, b: str, flags: int) -> bool:
    """renameat2(a, b, flags); False where the platform or file system cannot."""
    if _EXCHANGE is None:
        return False
    if _EXCHANGE(os.fsencode(a), os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # old kernel or file system
        return False
    raise OSError(err, f"renameat2({a!r}, {b!r}): {os.strerror(err)}", b)


def exchange(a: str, b: str) -> bool:
    """Swap directories ``a`` and ``b`` atomically; False where the platform cannot."""
    return _renameat2_call(a, b, RENAME_EXCHANGE)


def rename_new(a: str, b: str) -> None:
    """Rename ``a`` to ``b`` where nothing is at ``b``: ``FileExistsError`` if something
    is (``RENAME_NOREPLACE``; a plain rename where renameat2 is missing, which may only
    replace an empty directory)."""
    if _renameat2_call(a, b, RENAME_NOREPLACE):
        return
    try:
        os.rename(a, b)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(e.errno, f"{b} exists", b) from None
        raise


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


NAME_MAX = 255  # bytes of one name in a directory (Linux's file systems; POSIX's minimum is 14)
_TOKEN_CHARS = 12
# the bytes a sibling's name adds to its stem: ".", ".", the longest kind, "-", the token
_SIBLING_EXTRA = 3 + max(len(k) for k in (*KINDS, "tmp")) + _TOKEN_CHARS
_DIGEST_CHARS = 16


def sibling_stem(base: str) -> str:
    """The ``NAME`` part of the hidden siblings (``.NAME.<kind>-<token>``) of a store or a
    trace named ``base``: ``base`` itself where the sibling's name fits ``NAME_MAX`` bytes
    (``base`` of up to 232 bytes), else ``base`` cut to fit, then ``~`` and 16 hex digits of
    its SHA-256, so that a legal name of 233 to 255 bytes builds too (a longer sibling name
    failed with ENAMETOOLONG) and two long names that share a beginning keep apart."""
    raw = os.fsencode(base)
    if len(raw) + _SIBLING_EXTRA <= NAME_MAX:
        return base
    digest = hashlib.sha256(raw).hexdigest()[:_DIGEST_CHARS]
    room = NAME_MAX - _SIBLING_EXTRA - 1 - _DIGEST_CHARS
    cut = raw[:room].decode(errors="ignore")  # whole characters only (a UTF-8 name stays one)
    while len(os.fsencode(cut)) > room:  # surrogate-escaped bytes may encode longer
        cut = cut[:-1]
    return f"{cut}~{digest}"


def sibling_prefix(path: str, kind: str) -> str:
    """``.NAME.<kind>-``: how every ``kind`` sibling of ``path`` begins (:func:`sibling_stem`)."""
    return f".{sibling_stem(os.path.basename(path))}.{kind}-"


def sibling_name(path: str, kind: str) -> str:
    """A fresh ``.NAME.<kind>-<random>`` path beside ``path``, at most ``NAME_MAX`` bytes."""
    parent = os.path.dirname(path)
    return os.path.join(parent, sibling_prefix(path, kind) + uuid.uuid4().hex[:_TOKEN_CHARS])


def new_sibling(path: str, kind: str) -> tuple[str, DirLock]:
    """Create ``.NAME.<kind>-<random>`` beside ``path`` and return it locked."""
    while True:
        tmp = sibling_name(path, kind)
        os.mkdir(tmp)
        try:
            lock = DirLock(tmp)
        except FileNotFoundError:
            continue  # a concurrent cleaner removed it before we locked it
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
    parent = os.path.dirname(p)
    try:
        names = sorted(os.listdir(parent))
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        kind = next((k for k in KINDS if n.startswith(sibling_prefix(p, k))), None)
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
            mark_step(step)
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


def _token(sibling: str) -> str:
    """The random part of a ``.NAME.<kind>-<token>`` sibling's name."""
    return os.path.basename(sibling).rsplit("-", 1)[-1]


def _build_of(switch_dir: str, path: str) -> str:
    """The build directory whose fallback switch moved the store at ``path`` to
    ``switch_dir``: both carry one token (see :func:`switch`)."""
    parent = os.path.dirname(path)
    return os.path.join(parent, sibling_prefix(path, "building") + _token(switch_dir))


@contextlib.contextmanager
def switch_lock(path: str) -> Iterator[None]:
    """Held while a switch of a store in ``path``'s parent directory renames, and while
    :func:`recover` looks for a half-done one: an exclusive ``flock`` on the parent, so two
    builds' switches (and a recovery) never interleave their renames. Released before the
    old store is removed; without a parent that can be opened, nothing is held."""
    try:
        lock = DirLock(os.path.dirname(path))
    except OSError:
        yield
        return
    try:
        yield
    finally:
        lock.close()


def recover(path: str | os.PathLike[str]) -> bool:
    """Finish a half-done non-atomic switch: put the moved-away store back at ``path``.

    Only where ``path`` is missing and a ``.NAME.switch-T`` sibling exists whose build,
    ``.NAME.building-T``, is still there: the state a process that died between the two
    renames of the fallback switch leaves, before the new store took ``path``. A switch
    sibling without its build is a store the new one has replaced: it is never put back
    (a store deleted after the switch stays deleted), only removed as a leftover. Runs
    under :func:`switch_lock`, so a switch in progress is waited for, never undone. True if
    restored.
    """
    p = os.path.abspath(os.fspath(path))
    if os.path.lexists(p):
        return False
    with switch_lock(p):
        if os.path.lexists(p):
            return False
        for lo in find_leftovers(p):
            if lo.kind != "switch" or not os.path.isdir(_build_of(lo.path, p)):
                continue
            lock = try_lock(lo.path)
            if lock is None:
                continue
            try:
                os.rename(lo.path, p)
                fsync_dir(os.path.dirname(p))
                return True
            finally:
                lock.close()
    return False


# -- the switch ------------------------------------------------------------------
def switch(tmp: str, path: str, check_existing: Callable[[str], None]) -> None:
    """Make the finished build ``tmp`` the store at ``path``, removing the old one.

    ``path`` always holds the old or the new store: one ``renameat2(RENAME_NOREPLACE)``
    when ``path`` does not exist, one ``renameat2(RENAME_EXCHANGE)`` when it does, after
    ``check_existing(path)`` (which raises where what is there may not be replaced). The
    check and the renames run under :func:`switch_lock`: another build's switch of the same
    path comes wholly before or wholly after, and finds this build's store at ``path``.
    Without renameat2 the old store is first moved to ``.NAME.switch-T`` (T: the token of
    ``tmp``'s name, which :func:`recover` uses to restore it only if the process dies
    before the second rename). The parent directory is fsynced before the old store is
    removed.
    """
    parent = os.path.dirname(path)
    with switch_lock(path):
        old, old_lock = None, None
        try:
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, "exists", path)
            rename_new(tmp, path)
        except FileExistsError:
            check_existing(path)
            old, old_lock = _move_in(tmp, path, parent)
        else:
            mark_step("renamed")
    fsync_dir(parent)
    mark_step("synced")
    if old is None or old_lock is None:
        return
    try:
        remove_tree(old, step="old-removing")
    except OSError:
        pass  # left for the next build of this path to remove (find_leftovers reports it)
    finally:
        old_lock.close()
    mark_step("old-removed")


def _move_in(tmp: str, path: str, parent: str) -> tuple[str | None, DirLock | None]:
    """Exchange ``tmp`` with the store at ``path`` (or the two-rename fallback); the old
    store's new name and its lock, or ``(None, None)`` where another holds it."""
    if exchange(tmp, path):
        mark_step("exchanged")
        # ``tmp`` now holds the old store (unlocked: our build lock followed the new one).
        old_lock = try_lock(tmp)
        if old_lock is None:  # the build that made it still holds it: left as a leftover
            return None, None
        try:
            old = sibling_name(path, "old")
            os.rename(tmp, old)
            mark_step("old-renamed")
        except BaseException:
            old_lock.close()
            raise
        return old, old_lock
    moved = os.path.join(parent, sibling_prefix(path, "switch") + _token(tmp))
    old_lock = DirLock(path)
    try:
        os.rename(path, moved)  # path is missing from here ...
        try:
            mark_step("old-moved")
            os.rename(tmp, path)  # ... to here; recover() restores `moved` if we die between
        except BaseException:
            with contextlib.suppress(OSError):
                os.rename(moved, path)  # an error, not a crash: put the old store back now
            raise
        mark_step("new-moved")
        old = sibling_name(path, "old")
        os.rename(moved, old)
        mark_step("old-renamed")
    except BaseException:
        old_lock.close()
        raise
    return old, old_lock


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
