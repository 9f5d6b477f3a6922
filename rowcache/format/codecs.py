"""Row codecs: how a table's rows are encoded in the store's records and decoded by a gather.

Owns :class:`RowCodec` and the codecs of the store format, by name (the meta record's
``dtype``): ``bf16`` (rows verbatim), ``fp8`` (rowcache's per-row scale: E4M3 codes
quantized by the builder, the row's float32 scale after them in the record) and
``fp8_table_scale`` (E4M3 codes verbatim, ONE bf16 scale for the whole table, kept in the
table's meta ``params``). A codec says, for its encoding:

- ``record_bytes(dim)``: the bytes of one stored row;
- ``value_dtype``, ``arena_width(dim)`` and ``row_scales``: what an arena of its rows holds
  (``[slots, arena_width(dim)]`` of ``value_dtype``, and a float32 a slot where
  ``row_scales``), which is also what the store's scatter writes a record into;
- ``check_params(params, where)``: the table-level parameters of the meta record
  (``FormatError`` naming the field), and ``params_of(source params)`` for the builder;
- ``encode`` / ``decode``: records from encoded rows and back (``decode`` is what
  ``RowStore.read_rows`` returns);
- ``gather(ids, values, scales, params, out)``: bf16 rows from an arena or a resident
  table, through the codec's kernel triplet in ``rowcache.kernels``.

A new encoding is one more subclass registered in :data:`CODECS` (docs/store-format.md,
"Codecs", sketches the block-scaled one). No I/O here.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from rowcache.errors import ConfigError, FormatError
from rowcache.kernels.gather import (
    batched_embed,
    batched_embed_fp8,
    batched_embed_fp8_table_scale,
    check_bf16_scale,
)
from rowcache.kernels.reference import BF16

_U8 = np.dtype(np.uint8)


class RowCodec(ABC):
    """One encoding of a table's rows in the store (see the module docstring)."""

    name: ClassVar[str]
    value_dtype: ClassVar[np.dtype]  # the arena's (and a resident table's) element type
    row_scales: ClassVar[bool] = False  # a float32 per row beside the values (the arena's scales)
    from_values: ClassVar[bool] = True  # the builder encodes value rows (else: encoded sources)

    @abstractmethod
    def record_bytes(self, dim: int) -> int:
        """Bytes of one stored row of ``dim`` values."""

    def arena_width(self, dim: int) -> int:
        """Elements of ``value_dtype`` an arena slot holds for a row of ``dim`` values: ``dim``
        here; a codec whose rows keep their scales inline (block-scaled) holds its record."""
        return dim

    def value_bytes(self, dim: int) -> int:
        """Bytes of one row's values (no scales, no padding)."""
        return dim * self.value_dtype.itemsize

    def check_params(self, params: Any, where: str) -> dict[str, Any]:
        """A table's ``params`` from the meta record, checked (FormatError naming the field)."""
        if params != {}:
            raise FormatError(
                f"{where}: field 'params' is {params!r}; the {self.name} codec has none ({{}})"
            )
        return {}

    def encode(self, values: Any) -> np.ndarray:
        """Records ``uint8 [n, record_bytes]`` of rows already in this encoding
        (``value_dtype [n, dim]``): their bytes verbatim."""
        v = np.ascontiguousarray(values)
        return v.view(np.uint8).reshape(v.shape[0], -1)

    def decode(self, dim: int, records: np.ndarray) -> Any:
        """Inverse of :meth:`encode`: ``value_dtype [n, dim]`` (what ``read_rows`` returns)."""
        n = records.shape[0]
        raw = np.ascontiguousarray(records[:, : self.value_bytes(dim)])
        return raw.view(self.value_dtype).reshape(n, dim)

    @abstractmethod
    def gather(
        self, ids: Any, values: Any, scales: Any, params: dict[str, Any], out: Any = None
    ) -> Any:
        """bf16 ``[n, dim]`` rows ``ids`` of ``values`` (a table or an arena, numpy or cupy),
        with the per-row ``scales`` (None unless :attr:`row_scales`) and the table's
        ``params``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Bf16Codec(RowCodec):
    """``bf16``: ``dim`` bfloat16 values, little endian (``2 * dim`` bytes)."""

    name = "bf16"
    value_dtype = BF16

    def record_bytes(self, dim: int) -> int:
        return 2 * dim

    def gather(
        self, ids: Any, values: Any, scales: Any, params: dict[str, Any], out: Any = None
    ) -> Any:
        return batched_embed(ids, values, out)


class Fp8RowScaleCodec(RowCodec):
    """``fp8``: ``dim`` E4M3 codes, then the row's float32 scale (``dim + 4`` bytes);
    quantized by the builder (per row absmax, ``rowcache.kernels.reference``)."""

    name = "fp8"
    value_dtype = _U8
    row_scales = True

    def record_bytes(self, dim: int) -> int:
        return dim + 4

    def encode(self, values: Any) -> np.ndarray:
        """Records of ``(codes uint8[n, dim], scales float32[n])``."""
        codes, scales = values
        n, dim = codes.shape
        out = np.empty((n, dim + 4), dtype=np.uint8)
        out[:, :dim] = codes
        out[:, dim:] = np.ascontiguousarray(scales, dtype="<f4").view(np.uint8).reshape(n, 4)
        return out

    def decode(self, dim: int, records: np.ndarray) -> Any:
        """``(codes uint8[n, dim], scales float32[n])``."""
        n = records.shape[0]
        codes = np.ascontiguousarray(records[:, :dim])
        raw = np.ascontiguousarray(records[:, dim : dim + 4])
        return codes, raw.view("<f4").reshape(n).astype(np.float32)

    def gather(
        self, ids: Any, values: Any, scales: Any, params: dict[str, Any], out: Any = None
    ) -> Any:
        return batched_embed_fp8(ids, values, scales, out)


class Fp8TableScaleCodec(RowCodec):
    """``fp8_table_scale``: ``dim`` E4M3 codes verbatim (``dim`` bytes), ONE bf16 scale for
    the table in its meta ``params`` (``{"scale": value}``, a finite bfloat16 value written
    as a JSON number, exact). Rows decode as ``bf16_rn(bf16(code) * scale)``
    (``rowcache.kernels.batched_embed_fp8_table_scale``): Qwen3.8-Flash-Next's FP8 tables."""

    name = "fp8_table_scale"
    value_dtype = _U8
    from_values = False  # codes come verbatim (Fp8TableScaleSource), never quantized here

    def record_bytes(self, dim: int) -> int:
        return dim

    def check_params(self, params: Any, where: str) -> dict[str, Any]:
        if not isinstance(params, dict) or set(params) != {"scale"}:
            raise FormatError(
                f"{where}: field 'params' is {params!r}; the {self.name} codec keeps "
                '{"scale": the table\'s bf16 scale}'
            )
        v = params["scale"]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if ok:
            with np.errstate(over="ignore"):
                ok = float(np.float64(v).astype(BF16)) == float(v)
        if not ok:
            raise FormatError(
                f"{where}: field 'params.scale' is {v!r}; expected a finite bfloat16 value"
            )
        return {"scale": float(v)}

    @staticmethod
    def scale(params: dict[str, Any]) -> np.ndarray:
        """The table's scale as a 0-d bfloat16 array."""
        return np.asarray(params["scale"], dtype=np.float64).astype(BF16)

    def gather(
        self, ids: Any, values: Any, scales: Any, params: dict[str, Any], out: Any = None
    ) -> Any:
        return batched_embed_fp8_table_scale(ids, values, self.scale(params), out)


def table_scale_params(scale: Any, where: str) -> dict[str, Any]:
    """``{"scale": float}`` of a table-scaled codec from a user's ``scale``: one finite
    bfloat16 value (ConfigError naming ``where`` otherwise; never rounded)."""
    s = check_bf16_scale(where, scale)
    v = float(s.astype(np.float64))
    if not math.isfinite(v):
        raise ConfigError(
            f"{where}={v!r}: a table's scale must be finite (a NaN or Inf scale makes every "
            "row NaN or Inf)"
        )
    return {"scale": v}


CODECS: dict[str, RowCodec] = {
    c.name: c for c in (Bf16Codec(), Fp8RowScaleCodec(), Fp8TableScaleCodec())
}
"""Every codec of the store format, by name (the meta record's ``dtype``)."""


def get_codec(name: Any) -> RowCodec:
    """The codec named ``name``; ConfigError naming the allowed ones otherwise."""
    codec = CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise ConfigError(f"dtype={name!r} is not supported; allowed: {', '.join(CODECS)}")
    return codec


__all__ = [
    "CODECS",
    "Bf16Codec",
    "Fp8RowScaleCodec",
    "Fp8TableScaleCodec",
    "RowCodec",
    "get_codec",
    "table_scale_params",
]
