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

They need only a C compiler and libc. Where one cannot be built the Python paths run
instead (same results, slower), so a failed compile is a warning, not a failed install.
The sdist ships csrc/ (MANIFEST.in).
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as e:  # no compiler: the package still installs
            print(f"warning: native extensions not built ({e}); using the Python paths", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            print(f"warning: {ext.name} not built ({e}); using its Python path", file=sys.stderr)


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
