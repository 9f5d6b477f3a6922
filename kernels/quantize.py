"""``quantize_fp8``: the store's FP8 rule, per-row absmax E4M3 codes and float32 scales.

Owns the launcher of ``quantize.cu``. NumPy input runs ``quantize_fp8_reference``
(the spec); cupy input runs the kernel, bit-identical codes and scales for finite
inputs. Dequantization is the FP8 gather (``kernels.batched_embed_fp8``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._cuda import get_kernel, is_device_array, require_cupy
from .errors import ConfigError
from .gather import check_array, check_rows_contiguous, describe
from .reference import BF16, quantize_fp8_reference

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

    ``scale = amax(|row|) / 448`` (1.0 for an all-zero row) and
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
