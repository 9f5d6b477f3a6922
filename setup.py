"""Native extensions of rowcache (metadata lives in pyproject.toml).

Three small C modules, each the smallest piece that reaches a measured target Python
cannot (docs/benchmarks.md; the history in docs/results/), each tested against its Python reference. Their sources
are in csrc/, one file per concept, each with its own header where other files use it:

- ``rowcache.io._rcio`` (csrc/rcio.c): a fault step's reads: io_uring through raw system
  calls or a pread pool, page checksums, the record cut. Linux only.
- ``rowcache.kernels._host``: the packed host hash (csrc/ngram_hash.c) and the row cache's
  LRU: the all-hits path and the log's compaction (csrc/lru_hits.c), the miss plan and
  commit (csrc/lru_miss.c), the deferred touch (csrc/lru_touch.c), the row map's hash
  (csrc/row_map.c); their thread pool
  (csrc/pool.c), buffer helpers (csrc/pybuf.c) and method table (csrc/host_module.c).
- ``rowcache.kernels._quantize`` (csrc/quantize.c): the builder's FP8 quantize, straight
  into shard pages.

They need only a C compiler and libc. Without them the Python paths run instead (same
results, 2-3x slower), and an install that silently fell back was hard to notice (pip hides
a build's warnings), so a module that fails to build fails the install, saying why and how
to proceed, unless ``ROWCACHE_ALLOW_NO_NATIVE=1`` asks for the pure-Python install: then
each failure is a warning, and ``rowcache --version`` and the first use of each Python path
say so (``rowcache.kernels.extensions``). The sdist ships csrc/ (MANIFEST.in).
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import BaseError

ALLOW_ENV = "ROWCACHE_ALLOW_NO_NATIVE"


def allow_no_native() -> bool:
    """Whether ROWCACHE_ALLOW_NO_NATIVE asks for an install without the native modules."""
    return os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class NativeBuildError(BaseError):
    """A native module did not build and ROWCACHE_ALLOW_NO_NATIVE is not set (setup()
    prints it as one ``error:`` line and exits 1)."""


def _failed(what: str, e: BaseException) -> None:
    """Fail the build on ``what``'s error ``e``, or warn where the env var allows it."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
    if allow_no_native():
        print(
            f"warning: {what} not built ({first}); {ALLOW_ENV}=1: installing its Python path "
            "(2-3x slower, same results; `rowcache --version` lists what is not built)",
            file=sys.stderr,
        )
        return
    raise NativeBuildError(
        f"rowcache: {what} did not build ({first}). Install a C compiler (e.g. "
        f"`apt install gcc` or build-essential) and retry, or set {ALLOW_ENV}=1 to install "
        "the pure-Python paths (2-3x slower, same results)."
    ) from e


class OptionalBuildExt(build_ext):
    """build_ext that fails loudly on a module that does not build, unless
    ROWCACHE_ALLOW_NO_NATIVE=1 makes each failure a warning."""

    def run(self):
        try:
            super().run()
        except NativeBuildError:
            raise
        except Exception as e:  # no compiler at all
            _failed("the native extensions", e)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            _failed(ext.name, e)


HOST_SOURCES = [
    "host_module", "pool", "pybuf", "ngram_hash", "engram_hash",
    "lru_state", "lru_hits", "lru_miss", "lru_touch", "row_map",
]
HOST_HEADERS = [
    "pool", "pybuf", "ngram_hash", "engram_hash",
    "lru_state", "lru_hits", "lru_miss", "lru_slots", "lru_status", "lru_touch", "row_map",
]

ext_modules = [
    Extension(
        "rowcache.kernels._host",
        [f"csrc/{name}.c" for name in HOST_SOURCES],
        include_dirs=["csrc"],
        depends=[f"csrc/{name}.h" for name in HOST_HEADERS],
        extra_compile_args=["-O3", "-Wall", "-Wextra", "-std=c11", "-pthread"],
        extra_link_args=["-pthread"],
    ),
    Extension(
        "rowcache.kernels._quantize",
        ["csrc/quantize.c"],
        include_dirs=["csrc"],
        # IEEE float32 as NumPy computes it: no contraction into FMAs, no fast-math.
        extra_compile_args=["-O3", "-Wall", "-Wextra", "-std=c11", "-ffp-contract=off"],
    ),
]
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "rowcache.io._rcio",
            ["csrc/rcio.c"],
            include_dirs=["csrc"],
            depends=["csrc/rcio_status.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-std=gnu11"],
            extra_link_args=["-pthread"],
        )
    )

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
