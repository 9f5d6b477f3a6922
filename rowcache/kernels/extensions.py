"""The native extensions this install has, and a warning when a Python path stands in for one.

Owns the list of the C modules the build makes (``setup.py``: :data:`EXTENSIONS`), their
loading (:func:`load`, which each wrapper calls once instead of a bare import, so that a
module that failed to import is remembered with why), what ``rowcache --version`` and the
demo's report say of them (:func:`status`, :func:`summary`), and :func:`fallback`, which
the wrappers call where a Python path runs because a module is missing: the first such use
of each module warns once (a ``RuntimeWarning`` naming it and how to build it). A missing
module changes no result, only speed (2-3x slower on the demo), which is why it must be
said. Which path runs is each wrapper's choice (``rowcache.kernels.host``,
``rowcache.kernels.quantize``, ``rowcache.io.native``, ``rowcache.io.checksum``), not this
module's; a test that switches a built module off (``host.native = None``) warns nothing.
"""

from __future__ import annotations

import importlib
import sys
import threading
import warnings
from types import ModuleType

#: every native module the build makes, with what runs in Python without it
EXTENSIONS: dict[str, str] = {
    "rowcache.kernels._host": "the host n-gram hash and the row cache's LRU paths",
    "rowcache.kernels._quantize": "the store builder's FP8 quantize",
    "rowcache.io._rcio": "the fault path's reads (io_uring or a pread pool) and page checksums",
}
#: modules the build makes only on some platforms
PLATFORMS: dict[str, str] = {"rowcache.io._rcio": "linux"}
BUILD_HINT = (
    "to build: install a C compiler, then `pip install -e .` in a checkout or `pip install .` "
    "(a build without a compiler fails unless ROWCACHE_ALLOW_NO_NATIVE=1)"
)

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
_why: dict[str, str] = {}  # a module that is not built here: why
_warned: set[str] = set()


def load(name: str) -> ModuleType | None:
    """The extension module ``name`` (one of :data:`EXTENSIONS`), or None where it is not
    built here; remembered, with the reason, for :func:`status` and :func:`fallback`."""
    if name not in EXTENSIONS:
        raise KeyError(f"{name!r} is not one of rowcache's native extensions")
    with _lock:
        if name in _loaded:
            return _loaded[name]
    platform = PLATFORMS.get(name)
    mod: ModuleType | None
    if platform is not None and not sys.platform.startswith(platform):
        mod, why = None, f"not made on {sys.platform} (only on {platform})"
    else:
        try:
            mod, why = importlib.import_module(name), ""
        except ImportError as e:
            mod, why = None, str(e) or type(e).__name__
    with _lock:
        _loaded.setdefault(name, mod)
        if mod is None:
            _why.setdefault(name, why)
        return _loaded[name]


def status() -> dict[str, str]:
    """``{module: "built" | "fallback"}`` for every module of :data:`EXTENSIONS`:
    ``"fallback"`` where the Python path runs in its place."""
    return {name: "built" if load(name) is not None else "fallback" for name in EXTENSIONS}


def missing() -> dict[str, str]:
    """``{module: why}`` of the modules that are not built here (empty: all are)."""
    status()
    with _lock:
        return dict(_why)


def summary() -> str:
    """One line: every native module built, or which run on their Python paths."""
    gone = missing()
    if not gone:
        return f"native extensions: all {len(EXTENSIONS)} built"
    return (
        f"native extensions: {', '.join(gone)} NOT built, their Python paths run (slower, "
        f"same results); {BUILD_HINT}"
    )


def fallback(name: str) -> None:
    """A Python path runs in place of ``name``: the first time for a module that is not
    built here, a ``RuntimeWarning`` naming it, what runs slower and how to build it.
    Nothing where ``name`` is built (a caller that chose the Python path itself)."""
    load(name)
    with _lock:
        if name not in _why or name in _warned:
            return
        _warned.add(name)
        why = _why[name]
    warnings.warn(
        f"the native extension {name} is not built ({why}); the Python path runs in its "
        f"place ({EXTENSIONS[name]}): 2-3x slower, same results; {BUILD_HINT}",
        RuntimeWarning,
        stacklevel=3,
    )


__all__ = ["BUILD_HINT", "EXTENSIONS", "fallback", "load", "missing", "status", "summary"]
