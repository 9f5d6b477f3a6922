"""Build of the native I/O extension ``rowcache._rcio`` (metadata lives in pyproject.toml).

The extension needs only a C compiler and libc (io_uring is used through raw system
calls). Where it cannot be built, ``rowcache.reader`` runs its Python path instead
(same results, slower), so a failed compile is a warning, not a failed install.
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as e:  # no compiler: the package still installs
            print(
                f"warning: rowcache._rcio not built ({e}); using the Python reader", file=sys.stderr
            )

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            print(
                f"warning: rowcache._rcio not built ({e}); using the Python reader", file=sys.stderr
            )


ext_modules = []
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
