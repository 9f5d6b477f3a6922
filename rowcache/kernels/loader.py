"""Shared plumbing of the GPU kernels: cupy detection and cached NVRTC modules.

Owns: whether a GPU is usable, loading ``rowcache/kernels/<path>.cu`` into a
``cupy.RawModule`` once per (source, device), and array-type helpers. Does not own
any kernel: each kernel's launcher and NumPy reference live in its own module.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from rowcache.errors import GpuUnavailableError

_HERE = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True when cupy imports and a CUDA device is usable (never raises)."""
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def require_cupy(what: str) -> Any:
    """Return the cupy module, or raise GpuUnavailableError naming ``what``."""
    if not gpu_available():
        raise GpuUnavailableError(
            f"{what} needs a CUDA GPU with cupy, and none is usable here; "
            "install the 'gpu' extra on a machine with a CUDA driver, or use device='cpu'"
        )
    import cupy

    return cupy


def is_device_array(a: object) -> bool:
    """True for a cupy ndarray (without importing cupy where it is absent)."""
    mod = type(a).__module__
    return mod.startswith("cupy")


def array_module(a: object) -> Any:
    """numpy or cupy, whichever owns ``a``."""
    if is_device_array(a):
        import cupy

        return cupy
    return np


IEEE_OPTIONS = ("--ftz=false", "--prec-div=true", "--prec-sqrt=true")


@functools.cache
def _module(source_name: str, device_id: int, options: tuple[str, ...]) -> Any:
    import cupy

    with open(os.path.join(_HERE, source_name), encoding="utf-8") as f:
        code = f.read()
    # IEEE float semantics spelled out: the kernels are bit-exact against NumPy, which keeps
    # subnormals and divides exactly.
    return cupy.RawModule(code=code, options=("--std=c++17", *IEEE_OPTIONS, *options))


def get_kernel(source_name: str, kernel_name: str, options: tuple[str, ...] = ()) -> Any:
    """The compiled kernel ``kernel_name`` of ``kernels/<source_name>``.

    Compiled by NVRTC at first use and cached per (source, device, options).
    """
    cupy = require_cupy(f"kernel {kernel_name}")
    dev = cupy.cuda.runtime.getDevice()
    return _module(source_name, dev, tuple(options)).get_function(kernel_name)


def launch_1d(n: int, block: int = 256) -> tuple[tuple[int], tuple[int]]:
    """Grid and block for one thread per element of ``n`` (grid at least 1)."""
    return ((max(1, (n + block - 1) // block),), (block,))


class RawLaunch:
    """One kernel launched by ``cuLaunchKernel`` on arguments kept packed.

    cupy's ``RawKernel.__call__`` re-packs every argument on every launch (a CArray per
    ndarray, a boxed scalar per number): on the H200 machine 8.8 µs a launch of 11
    arguments, against 4.1 µs for this class (``docs/benchmarks.md``, "Figures the code
    cites"). A ``RawLaunch`` holds its arguments in one int64 buffer, every parameter 8 bytes
    (device pointers and ``long long`` only): a hot launcher writes the arguments that change
    into :attr:`values` and calls it. Not thread-safe: one caller at a time (the arguments are
    copied by the driver at the launch, so a later launch may change them freely).
    """

    def __init__(self, kernel: Any, params: int) -> None:
        import cupy

        self._launch = cupy.cuda.driver.launchKernel
        self._fn = kernel.kernel.ptr  # the CUfunction (compiled on first access)
        self.values = np.zeros(params, dtype=np.int64)
        base = self.values.ctypes.data
        self._ptrs = np.arange(base, base + 8 * params, 8, dtype=np.uint64)
        self._ptrs_at = self._ptrs.ctypes.data

    def pack(self, args: tuple) -> None:
        """Set every argument: ints (device addresses or scalars) in parameter order."""
        if len(args) != self.values.size:
            raise ValueError(f"{len(args)} arguments for a kernel of {self.values.size}")
        self.values[:] = [int(x) for x in args]

    def __call__(self, grid: tuple, block: tuple, stream_ptr: int) -> None:
        g = (*grid, 1, 1)
        b = (*block, 1, 1)
        self._launch(self._fn, g[0], g[1], g[2], b[0], b[1], b[2], 0, stream_ptr, self._ptrs_at, 0)
