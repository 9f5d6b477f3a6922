"""``quantize_fp8``: the store's FP8 rule, per-row absmax E4M3 codes and float32 scales.

Owns the launcher of ``quantize.cu``. NumPy input runs ``quantize_fp8_reference``
(the spec); cupy input runs the kernel, bit-identical codes and scales for finite
inputs. Dequantization is the FP8 gather (``rowcache.kernels.batched_embed_fp8``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels import extensions
from rowcache.kernels.gather import check_array, check_rows_contiguous, describe
from rowcache.kernels.loader import get_kernel, is_device_array, require_cupy
from rowcache.kernels.reference import BF16, quantize_fp8_reference

_SOURCE = "quantize.cu"
_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)
_KERNELS = {BF16: "quantize_bf16_to_fp8", _F32: "quantize_f32_to_fp8"}


def _check_outputs(x: Any, codes: Any, scales: Any) -> None:
    n, d = int(x.shape[0]), int(x.shape[1])
    for name, a, shape, dtype in (
        ("codes", codes, (n, d), _U8),
        ("scales", scales, (n,), _F32),
    ):
        if a is None:
            continue
        check_array(name, a, ndim=len(shape), dtypes=(dtype,))
        if tuple(a.shape) != shape:
            raise ConfigError(
                f"{name} must have shape {list(shape)} for x {describe(x)}, got {describe(a)}"
            )
        if is_device_array(a) != is_device_array(x):
            raise ConfigError(f"{name} must live where x does ({describe(x)}), got {describe(a)}")


def quantize_fp8(x: Any, *, codes: Any = None, scales: Any = None) -> tuple[Any, Any]:
    """Per-row absmax E4M3 quantization, the rule of ``quantize_fp8_reference``.

    ``scale = amax(|row|) / 448`` (1.0 where that is 0: an all-zero row, or one so small
    that the division underflows, ``amax <= 448 * 2**-150``, stored as signed zeros) and
    ``code = satfinite_e4m3(value / scale)``, both divisions in float32.

    Parameters
    ----------
    x : bfloat16[n, d] or float32[n, d], numpy or cupy
        Rows to quantize; finite values (NaN and inf are outside the bit-exact contract).
    codes : uint8[n, d], optional, keyword-only
        Output buffer for the codes (same library as ``x``); allocated when None.
    scales : float32[n], optional, keyword-only
        Output buffer for the scales (contiguous on the GPU); allocated when None.

    Returns
    -------
    codes : uint8[n, d]
        E4M3 codes as raw bytes (cupy has no float8 dtype).
    scales : float32[n]
    """
    check_array("x", x, ndim=2, dtypes=(BF16, _F32))
    _check_outputs(x, codes, scales)
    if not is_device_array(x):
        ref_codes, ref_scales = quantize_fp8_reference(x)
        if codes is None:
            codes = ref_codes
        else:
            codes[...] = ref_codes
        if scales is None:
            scales = ref_scales
        else:
            scales[...] = ref_scales
        return codes, scales

    cupy = require_cupy("quantize_fp8")
    check_rows_contiguous("x", x)
    n, d = int(x.shape[0]), int(x.shape[1])
    if codes is None:
        codes = cupy.empty((n, d), dtype=_U8)
    else:
        check_rows_contiguous("codes", codes)
    if scales is None:
        scales = cupy.empty((n,), dtype=_F32)
    elif n > 1 and scales.strides[0] != 4:
        raise ConfigError(
            f"scales must be contiguous on the GPU, got strides {tuple(scales.strides)}"
        )
    if n == 0:
        return codes, scales
    threads = min(256, max(32, -(-d // 32) * 32))
    blocks = min(n, 65535)
    kernel = get_kernel(_SOURCE, _KERNELS[x.dtype])
    kernel(
        (blocks,),
        (threads,),
        (
            x,
            codes,
            scales,
            np.int64(n),
            np.int64(d),
            np.int64(x.strides[0] // x.itemsize),
            np.int64(codes.strides[0]),
        ),
    )
    return codes, scales


# --- the builder's FP8 path: records straight into shard pages --------------------------

# built by `pip install -e .` (setup.py); without it the reference runs (and warns once)
_native: Any = extensions.load("rowcache.kernels._quantize")

# A row whose scale is at least 2**-115 quantizes the same whether or not the GPU flushes
# subnormal float32 operands and results: the scale is normal, and a subnormal value x
# gives |x / scale| < 2**-11, a zero code either way (flushes keep the sign). Rows with
# a smaller nonzero amax (below 448 * 2**-115) are redone on the CPU by the reference.
_EXACT_AMAX_BITS = np.uint32(((127 - 107) << 23) | 0x600000)  # float32 bits of 448 * 2**-115
_INF_BITS = np.uint32(0x7F800000)


def _page_view(pages: Any, rows: int, rows_per_page: int, page_bytes: int, dim: int) -> Any:
    """``[page, slot, record]`` view of the first ``ceil(rows / rows_per_page)`` pages."""
    n_pages = -(-rows // rows_per_page)
    flat = pages.reshape(-1)[: n_pages * page_bytes]
    return flat.reshape(n_pages, page_bytes)[:, : rows_per_page * (dim + 4)].reshape(
        n_pages, rows_per_page, dim + 4
    )


def place_records(
    pages: Any, first: int, codes: Any, scales: Any, *, rows_per_page: int, page_bytes: int
) -> None:
    """Write FP8 records ``(codes[i], scales[i])`` as records ``first + i`` of ``pages``."""
    n, dim = codes.shape
    if n == 0:
        return
    r = np.arange(first, first + n)
    view = _page_view(pages, first + n, rows_per_page, page_bytes, dim)
    page, slot = r // rows_per_page, r % rows_per_page
    view[page, slot, :dim] = codes
    view[page, slot, dim:] = np.ascontiguousarray(scales, dtype="<f4").view(np.uint8).reshape(n, 4)


def _check_pages(x: Any, pages: Any, first: int, rows_per_page: int, page_bytes: int) -> None:
    check_array("x", x, ndim=2, dtypes=(BF16, _F32))
    rec = int(x.shape[1]) + 4
    if not isinstance(rows_per_page, int) or rows_per_page < 1 or rows_per_page * rec > page_bytes:
        raise ConfigError(
            f"rows_per_page={rows_per_page!r} records of {rec} bytes must fit a page of "
            f"page_bytes={page_bytes!r}"
        )
    if not isinstance(first, (int, np.integer)) or first < 0:
        raise ConfigError(f"first={first!r} must be a record index >= 0")
    last = int(first) + int(x.shape[0])
    need = -(-last // rows_per_page) * page_bytes
    if pages.dtype != _U8 or pages.size < need:
        raise ConfigError(
            f"pages must be uint8 with at least {need} bytes for records {first}..{last - 1}, "
            f"got {describe(pages)}"
        )


def quantize_fp8_pages(
    x: np.ndarray,
    pages: np.ndarray,
    *,
    rows_per_page: int,
    page_bytes: int,
    first: int = 0,
    pool: Any = None,
    block_rows: int = 16384,
) -> int:
    """FP8 records of host rows ``x``, written as records ``first..`` of shard pages.

    The rule of ``quantize_fp8_reference``, bit for bit: native C (``rowcache.kernels._quantize``,
    the GIL released) over blocks of ``block_rows`` rows, run by ``pool`` (a
    ``concurrent.futures`` executor) when given; the reference where the native module
    is not built. Page tails are left as they are (the caller zeroes them).

    Parameters
    ----------
    x : bfloat16[n, d] or float32[n, d], numpy, C-contiguous rows (a memory map is fine)
    pages : uint8 numpy buffer of at least ``ceil((first + n) / rows_per_page)`` pages
    rows_per_page, page_bytes : the store's page packing (``rowcache.format.layout.page_packing``)
    first : the record of ``pages`` that ``x[0]`` becomes

    Returns
    -------
    int
        How many rows hold a NaN or an Inf; with the native module their records are not
        written (quantize such a block with the reference instead).
    """
    _check_pages(x, pages, first, rows_per_page, page_bytes)
    n, dim = int(x.shape[0]), int(x.shape[1])
    if _native is None or not x.flags.c_contiguous:
        if _native is None:
            extensions.fallback("rowcache.kernels._quantize")
        codes, scales = quantize_fp8_reference(x)
        place_records(
            pages, first, codes, scales, rows_per_page=rows_per_page, page_bytes=page_bytes
        )
        return int(np.count_nonzero(~np.isfinite(scales)))
    bits = x.view(np.uint16 if x.dtype == BF16 else np.uint32)
    flat = pages.reshape(-1)

    def run(lo: int) -> int:
        hi = min(n, lo + block_rows)
        return int(
            _native.quantize_pages(
                bits[lo:hi], x.itemsize, hi - lo, dim, flat, first + lo, rows_per_page, page_bytes
            )
        )

    starts = range(0, n, block_rows)
    if pool is None or n <= block_rows:
        return sum(run(lo) for lo in starts)
    return sum(pool.map(run, starts))


def quantize_fp8_pages_device(
    x: np.ndarray, pages: np.ndarray, *, rows_per_page: int, page_bytes: int
) -> int:
    """:func:`quantize_fp8_pages` (``first=0``) by the GPU kernel, the same bits.

    ``x`` goes to the device in one copy; the kernel writes each row's codes at its
    place in a device copy of the pages (one launch per slot of a page, rows strided by
    ``rows_per_page``), the scales beside them, and the pages come back in one copy.
    Rows whose amax is below ``448 * 2**-115`` (where the GPU's flush of subnormal
    float32 values could change a code) are redone by the reference on the host.

    Returns
    -------
    int
        How many rows hold a NaN or an Inf; then nothing is written (use the reference).
    """
    _check_pages(x, pages, 0, rows_per_page, page_bytes)
    cupy = require_cupy("quantize_fp8_pages_device")
    n, dim = int(x.shape[0]), int(x.shape[1])
    if n == 0:
        return 0
    xd = cupy.asarray(np.ascontiguousarray(x))
    if x.dtype == BF16:  # integer |x| maxima: exact, no float flush can touch them
        amax_bits = (xd.view(cupy.uint16) & 0x7FFF).max(axis=1).astype(cupy.uint32) << 16
    else:
        amax_bits = (xd.view(cupy.uint32) & 0x7FFFFFFF).max(axis=1)
    bad = int((amax_bits >= _INF_BITS).sum())
    if bad:
        return bad
    rec = dim + 4
    n_pages = -(-n // rows_per_page)
    pd = cupy.zeros((n_pages, page_bytes), dtype=_U8)
    for j in range(min(rows_per_page, n)):
        xj = xd[j::rows_per_page]
        nj = int(xj.shape[0])
        _, sj = quantize_fp8(xj, codes=pd[:nj, j * rec : j * rec + dim])
        pd[:nj, j * rec + dim : (j + 1) * rec] = sj.view(cupy.uint8).reshape(nj, 4)
    pd.get(out=pages.reshape(-1)[: n_pages * page_bytes].reshape(n_pages, page_bytes))
    redo = np.flatnonzero(((amax_bits != 0) & (amax_bits < _EXACT_AMAX_BITS)).get())
    if redo.size:
        codes, scales = quantize_fp8_reference(np.asarray(x)[redo])
        view = _page_view(pages, n, rows_per_page, page_bytes, dim)
        page, slot = redo // rows_per_page, redo % rows_per_page
        view[page, slot, :dim] = codes
        view[page, slot, dim:] = scales.astype("<f4").view(np.uint8).reshape(-1, 4)
    return 0
