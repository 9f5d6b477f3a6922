"""cuBLAS GEMMs that can be captured in a CUDA graph.

Owns one call, :func:`gemm_ex` (``cublasGemmEx`` on cupy's handle and current
stream). Eagerly it goes through cupy's wrapper; while the stream captures it goes
through ctypes into the very libcublas cupy loaded, because cupy's wrappers refuse to
run during stream capture (cupy issue 6290) although cuBLAS GEMMs can be captured.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

from rowcache.errors import GpuUnavailableError

# cuBLAS's recommended workspace on Hopper is 32 MiB.
CAPTURE_WORKSPACE_BYTES = 32 << 20


@functools.cache
def _cublas_path() -> str:
    """The file of the libcublas cupy loaded (from /proc/self/maps)."""
    from cupy.cuda import device

    device.get_cublas_handle()  # cupy has loaded libcublas once it made its handle
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith(
                    "libcublas.so"
                ):
                    return parts[5].strip()
    except OSError:
        pass
    raise GpuUnavailableError(
        "a cuBLAS GEMM cannot be captured in a CUDA graph here: the libcublas that "
        "cupy loaded was not found in /proc/self/maps; run the step eagerly"
    )


@functools.cache
def _capture_api() -> tuple[Any, Any, Any]:
    """cublasSetStream_v2, cublasSetWorkspace_v2, cublasGemmEx of the libcublas cupy
    loaded (found in /proc/self/maps: a second copy would not know cupy's handle)."""
    lib = ctypes.CDLL(_cublas_path())
    vp, ci = ctypes.c_void_p, ctypes.c_int
    set_stream = lib.cublasSetStream_v2
    set_stream.argtypes, set_stream.restype = [vp, vp], ci
    set_workspace = lib.cublasSetWorkspace_v2
    set_workspace.argtypes, set_workspace.restype = [vp, vp, ctypes.c_size_t], ci
    gemm = lib.cublasGemmEx
    gemm.argtypes = [vp, ci, ci, ci, ci, ci, vp, vp, ci, ci, vp, ci, ci, vp, vp, ci, ci, ci, ci]
    gemm.restype = ci
    return set_stream, set_workspace, gemm


@functools.cache
def _strided_api() -> Any:
    """cublasGemmStridedBatchedEx of the libcublas cupy loaded."""
    lib = ctypes.CDLL(_cublas_path())
    vp, ci, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    fn = lib.cublasGemmStridedBatchedEx
    fn.argtypes = [vp, ci, ci, ci, ci, ci, vp, vp, ci, ci, ll, vp, ci, ci, ll, vp, vp, ci, ci, ll]
    fn.argtypes += [ci, ci, ci]
    fn.restype = ci
    return fn


@functools.cache
def capture_workspace(device_id: int) -> Any:
    """The cuBLAS workspace of captured GEMMs on ``device_id`` (lives as long as the
    process, so a graph's pointers into it stay valid; cuBLAS allocates nothing during
    capture)."""
    import cupy as cp

    return cp.empty(CAPTURE_WORKSPACE_BYTES, dtype=cp.uint8)


def is_capturing(cp: Any) -> bool:
    """True while cupy's current stream captures a graph."""
    stream = cp.cuda.get_current_stream()
    try:
        return bool(stream.is_capturing())
    except Exception:  # the legacy default stream cannot capture
        return False


def gemm_ex(cp: Any, *args: Any) -> None:
    """``cublasGemmEx(handle, *args)`` on cupy's handle and current stream; capturable.

    ``args`` are cublasGemmEx's arguments after the handle (transa, transb, m, n, k,
    alpha pointer, A, A type, lda, B, B type, ldb, beta pointer, C, C type, ldc,
    compute type, algo). The first call of a shape must run eagerly: it allocates the
    capture workspace and lets cuBLAS load its kernels outside any capture.
    """
    from cupy.cuda import cublas, device

    if not is_capturing(cp):
        capture_workspace(cp.cuda.runtime.getDevice())  # allocated outside any capture
        cublas.gemmEx(device.get_cublas_handle(), *args)
        return
    _call(cp, "cublasGemmEx", _capture_api()[2], args)


def gemm_strided_batched_ex(cp: Any, *args: Any) -> None:
    """``cublasGemmStridedBatchedEx(handle, *args)`` on cupy's handle and current stream,
    through ctypes (eagerly and under capture: cupy has no wrapper for it); arguments
    after the handle as cuBLAS documents them."""
    _call(cp, "cublasGemmStridedBatchedEx", _strided_api(), args)


def _call(cp: Any, what: str, fn: Any, args: tuple[Any, ...]) -> None:
    """``fn(handle, *args)`` through ctypes on cupy's handle, bound to the current stream
    and the capture workspace first (cupy's own wrappers rebind the stream per call)."""
    from cupy.cuda import device

    handle = device.get_cublas_handle()
    ws = capture_workspace(cp.cuda.runtime.getDevice())
    set_stream, set_workspace, _ = _capture_api()
    for name, status in (
        ("cublasSetStream", set_stream(handle, cp.cuda.get_current_stream().ptr)),
        ("cublasSetWorkspace", set_workspace(handle, ws.data.ptr, ws.nbytes)),
        (what, fn(handle, *args)),
    ):
        if status != 0:
            raise RuntimeError(f"{name} failed (cublasStatus {status})")
