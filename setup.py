"""Native extensions of rowcache (metadata lives in pyproject.toml).

Small C modules for per-step host work that NumPy's per-call overhead cannot reach
(see bench/RESULTS.md); each has a NumPy reference it is tested against and the
package works without them (the references run instead).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kernels._host",
            ["kernels/_host.c"],
            extra_compile_args=["-O3", "-Wall", "-Wextra", "-std=c11"],
            optional=True,
        ),
    ]
)
