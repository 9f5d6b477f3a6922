"""The user's cache directory: where rowcache writes what it makes from a checkpoint that it
must not write into (a shared model directory, a read-only mount, another user's Hugging Face
cache).

Owns the directory's rule (``ROWCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/rowcache``, else
``~/.cache/rowcache``), the default place of a checkpoint's row store inside it (keyed by
the checkpoint's real path and by the size and time of the files the store is built from, so
a checkpoint rewritten in place gets a new store, never stale rows) and the check, before a
build, that a store can be written where it is to go. Reads no checkpoint and builds nothing.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterable

from rowcache.errors import ConfigError

CACHE_ENV = "ROWCACHE_CACHE_DIR"
STORES = "stores"  # the cache directory's folder of checkpoint stores
_LABEL_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_LABEL_MAX = 80


def cache_dir() -> str:
    """``$ROWCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/rowcache``, else ``~/.cache/rowcache``
    (an empty variable counts as unset, as XDG says). Not created here."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "rowcache")


def checkpoint_label(directory: str) -> str:
    """A readable name of a checkpoint directory: ``org--name-<revision>`` for a Hugging Face
    cache snapshot (``.../models--org--name/snapshots/<revision>``), else its base name."""
    real = os.path.realpath(directory)
    parent, base = os.path.split(real)
    if os.path.basename(parent) == "snapshots":
        repo = os.path.basename(os.path.dirname(parent)).removeprefix("models--")
        base = f"{repo}-{base[:12]}"
    label = _LABEL_CHARS.sub("_", base).strip("._") or "checkpoint"
    return label[:_LABEL_MAX]


def checkpoint_key(directory: str, files: Iterable[str]) -> str:
    """``<label>-<16 hex digits>``: the checkpoint directory's label and a SHA-256 of its real
    path and of each file's real path, size and modification time (``files``: those the store
    is built from). The same checkpoint gets the same key; one rewritten in place a new one."""
    h = hashlib.sha256(os.fsencode(os.path.realpath(directory)))
    for f in sorted({os.path.realpath(f) for f in files}):
        try:
            st = os.stat(f)
            ident = f"{st.st_size}:{st.st_mtime_ns}"
        except OSError:  # missing: the loader names it when it reads the file
            ident = "missing"
        h.update(b"\0" + os.fsencode(f) + b"\0" + ident.encode())
    return f"{checkpoint_label(directory)}-{h.hexdigest()[:16]}"


def default_store(directory: str, files: Iterable[str], name: str) -> str:
    """Where the store ``name`` of the checkpoint in ``directory`` goes by default:
    ``<cache_dir()>/stores/<checkpoint_key(directory, files)>/<name>``."""
    return os.path.join(cache_dir(), STORES, checkpoint_key(directory, files), name)


def check_store_writable(store: str, *, default: bool) -> None:
    """A one-line ``ConfigError`` naming ``store=`` unless a store can be built at ``store``:
    its parent directory is created if missing, then a directory made and removed in it (the
    build's first write). ``default``: ``store`` is the default (:func:`default_store`), so
    the error also names ``ROWCACHE_CACHE_DIR``."""
    parent = os.path.dirname(os.path.abspath(store))
    try:
        os.makedirs(parent, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".rowcache-probe-", dir=parent))
    except OSError as e:
        what = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
        hint = (
            f"it is the default, inside the cache directory {cache_dir()}; set {CACHE_ENV} "
            "to a writable directory, or pass store= one"
            if default
            else "pass store= a writable directory"
        )
        raise ConfigError(
            f"store={store!r}: a store cannot be built there ({what}); {hint}"
        ) from None


__all__ = [
    "CACHE_ENV",
    "cache_dir",
    "check_store_writable",
    "checkpoint_key",
    "checkpoint_label",
    "default_store",
]
