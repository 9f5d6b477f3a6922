"""Row gathers: ``batched_embed`` (bf16 rows), ``batched_embed_fp8`` (E4M3 rows x their
row's scale), ``batched_embed_fp8_table_scale`` (E4M3 rows x one bf16 scale a table) and
``batched_embed_fp8_block`` (E4M3 rows x one UE8M0 power of two a block of values).

Owns the launchers of ``gather.cu`` and the argument checks shared with the scatter
launcher. NumPy arrays run the references of ``kernels/reference.py`` (the spec);
cupy arrays run the CUDA kernels, whose results are bit-identical to them.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels.loader import get_kernel, is_device_array, require_cupy
from rowcache.kernels.reference import (
    BF16,
    batched_embed_fp8_block_reference,
    batched_embed_fp8_reference,
    batched_embed_fp8_table_scale_reference,
    batched_embed_reference,
)

_SOURCE = "gather.cu"
_BLOCK_THREADS = 256
_ID_SUFFIX = {np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}


# --- argument checks (shared with kernels/scatter.py) -----------------------------


def describe(a: object) -> str:
    """``dtype[shape] (numpy|cupy)`` of an array, or its type name."""
    if hasattr(a, "dtype") and hasattr(a, "shape"):
        kind = "cupy" if is_device_array(a) else "numpy"
        return f"{a.dtype}{list(a.shape)} ({kind})"
    return type(a).__name__


def check_array(name: str, a: object, *, ndim: int, dtypes: tuple[np.dtype, ...]) -> None:
    """ConfigError naming ``name`` unless ``a`` is a numpy/cupy array of ``ndim`` and a dtype in ``dtypes``."""
    if not (isinstance(a, np.ndarray) or is_device_array(a)):
        allowed = " or ".join(str(d) for d in dtypes)
        raise ConfigError(
            f"{name} must be a numpy or cupy array of {ndim} dimension(s) and dtype {allowed}, "
            f"got {describe(a)}"
        )
    arr: Any = a
    if arr.ndim != ndim or arr.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)  # built only on failure: hot path
        raise ConfigError(f"{name} must be {ndim}-D with dtype {allowed}, got {describe(a)}")


def check_index(name: str, a: object) -> None:
    """ConfigError naming ``name`` unless ``a`` is a 1-D integer numpy/cupy array."""
    if not (isinstance(a, np.ndarray) or is_device_array(a)):
        raise ConfigError(f"{name} must be a 1-D integer numpy or cupy array, got {describe(a)}")
    arr: Any = a
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ConfigError(f"{name} must be a 1-D integer array (int32 or int64), got {describe(a)}")


def check_rows_contiguous(name: str, a: Any) -> None:
    """ConfigError unless the last axis of 2-D device array ``a`` is contiguous (rows may be strided)."""
    if a.size and a.shape[1] > 1 and a.strides[1] != a.itemsize:  # empty arrays have strides 0
        raise ConfigError(
            f"{name} must have contiguous rows (strides[1] == itemsize {a.itemsize}), "
            f"got strides {tuple(a.strides)}; pass cupy.ascontiguousarray({name})"
        )


def device_index(cupy: Any, idx: Any) -> Any:
    """``idx`` as a contiguous int32/int64 cupy array (numpy input is copied to the device)."""
    if idx.dtype not in _ID_SUFFIX:
        idx = idx.astype(np.int64)
    if is_device_array(idx):
        return cupy.ascontiguousarray(idx)
    return cupy.asarray(np.ascontiguousarray(idx))


def host_index(idx: Any) -> np.ndarray:
    """``idx`` as a numpy array (cupy input is copied to the host)."""
    return idx.get() if is_device_array(idx) else np.asarray(idx)


def vector_bytes(*quantities: int, widths: tuple[int, ...] = (16, 8, 4, 2)) -> int:
    """The widest of ``widths`` dividing every quantity (byte counts, strides, pointers)."""
    for w in widths:
        if all(q % w == 0 for q in quantities):
            return w
    return widths[-1]


@functools.cache
def _max_blocks(device_id: int) -> int:
    import cupy

    sms = cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]
    return int(sms) * 32


def row_launch(cupy: Any, n: int, words: int) -> tuple[tuple[int], tuple[int, int]]:
    """Grid and (TX, TY) block for teams of TX threads per row, TY rows per block.

    TX is the smallest power of two covering a row's words (at most 256), so small
    rows put several rows in one block; the grid is capped and the kernels stride.
    """
    tx = 1
    while tx < words and tx < _BLOCK_THREADS:
        tx *= 2
    ty = _BLOCK_THREADS // tx
    blocks = min(-(-n // ty), _max_blocks(cupy.cuda.runtime.getDevice()))
    return (max(1, blocks),), (tx, ty)


def _device_prologue(
    what: str, name: str, table: Any, ids: Any, out: Any, n: int, d: int
) -> tuple[Any, Any, Any]:
    """The GPU gathers' shared checks: ``(cupy, out, device ids)``; the ids are None
    when there is nothing to gather (``out`` is then the result)."""
    cupy = require_cupy(what)
    check_rows_contiguous(name, table)
    if out is None:
        out = cupy.empty((n, d), dtype=BF16)
    else:
        check_rows_contiguous("out", out)
    if n == 0 or d == 0:
        return cupy, out, None
    _check_nonempty(name, table, n)
    return cupy, out, device_index(cupy, ids)


def _check_out(out: Any, table: Any, n: int, d: int) -> None:
    if out is None:
        return
    check_array("out", out, ndim=2, dtypes=(BF16,))
    if is_device_array(out) != is_device_array(table):
        raise ConfigError(
            f"out must live where the table does ({describe(table)}), got {describe(out)}"
        )
    if tuple(out.shape) != (n, d):
        raise ConfigError(f"out must have shape [{n}, {d}] (ids x dim), got {describe(out)}")


def _check_nonempty(name: str, table: Any, n: int) -> None:
    # The one range check that costs no device sync: no id is valid in an empty table.
    if table.shape[0] == 0:
        raise IndexError(f"{n} ids were given but {name} has 0 rows")


# --- bf16 gather ---------------------------------------------------------------------


def batched_embed(ids: Any, table: Any, out: Any = None) -> Any:
    """Gather rows of a bf16 table: ``out[i] = table[ids[i]]``.

    Parameters
    ----------
    ids : int32[n] or int64[n], numpy or cupy
        Row ids. With a cupy table, numpy ids are copied to the device, and ids are
        NOT range-checked (that would cost a device sync per call): every id must lie
        in ``[0, rows)``, or the kernel reads out of bounds. The CPU path raises
        IndexError for an id out of range.
    table : bfloat16[rows, d], numpy or cupy
        The table or the cache arena. A cupy table may wrap pinned host memory
        mapped into the device (``UnownedMemory`` + ``MemoryPointer``). Rows must be
        contiguous; the row stride may be anything.
    out : bfloat16[n, d], optional
        Written in place and returned; allocated when None. Same library as ``table``.

    Returns
    -------
    bfloat16[n, d]
        numpy (reference) for a numpy table, cupy (``gather.cu``) for a cupy table.
    """
    check_index("ids", ids)
    check_array("table", table, ndim=2, dtypes=(BF16,))
    n, d = int(ids.shape[0]), int(table.shape[1])
    _check_out(out, table, n, d)
    if not is_device_array(table):
        return batched_embed_reference(host_index(ids), table, out)

    cupy, out, dev_ids = _device_prologue("batched_embed", "table", table, ids, out, n, d)
    if dev_ids is None:
        return out
    row_bytes = 2 * d
    vec = vector_bytes(row_bytes, table.strides[0], out.strides[0], table.data.ptr, out.data.ptr)
    words = row_bytes // vec
    kernel = get_kernel(_SOURCE, f"gather_rows_{vec}_{_ID_SUFFIX[dev_ids.dtype]}")
    grid, block = row_launch(cupy, n, words)
    kernel(
        grid,
        block,
        (
            table,
            dev_ids,
            out,
            np.int64(n),
            np.int64(words),
            np.int64(table.strides[0] // vec),
            np.int64(out.strides[0] // vec),
        ),
    )
    return out


# --- FP8 gather ----------------------------------------------------------------------


def _code_word(codes: Any, out: Any, *sizes: int) -> int:
    """VEC, the E4M3 codes an FP8 kernel reads as one word: a width of 8, 4, 2 or 1 that
    divides ``sizes`` (the row's codes, a scale block's), the codes' row stride and
    address, and the bf16 output's in elements (VEC bf16 are stored as one word)."""
    return vector_bytes(
        *sizes,
        codes.strides[0],
        codes.data.ptr,
        out.strides[0] // 2,
        out.data.ptr // 2,
        widths=(8, 4, 2, 1),
    )


def batched_embed_fp8(ids: Any, codes: Any, scales: Any, out: Any = None) -> Any:
    """Gather and dequantize FP8 rows: ``out[i] = bf16(e4m3(codes[ids[i]]) * scales[ids[i]])``.

    The product is one float32 multiply rounded to bfloat16 (nearest even), bit for
    bit the rule of ``batched_embed_fp8_reference`` for every non-NaN code.

    Parameters
    ----------
    ids : int32[n] or int64[n], numpy or cupy
        Row ids; as in :func:`batched_embed`, not range-checked on the GPU.
    codes : uint8[rows, d], numpy or cupy
        E4M3 codes as raw bytes (cupy has no float8 dtype). Rows must be contiguous.
    scales : float32[rows], same library as ``codes``
        Per-row scale.
    out : bfloat16[n, d], optional
        Written in place and returned; allocated when None.

    Returns
    -------
    bfloat16[n, d]
    """
    check_index("ids", ids)
    check_array("codes", codes, ndim=2, dtypes=(np.dtype(np.uint8),))
    check_array("scales", scales, ndim=1, dtypes=(np.dtype(np.float32),))
    if is_device_array(scales) != is_device_array(codes):
        raise ConfigError(
            f"scales must live where codes do ({describe(codes)}), got {describe(scales)}"
        )
    if scales.shape[0] != codes.shape[0]:
        raise ConfigError(
            f"scales must have one entry per row of codes ({codes.shape[0]}), "
            f"got {describe(scales)}"
        )
    n, d = int(ids.shape[0]), int(codes.shape[1])
    _check_out(out, codes, n, d)
    if not is_device_array(codes):
        return batched_embed_fp8_reference(host_index(ids), codes, scales, out)

    cupy, out, dev_ids = _device_prologue("batched_embed_fp8", "codes", codes, ids, out, n, d)
    if dev_ids is None:
        return out
    vec = _code_word(codes, out, d)
    kernel = get_kernel(_SOURCE, f"gather_rows_fp8_{vec}_{_ID_SUFFIX[dev_ids.dtype]}")
    grid, block = row_launch(cupy, n, d // vec)
    kernel(
        grid,
        block,
        (
            codes,
            scales,
            dev_ids,
            out,
            np.int64(n),
            np.int64(d),
            np.int64(codes.strides[0]),
            np.int64(scales.strides[0] // 4),
            np.int64(out.strides[0] // 2),
        ),
    )
    return out


# --- FP8 gather, one scale a table -------------------------------------------------------


def check_bf16_scale(name: str, scale: Any) -> np.ndarray:
    """``scale`` as a 0-d bfloat16 array, or ConfigError naming ``name``: a bfloat16 scalar
    or one-value array, or a float (or float32/float16 value) that is exactly a bfloat16
    value. Never rounded: a table's scale is applied as it is, bit for bit."""
    if is_device_array(scale):
        scale = scale.get()
    arr = np.asarray(scale)
    if arr.size != 1 or (arr.dtype.kind not in "fiu" and arr.dtype != BF16) or arr.dtype == bool:
        raise ConfigError(
            f"{name} must be one bfloat16 value (a scalar, or an array of one value), "
            f"got {describe(arr)}"
        )
    arr = arr.reshape(())
    bf = arr.astype(BF16)
    if arr.dtype != BF16:
        wide, back = float(arr.astype(np.float64)), float(bf.astype(np.float64))
        if back != wide and not (np.isnan(wide) and np.isnan(back)):
            raise ConfigError(
                f"{name}={wide!r} is not a bfloat16 value (nearest: {back!r}); give the "
                "table's bf16 scale as it is (e.g. ml_dtypes.bfloat16), never a rounded one"
            )
    return bf


def batched_embed_fp8_table_scale(ids: Any, codes: Any, scale: Any, out: Any = None) -> Any:
    """Gather E4M3 rows with one bf16 scale for the table:
    ``out[i] = bf16_rn(bf16(e4m3(codes[ids[i]])) * scale)``.

    The rule of the ``fp8_table_scale`` codec (``rowcache.format.codecs``): the exact
    product rounded once to bfloat16, nearest even, subnormals kept; a NaN (a NaN code
    0x7F/0xFF, a NaN scale, or zero times an infinite scale) is written as ``0x7FC0``.
    Bit for bit :func:`rowcache.kernels.reference.batched_embed_fp8_table_scale_reference`
    on the CPU and the GPU (``gather.cu``: ``gather_rows_fp8ts_*``).

    Parameters
    ----------
    ids : int32[n] or int64[n], numpy or cupy
        Row ids; as in :func:`batched_embed`, not range-checked on the GPU.
    codes : uint8[rows, d], numpy or cupy
        E4M3 codes as raw bytes (a table, or a cache's arena). Rows must be contiguous.
    scale : one bfloat16 value (:func:`check_bf16_scale`).
    out : bfloat16[n, d], optional
        Written in place and returned; allocated when None.

    Returns
    -------
    bfloat16[n, d]
    """
    check_index("ids", ids)
    check_array("codes", codes, ndim=2, dtypes=(np.dtype(np.uint8),))
    s = check_bf16_scale("scale", scale)
    n, d = int(ids.shape[0]), int(codes.shape[1])
    _check_out(out, codes, n, d)
    if not is_device_array(codes):
        return batched_embed_fp8_table_scale_reference(host_index(ids), codes, s, out)

    cupy, out, dev_ids = _device_prologue(
        "batched_embed_fp8_table_scale", "codes", codes, ids, out, n, d
    )
    if dev_ids is None:
        return out
    vec = _code_word(codes, out, d)
    kernel = get_kernel(_SOURCE, f"gather_rows_fp8ts_{vec}_{_ID_SUFFIX[dev_ids.dtype]}")
    grid, block = row_launch(cupy, n, d // vec)
    kernel(
        grid,
        block,
        (
            codes,
            np.uint32(int(s.view(np.uint16))),
            dev_ids,
            out,
            np.int64(n),
            np.int64(d),
            np.int64(codes.strides[0]),
            np.int64(out.strides[0] // 2),
        ),
    )
    return out


# --- FP8 gather, one UE8M0 scale byte a block ------------------------------------------------


def batched_embed_fp8_block(ids: Any, codes: Any, scales: Any, out: Any = None) -> Any:
    """Gather E4M3 rows with one UE8M0 scale byte a block of values:
    ``out[i, j] = bf16_rn(e4m3(codes[ids[i], j]) * 2**(scales[ids[i], j // B] - 127))``,
    ``B = d // scales.shape[1]``.

    The rule of the ``fp8_block_e8m0`` codec (``rowcache.format.codecs``; DeepSeek-V4.1's
    Engram tables): the exact product rounded once to bfloat16, nearest even, subnormals
    kept; a scale byte 0 is ``2**-127``, 255 is NaN (OCP MX), and every NaN is written as
    ``0x7FC0``. Bit for bit
    :func:`rowcache.kernels.reference.batched_embed_fp8_block_reference` on the CPU and the
    GPU (``gather.cu``: ``gather_rows_fp8blk_*``).

    Parameters
    ----------
    ids : int32[n] or int64[n], numpy or cupy
        Row ids; as in :func:`batched_embed`, not range-checked on the GPU.
    codes : uint8[rows, d], numpy or cupy
        E4M3 codes as raw bytes. Rows must be contiguous; the row stride may be anything (a
        cache's arena of whole records passes ``arena[:, :d]``).
    scales : uint8[rows, nb], same library as ``codes``
        UE8M0 bytes, ``nb`` dividing ``d`` (``arena[:, d:]`` of an arena of records).
    out : bfloat16[n, d], optional
        Written in place and returned; allocated when None.

    Returns
    -------
    bfloat16[n, d]
    """
    check_index("ids", ids)
    u8 = (np.dtype(np.uint8),)
    check_array("codes", codes, ndim=2, dtypes=u8)
    check_array("scales", scales, ndim=2, dtypes=u8)
    if is_device_array(scales) != is_device_array(codes):
        raise ConfigError(
            f"scales must live where codes do ({describe(codes)}), got {describe(scales)}"
        )
    n, d, nb = int(ids.shape[0]), int(codes.shape[1]), int(scales.shape[1])
    if scales.shape[0] != codes.shape[0] or not 1 <= nb <= d or d % nb:
        raise ConfigError(
            f"scales must be [{codes.shape[0]}, d / block]: one UE8M0 byte a block of each row "
            f"of codes ({describe(codes)}), a number of blocks dividing {d}; got {describe(scales)}"
        )
    _check_out(out, codes, n, d)
    if not is_device_array(codes):
        return batched_embed_fp8_block_reference(host_index(ids), codes, scales, out)

    cupy, out, dev_ids = _device_prologue("batched_embed_fp8_block", "codes", codes, ids, out, n, d)
    if dev_ids is None:
        return out
    check_rows_contiguous("scales", scales)
    block = d // nb
    # VEC codes per word, as batched_embed_fp8; VEC also divides the block, so the codes of
    # one word share one scale byte
    vec = _code_word(codes, out, d, block)
    kernel = get_kernel(_SOURCE, f"gather_rows_fp8blk_{vec}_{_ID_SUFFIX[dev_ids.dtype]}")
    grid, block_shape = row_launch(cupy, n, d // vec)
    kernel(
        grid,
        block_shape,
        (
            codes,
            scales,
            dev_ids,
            out,
            np.int64(n),
            np.int64(d),
            np.int64(block // vec),
            np.int64(codes.strides[0]),
            np.int64(scales.strides[0]),
            np.int64(out.strides[0] // 2),
        ),
    )
    return out
