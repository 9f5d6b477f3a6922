"""Shared plumbing of the GPU kernels: cupy detection and cached NVRTC modules.

Owns: whether a GPU is usable, loading ``kernels/<name>.cu`` into a
``cupy.RawModule`` once per (source, device), and array-type helpers. Does not own
any kernel: each kernel's launcher and NumPy reference live in its own module.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from .errors import GpuUnavailableError

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
