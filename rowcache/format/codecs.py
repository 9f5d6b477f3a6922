"""Row codecs: how a table's rows are encoded in the store's records and decoded by a gather.

Owns :class:`RowCodec` and the codecs of the store format, by name (the meta record's
``dtype``): ``bf16`` (rows verbatim), ``fp8`` (rowcache's per-row scale: E4M3 codes
quantized by the builder, the row's float32 scale after them in the record),
``fp8_table_scale`` (E4M3 codes verbatim, ONE bf16 scale for the whole table, kept in the
table's meta ``params``) and ``fp8_block_e8m0`` (E4M3 codes and one UE8M0 scale byte a
block of values, both verbatim, the row's scale bytes after its codes in the record:
DeepSeek-V4.1's Engram tables). A codec says, for its encoding:

- ``record_bytes(dim, params)``: the bytes of one stored row;
- ``value_dtype``, ``arena_width(dim, params)`` and ``row_scales``: what an arena of its rows
  holds (``[slots, arena_width]`` of ``value_dtype``, and a float32 a slot where
  ``row_scales``), which is also what the store's scatter writes a record into;
- ``check_params(params, where, dim)``: the table-level parameters of the meta record
  (``FormatError`` naming the field);
- ``check_encoded(block, dim, params, name, first_row)``: rows given encoded that would
  decode to NaN (``ConfigError`` naming table, row and column; the builder asks unless
  ``allow_nonfinite``);
- ``encode`` / ``decode``: records from encoded rows and back (``decode`` is what
  ``RowStore.read_rows`` returns);
- ``gather(ids, values, scales, params, out)``: bf16 rows from an arena or a resident
  table, through the codec's kernel triplet in ``rowcache.kernels``.

A new encoding is one more subclass registered in :data:`CODECS`. No I/O here.
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
    batched_embed_fp8_block,
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
    def record_bytes(self, dim: int, params: dict[str, Any] | None = None) -> int:
        """Bytes of one stored row of ``dim`` values (of a table of ``params``)."""

    def arena_width(self, dim: int, params: dict[str, Any] | None = None) -> int:
        """Elements of ``value_dtype`` an arena slot holds for a row of ``dim`` values: ``dim``
        here; a codec whose rows keep their scales inline (block-scaled) holds its record."""
        return dim

    def value_bytes(self, dim: int) -> int:
        """Bytes of one row's values (no scales, no padding)."""
        return dim * self.value_dtype.itemsize

    def check_params(self, params: Any, where: str, dim: int | None = None) -> dict[str, Any]:
        """A table's ``params`` from the meta record, checked (FormatError naming the field),
        for rows of ``dim`` values where given."""
        if params != {}:
            raise FormatError(
                f"{where}: field 'params' is {params!r}; the {self.name} codec has none ({{}})"
            )
        return {}

    def check_encoded(
        self, block: np.ndarray, dim: int, params: dict[str, Any], name: str, first_row: int
    ) -> None:
        """Refuse rows given encoded (``block``: what the source's ``read`` gives, rows
        ``first_row..``) that would decode to NaN: ConfigError naming table ``name``, the row
        and the column. Here: E4M3 NaN codes (the codecs that take codes verbatim)."""
        refuse_nan_codes(block, name, first_row)

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

    def record_bytes(self, dim: int, params: dict[str, Any] | None = None) -> int:
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

    def record_bytes(self, dim: int, params: dict[str, Any] | None = None) -> int:
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

    def record_bytes(self, dim: int, params: dict[str, Any] | None = None) -> int:
        return dim

    def check_params(self, params: Any, where: str, dim: int | None = None) -> dict[str, Any]:
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


class Fp8BlockE8M0Codec(RowCodec):
    """``fp8_block_e8m0``: ``dim`` E4M3 codes, then ``dim / B`` UE8M0 scale bytes, one a block
    of ``B`` values (``dim + dim / B`` bytes: 264 for DeepSeek-V4.1's 256 values in blocks of
    32), both verbatim as the checkpoint gives them (``Fp8BlockScaleSource``); ``B`` is the
    table's meta ``params`` (``{"block_size": B}``). Value ``j`` of a row decodes as
    ``bf16_rn(e4m3(code_j) * 2**(e_{j // B} - 127))``
    (``rowcache.kernels.batched_embed_fp8_block``): a scale byte 0 is ``2**-127``, 255 NaN.

    An arena of such rows holds whole records (uint8 ``[slots, dim + dim / B]``): a fault
    copies a record verbatim, and the gather reads a block's byte beside its codes. The codes
    and scales of a row are one record, so a row costs one read where the checkpoint's two
    tensors cost two."""

    name = "fp8_block_e8m0"
    value_dtype = _U8
    from_values = False  # codes and scale bytes come verbatim, never quantized here

    @staticmethod
    def block_size(params: dict[str, Any] | None) -> int:
        """``params["block_size"]``: ConfigError where a table's params do not give one."""
        b = (params or {}).get("block_size")
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ConfigError(
                f"params={params!r}: the fp8_block_e8m0 codec needs {{'block_size': B}}, "
                "the values a scale byte covers"
            )
        return b

    def record_bytes(self, dim: int, params: dict[str, Any] | None = None) -> int:
        return dim + self.blocks(dim, params)

    def blocks(self, dim: int, params: dict[str, Any] | None) -> int:
        """Scale bytes a row: ``dim / block_size`` (ConfigError where it does not divide)."""
        b = self.block_size(params)
        if dim % b:
            raise ConfigError(
                f"rows of {dim} values do not split into blocks of {b} (block_size must divide "
                "the row's values)"
            )
        return dim // b

    def arena_width(self, dim: int, params: dict[str, Any] | None = None) -> int:
        return self.record_bytes(dim, params)

    def value_bytes(self, dim: int) -> int:
        return dim  # one byte a value; the scale bytes are not values

    def check_params(self, params: Any, where: str, dim: int | None = None) -> dict[str, Any]:
        if not isinstance(params, dict) or set(params) != {"block_size"}:
            raise FormatError(
                f"{where}: field 'params' is {params!r}; the {self.name} codec keeps "
                '{"block_size": the values one scale byte covers}'
            )
        b = params["block_size"]
        if isinstance(b, bool) or not isinstance(b, int) or b < 1 or (dim and dim % b):
            raise FormatError(
                f"{where}: field 'params.block_size' is {b!r}; expected an integer >= 1"
                + (f" dividing dim {dim}" if dim else "")
            )
        return {"block_size": b}

    def split(self, records: Any, dim: int) -> tuple[Any, Any]:
        """``(codes [n, dim], scale bytes [n, width - dim])`` of records ``[n, width]``
        (numpy or cupy): views, no copy."""
        return records[:, :dim], records[:, dim:]

    def check_encoded(
        self, block: np.ndarray, dim: int, params: dict[str, Any], name: str, first_row: int
    ) -> None:
        """NaN codes (named by their value column), then UE8M0 NaN bytes (0xFF), which make
        every value of their block NaN (named by the block's first and last column)."""
        codes, scales = self.split(block, dim)
        refuse_nan_codes(codes, name, first_row)
        bad = scales == 0xFF
        if not bad.any():
            return
        r, k = divmod(int(np.flatnonzero(bad.reshape(-1))[0]), scales.shape[1])
        b = dim // scales.shape[1]
        raise ConfigError(
            f"tables[{name!r}]: row {first_row + r}, block {k} (columns {k * b}..{k * b + b - 1}) "
            f"has the UE8M0 scale byte 0xff, NaN ({int(np.count_nonzero(bad))} such bytes in "
            f"rows {first_row}..{first_row + block.shape[0] - 1}): its {b} values would read as "
            "NaN; fix the source, or pass allow_nonfinite=True to store it anyway"
        )

    def encode(self, values: Any) -> np.ndarray:
        """Records of ``(codes uint8[n, dim], scales uint8[n, dim / B])`` (or of records
        ``uint8 [n, dim + dim / B]``, as a source reads them: verbatim)."""
        if isinstance(values, tuple):
            codes, scales = (np.asarray(v).view(np.uint8) for v in values)
            return np.concatenate([codes, scales], axis=1)
        return super().encode(values)

    def decode(self, dim: int, records: np.ndarray) -> Any:
        """``(codes uint8[n, dim], scales uint8[n, width - dim])`` of records as stored."""
        codes, scales = self.split(records, dim)
        return np.ascontiguousarray(codes), np.ascontiguousarray(scales)

    def gather(
        self, ids: Any, values: Any, scales: Any, params: dict[str, Any], out: Any = None
    ) -> Any:
        """Rows ``ids`` of ``values``, records ``[n, dim + dim / B]`` (an arena or a table of
        records; ``scales`` is None: the scale bytes are in the records)."""
        width = int(values.shape[1])
        b = self.block_size(params)
        if width % (b + 1):
            raise ConfigError(
                f"values are {width} bytes a row; records of blocks of {b} values are a "
                f"multiple of {b + 1} (the codes, then a scale byte a block)"
            )
        codes, exps = self.split(values, width // (b + 1) * b)
        return batched_embed_fp8_block(ids, codes, exps, out)


def refuse_nan_codes(codes: np.ndarray, name: str, first_row: int) -> None:
    """ConfigError naming table ``name``, the row and column of the first E4M3 NaN code
    (0x7F, 0xFF: E4M3FN has no Inf) of ``codes`` (uint8 ``[n, d]``, rows ``first_row..``)."""
    nan = (codes & 0x7F) == 0x7F
    if not nan.any():
        return
    r, c = divmod(int(np.flatnonzero(nan.reshape(-1))[0]), codes.shape[1])
    raise ConfigError(
        f"tables[{name!r}]: row {first_row + r}, column {c} is the E4M3 NaN code "
        f"0x{int(codes[r, c]):02x} ({int(np.count_nonzero(nan))} NaN codes in rows "
        f"{first_row}..{first_row + codes.shape[0] - 1}); it would read as NaN; fix the "
        "source, or pass allow_nonfinite=True to store it anyway"
    )


def block_scale_params(block_size: Any, dim: int, where: str) -> dict[str, Any]:
    """``{"block_size": B}`` of the ``fp8_block_e8m0`` codec from a user's ``block_size``: an
    int >= 1 dividing ``dim`` (ConfigError naming ``where`` otherwise)."""
    b = block_size
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 or dim % b:
        raise ConfigError(
            f"{where}={block_size!r}: give the values one scale byte covers, an int >= 1 "
            f"dividing the rows' {dim} values"
        )
    return {"block_size": int(b)}


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
    c.name: c for c in (Bf16Codec(), Fp8RowScaleCodec(), Fp8TableScaleCodec(), Fp8BlockE8M0Codec())
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
    "Fp8BlockE8M0Codec",
    "Fp8RowScaleCodec",
    "Fp8TableScaleCodec",
    "RowCodec",
    "block_scale_params",
    "get_codec",
    "refuse_nan_codes",
    "table_scale_params",
]
