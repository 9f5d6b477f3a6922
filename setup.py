"""Native extensions of rowcache (metadata lives in pyproject.toml).

Three small C modules, each the smallest piece that reaches a measured target Python
cannot (see bench/RESULTS.md), each tested against its Python reference:
``rowcache._rcio`` (a fault step's reads: io_uring through raw system calls or a pread
pool, page checksums, the record cut) and ``kernels._host`` (the packed host hash and
the row cache's all-hits path), ``kernels._quantize`` (the builder's FP8 quantize, straight
into shard pages). They need only a C compiler and libc. Where one cannot
be built the Python paths run instead (same results, slower), so a failed compile is a
warning, not a failed install.
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


ext_modules = [
    Extension(
        "kernels._host",
        ["kernels/_host.c"],
        depends=["kernels/_pool.h", "kernels/_lru_miss.h", "kernels/_touch.h"],
        extra_compile_args=["-O3", "-Wall", "-Wextra", "-std=c11", "-pthread"],
        extra_link_args=["-pthread"],
    ),
    Extension(
        "kernels._quantize",
        ["kernels/_quantize.c"],
        # IEEE float32 as NumPy computes it: no contraction into FMAs, no fast-math.
        extra_compile_args=["-O3", "-Wall", "-Wextra", "-std=c11", "-ffp-contract=off"],
    ),
]
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "rowcache._rcio",
            ["rowcache/_rcio.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-std=gnu11"],
            extra_link_args=["-pthread"],
        )
    )

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
