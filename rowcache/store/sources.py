"""Table sources for the builder: in-memory arrays, ``.npy`` files, ``.safetensors`` tensors,
generated rows (``GeneratedRows``), parts concatenated in row order (``ConcatRows``),
encoded rows written verbatim (``Fp8TableScaleSource``: E4M3 codes and one bf16 scale;
``Fp8BlockScaleSource``: E4M3 codes and one UE8M0 byte a block, two tensors read row-aligned
into one record a row) and encoded rows decoded to values for a store of another codec
(``DecodedRows``).

Owns turning what a user hands ``build_store`` into a uniform streaming reader
(``rows``, ``dim``, ``read(start, stop)``). ``.npy`` and ``.safetensors`` tables are read
a block at a time with ``pread``, never loaded whole (a 63 GB table set streams through a
bounded amount of memory) and never memory-mapped for their rows (a file cut short during
the build is an error naming it, not a SIGBUS). Also owns reading the safetensors format itself: a file's header and a
sharded checkpoint's ``model.safetensors.index.json``, both checked before they are trusted
(a malformed file is a one-line ``FormatError`` naming it and the tensor, never a huge read,
a hang or a traceback). Does not convert or quantize; the builder does.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import struct
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rowcache.errors import ConfigError, FormatError
from rowcache.format.codecs import block_scale_params, get_codec, table_scale_params
from rowcache.kernels.reference import BF16, E4M3, E8M0

_ST_DTYPES = {
    "BF16": BF16,
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "F8_E4M3": E4M3,
    "F8_E8M0": E8M0,
    "U8": np.dtype(np.uint8),
}
_U8 = np.dtype(np.uint8)


class Source:
    """A 2-D table to stream, never copied whole: an array in memory, or the rows of a file.

    A file's rows (a ``.npy`` file's, a ``.safetensors`` tensor's) are read with ``pread``
    through a descriptor opened once, at ``offset``, never memory-mapped: a file cut short
    during the build would make a read of a mapped page past its new end a SIGBUS; here it
    is a ``FormatError`` naming the file. Call :meth:`close` when done (the builder does).
    """

    def __init__(
        self,
        name: str,
        origin: str,
        array: np.ndarray,
        file: str | None = None,
        offset: int = 0,
        fortran: bool = False,
    ) -> None:
        """``array`` is the table itself, or (with ``file``) a view whose dtype and shape
        describe the file's rows at ``offset``; it is never read then. ``fortran``: the
        file holds the table column after column (a ``.npy`` saved in Fortran order)."""
        self.name = name
        self.origin = origin
        self.dtype = array.dtype
        self.shape = (int(array.shape[0]), int(array.shape[1]))
        self.file = file
        self.offset = offset
        self.fortran = fortran
        self._array = None if file is not None else array
        # rows already in a codec's encoding, written verbatim (None: values to encode)
        self.codec: str | None = None
        self.params: dict[str, Any] = {}  # that codec's table-level parameters
        self._fd = -1
        self._close: Any = None
        if file is not None:
            with _open_regular(file, "table source") as (fd, size):
                need = offset + self.rows * self.dim * self.dtype.itemsize
                if size < need:
                    raise FormatError(
                        f"{file}: {size:,} bytes, but table {name!r} ({self.rows:,} x "
                        f"{self.dim} {self.dtype}) needs {need:,}: the file is truncated"
                    )
                self._fd = os.dup(fd)
            self._close = weakref.finalize(self, os.close, self._fd)  # if never closed

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def dim(self) -> int:
        return self.shape[1]

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._fd = -1

    def encoded_as(self, codec: str, params: dict[str, Any]) -> Source:
        """Mark these rows as already encoded by ``codec`` (with its table ``params``):
        the builder writes them verbatim. Returns self."""
        self.codec, self.params = codec, dict(params)
        return self

    def _pread(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of the file, read into a new array (C order)."""
        size = self.dtype.itemsize
        if self.fortran:
            # Column j of the block lies at (j * rows + start) * itemsize: one pread a column
            # into a [dim, n] array, then turned into rows.
            cols = np.empty((self.dim, stop - start), dtype=self.dtype)
            for j in range(self.dim):
                pos = self.offset + (j * self.rows + start) * size
                self._pread_into(cols[j].view(np.uint8).data, pos, start, stop)
            return np.ascontiguousarray(cols.T)
        out = np.empty((stop - start, self.dim), dtype=self.dtype)
        self._pread_into(
            out.reshape(-1).view(np.uint8).data, self.offset + start * self.dim * size, start, stop
        )
        return out

    def _pread_into(self, buf: memoryview, pos: int, start: int, stop: int) -> None:
        """Fill ``buf`` from the file at byte ``pos`` (for rows ``[start, stop)``): a read
        error names the file; the file ending first is a ``FormatError`` naming it."""
        got = 0
        while got < buf.nbytes:
            try:
                n = os.preadv(self._fd, [buf[got:]], pos + got)
            except OSError as e:
                raise OSError(
                    e.errno, f"reading table {self.name!r} from {self.file}: {e.strerror}"
                ) from e
            if n == 0:
                raise FormatError(
                    f"{self.file}: the source of table {self.name!r} ended at byte "
                    f"{pos + got:,} while being read (rows {start:,}..{stop - 1:,} need bytes "
                    f"up to {pos + buf.nbytes:,}): was it cut short or replaced during the build?"
                )
            got += n

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as bf16 or float32 (float16 is widened to float32)."""
        if self._array is None:
            block = self._pread(start, stop)
            return block.astype(np.float32) if block.dtype == np.float16 else block
        block = self._array[start:stop]
        if block.dtype == np.float16:
            return block.astype(np.float32)
        # A private copy: writing straight from a memory map faults its pages in inside
        # write(2) and runs at a third of the speed of writing from anonymous memory.
        return np.array(block, copy=True)

    def view(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` without a copy where the dtype allows (bf16, float32 in
        memory): for consumers that read every value once (the FP8 quantize), a private
        copy is one more pass over memory. A file's rows are read (:meth:`read`)."""
        if self._array is None:
            return self.read(start, stop)
        block = self._array[start:stop]
        if block.dtype == np.float16:
            return block.astype(np.float32)
        return block


@dataclass(frozen=True)
class GeneratedRows:
    """A table that exists nowhere whole: ``make(start, stop)`` returns its rows
    ``[start, stop)`` as bfloat16 or float32 ``[stop - start, dim]``, a chunk at a time
    (``dtype=np.uint8``: E4M3 codes, the ``codes`` of an ``Fp8TableScaleSource`` only).

    For tables a program computes (``bench/engram.py`` generates tens of GiB of rows, which
    no array in memory and no file beside the store could hold); the builder streams it as
    it streams a file. ``make`` must give the same rows for the same range every call.
    """

    rows: int
    dim: int
    make: Callable[[int, int], np.ndarray]
    dtype: Any = BF16

    def __post_init__(self) -> None:
        for field in ("rows", "dim"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ConfigError(f"GeneratedRows.{field}={v!r}: give an int >= 1")
        if np.dtype(self.dtype) not in (BF16, np.float32, _U8):
            raise ConfigError(
                f"GeneratedRows.dtype={self.dtype!r}; allowed: bfloat16, float32, uint8 (codes)"
            )
        if not callable(self.make):
            raise ConfigError(f"GeneratedRows.make={self.make!r}: give a function (start, stop)")


class _GeneratedSource(Source):
    """A :class:`Source` over :class:`GeneratedRows`: each read is a call of its ``make``,
    checked for shape and dtype (a wrong block is a ``ConfigError`` naming the table)."""

    def __init__(self, name: str, gen: GeneratedRows) -> None:
        # the table's shape and dtype as a view of one value (no memory); never read
        shape = np.broadcast_to(np.zeros((), dtype=gen.dtype), (int(gen.rows), int(gen.dim)))
        super().__init__(name, f"generated {gen.rows:,} x {gen.dim}", shape)
        self._make = gen.make

    def read(self, start: int, stop: int) -> np.ndarray:
        block = self._make(start, stop)
        if (
            not isinstance(block, np.ndarray)
            or block.dtype != self.dtype
            or block.shape != (stop - start, self.dim)
        ):
            raise ConfigError(
                f"tables[{self.name!r}]: make({start}, {stop}) returned "
                f"{getattr(block, 'dtype', type(block).__name__)}"
                f"{list(getattr(block, 'shape', []))}; expected a numpy "
                f"{self.dtype}[{stop - start}, {self.dim}]"
            )
        return block

    def view(self, start: int, stop: int) -> np.ndarray:
        return self.read(start, stop)


@dataclass(frozen=True)
class ConcatRows:
    """One table made of ``parts`` in row order: part 0's rows, then part 1's, ...

    Each part is anything ``build_store`` takes as a table (an array, a ``.npy`` path, a
    ``.safetensors`` tensor as ``(file, tensor)`` or ``"file:tensor"``, a checkpoint's
    index in place of the file); for an ``Fp8TableScaleSource``, E4M3 codes. The parts
    are streamed a chunk at a time like any source, never joined in memory: a table whose
    checkpoint spreads it over tensors ``shard_0 .. shard_{k-1}`` of several files. Every
    part must have the table's width and one dtype.
    """

    parts: Sequence[Any]

    def __post_init__(self) -> None:
        if isinstance(self.parts, (str, bytes)) or not isinstance(self.parts, Sequence):
            raise ConfigError(
                f"ConcatRows.parts={_short(self.parts)}: give a list of sources, in row order"
            )
        if not self.parts:
            raise ConfigError("ConcatRows.parts is empty: give at least one source")


@dataclass(frozen=True)
class Fp8TableScaleSource:
    """A table given encoded, for the ``fp8_table_scale`` codec: its E4M3 ``codes`` and the
    one bf16 ``scale`` of the whole table, written verbatim (no re-quantization).

    ``codes``: uint8 (or ``float8_e4m3fn``) ``[rows, dim]``, as an array, a ``.npy`` path, a
    ``.safetensors`` tensor of dtype ``F8_E4M3`` (or ``U8``) as ``(file, tensor)`` or
    ``"file:tensor"``, or a :class:`ConcatRows` of these. ``scale``: one finite bfloat16 value
    (a ``ml_dtypes.bfloat16``, a float that is exactly one, a one-value array) or a
    ``.safetensors`` tensor of one BF16 (or F32 holding a bf16 value) value, e.g. the
    checkpoint's ``weight_scale``. Rows then read as ``bf16_rn(bf16(code) * scale)``.
    """

    codes: Any
    scale: Any


@dataclass(frozen=True)
class Fp8BlockScaleSource:
    """A table given encoded, for the ``fp8_block_e8m0`` codec: its E4M3 ``codes`` and its
    UE8M0 ``scales``, one byte a block of ``block_size`` values of a row, written verbatim
    (no re-quantization), each row's scale bytes after its codes: one record a row.

    ``codes``: uint8 (or ``float8_e4m3fn``) ``[rows, dim]``; ``scales``: uint8 (or
    ``float8_e8m0fnu``) ``[rows, dim / block_size]``; each an array, a ``.npy`` path, a
    ``.safetensors`` tensor (``F8_E4M3`` / ``F8_E8M0``, or ``U8``) as ``(file, tensor)`` or
    ``"file:tensor"`` (in place of the file, an indexed checkpoint's index), or a
    :class:`ConcatRows` of these: DeepSeek-V4.1's ``layers.{L}.engram.embed.weight`` and
    ``.scale``. The two are streamed row-aligned, a chunk of each at a time. ``block_size``:
    None takes ``dim / scales.shape[1]``; given, it is checked against the shapes. Rows then
    read as ``bf16_rn(e4m3(code) * 2**(e - 127))``.
    """

    codes: Any
    scales: Any
    block_size: int | None = None


@dataclass(frozen=True)
class DecodedRows:
    """The values of a table given encoded (an :class:`Fp8BlockScaleSource` or
    :class:`Fp8TableScaleSource`), decoded a chunk at a time by its codec's gather rule to
    bfloat16 ``[rows, dim]``: a value source, for a store of another codec
    (``build_store(..., dtype="bf16")`` or ``"fp8"``: re-quantized by the store's rule)."""

    source: Any


class ConcatSource(Source):
    """A :class:`Source` over the resolved ``parts`` of a :class:`ConcatRows`, in row order:
    a read of rows ``[start, stop)`` reads the pieces of the parts it covers."""

    def __init__(self, name: str, parts: list[Source]) -> None:
        first = parts[0]
        for i, p in enumerate(parts[1:], 1):
            if p.dim != first.dim or p.dtype != first.dtype:
                raise ConfigError(
                    f"tables[{name!r}]: ConcatRows part {i} ({p.origin}) is {p.dtype}"
                    f"[{p.rows}, {p.dim}], part 0 ({first.origin}) {first.dtype}"
                    f"[{first.rows}, {first.dim}]: parts need one width and one dtype"
                )
        rows = sum(p.rows for p in parts)
        shape = np.broadcast_to(np.zeros((), dtype=first.dtype), (rows, first.dim))
        origin = "concat(" + ", ".join(p.origin for p in parts) + ")"
        super().__init__(name, origin, shape)
        self.parts = parts
        self.starts = np.cumsum([0] + [p.rows for p in parts])

    def read(self, start: int, stop: int) -> np.ndarray:
        pieces = []
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            lo = int(self.starts[k])
            end = min(stop, int(self.starts[k + 1]))
            pieces.append(self.parts[k].read(start - lo, end - lo))
            start, k = end, k + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def view(self, start: int, stop: int) -> np.ndarray:
        return self.read(start, stop)

    def close(self) -> None:
        for p in self.parts:
            p.close()


class BlockScaledSource(Source):
    """A :class:`Source` over the two tensors of an :class:`Fp8BlockScaleSource`: ``rows`` x
    ``dim`` values (``dim`` codes a row), whose :meth:`read` gives the rows' records, uint8
    ``[n, dim + dim / block]``: each chunk's codes and scale bytes read from their own
    sources (row-aligned) and joined once."""

    def __init__(self, name: str, codes: Source, scales: Source, block_size: int | None) -> None:
        if codes.rows != scales.rows:
            raise ConfigError(
                f"tables[{name!r}]: the codes ({codes.origin}) have {codes.rows:,} rows and the "
                f"scales ({scales.origin}) {scales.rows:,}: one scale row a code row"
            )
        blocks = scales.dim
        if block_size is None and codes.dim % blocks == 0:
            block_size = codes.dim // blocks
        params = block_scale_params(block_size, codes.dim, f"tables[{name!r}].block_size")
        if codes.dim // params["block_size"] != blocks:
            raise ConfigError(
                f"tables[{name!r}]: the scales ({scales.origin}) have {blocks} bytes a row; rows "
                f"of {codes.dim} codes in blocks of {params['block_size']} need "
                f"{codes.dim // params['block_size']}"
            )
        shape = np.broadcast_to(np.zeros((), dtype=_U8), codes.shape)
        super().__init__(name, f"blocks({codes.origin}, {scales.origin})", shape)
        self.codes, self.scales = codes, scales
        self.encoded_as("fp8_block_e8m0", params)

    def read(self, start: int, stop: int) -> np.ndarray:
        out = np.empty((stop - start, self.dim + self.scales.dim), dtype=_U8)
        out[:, : self.dim] = self.codes.read(start, stop)
        out[:, self.dim :] = self.scales.read(start, stop)
        return out

    def view(self, start: int, stop: int) -> np.ndarray:
        return self.read(start, stop)

    def close(self) -> None:
        self.codes.close()
        self.scales.close()


class DecodedSource(Source):
    """A :class:`Source` of the values of an encoded source (:class:`DecodedRows`): each read
    decodes the inner source's rows by its codec's gather (bfloat16; NaN where they decode
    to NaN, which the builder refuses unless ``allow_nonfinite``)."""

    def __init__(self, name: str, inner: Source) -> None:
        if inner.codec is None:
            inner.close()
            raise ConfigError(
                f"tables[{name!r}]: DecodedRows takes an encoded source (Fp8BlockScaleSource, "
                f"Fp8TableScaleSource), got values ({inner.origin})"
            )
        shape = np.broadcast_to(np.zeros((), dtype=BF16), inner.shape)
        super().__init__(name, f"decoded({inner.origin})", shape)
        self.inner = inner
        self._codec = get_codec(inner.codec)

    def read(self, start: int, stop: int) -> np.ndarray:
        block = self.inner.read(start, stop)
        ids = np.arange(stop - start, dtype=np.int64)
        return np.asarray(self._codec.gather(ids, block, None, self.inner.params))

    def view(self, start: int, stop: int) -> np.ndarray:
        return self.read(start, stop)

    def close(self) -> None:
        self.inner.close()


def _file_source(
    name: str, arr: np.ndarray, path: str, origin: str, kind: str = "values"
) -> Source:
    """A :class:`Source` reading ``path`` where the memory map ``arr`` shows its table (the
    map only tells dtype, shape and offset; it is never read): with ``pread``, row blocks
    where the rows lie in C order, column pieces for a .npy file saved in Fortran order.
    Never through the map: a file cut short would make a read of it a SIGBUS."""
    offset = int(arr.offset) if isinstance(arr, np.memmap) else -1
    arr = _as_array(arr, name, origin, kind)
    if offset < 0:  # not a map (an empty tensor): an array in memory
        return Source(name, origin, arr)
    if arr.flags.c_contiguous:
        return Source(name, origin, arr, path, offset)
    if arr.flags.f_contiguous:
        return Source(name, origin, arr, path, offset, fortran=True)
    raise FormatError(f"{path}: table {name!r} is neither in C nor in Fortran order")


def _as_table_array(arr: np.ndarray, name: str, origin: str) -> np.ndarray:
    if arr.dtype == np.uint16 or arr.dtype == np.dtype("V2"):
        arr = arr.view(BF16)
    if arr.dtype not in (BF16, np.float32, np.float16):
        hint = (
            "; FP8 codes are written verbatim through "
            "rowcache.store.sources.Fp8TableScaleSource(codes, scale) or "
            "Fp8BlockScaleSource(codes, scales)"
            if arr.dtype in (E4M3, E8M0, _U8)
            else ""
        )
        raise ConfigError(
            f"tables[{name!r}]: dtype {arr.dtype} from {origin} is not supported; "
            f"allowed: bfloat16 (or its uint16 view), float32, float16{hint}"
        )
    return _check_2d(arr, name, origin)


def _as_array(arr: np.ndarray, name: str, origin: str, kind: str) -> np.ndarray:
    """``arr`` as a table of ``kind``: ``"values"`` (:func:`_as_table_array`), ``"codes"``
    (uint8 E4M3 codes ``[rows, dim]``, float8_e4m3fn viewed as its bytes) or ``"scales"``
    (uint8 UE8M0 bytes, float8_e8m0fnu viewed as its bytes)."""
    if kind == "values":
        return _as_table_array(arr, name, origin)
    own, st = (E4M3, "F8_E4M3") if kind == "codes" else (E8M0, "F8_E8M0")
    if arr.dtype == own:
        arr = arr.view(np.uint8)
    if arr.dtype != _U8:
        what = "E4M3 codes" if kind == "codes" else "UE8M0 scale bytes"
        raise ConfigError(
            f"tables[{name!r}]: {kind} of dtype {arr.dtype} from {origin}; {what} must be "
            f"uint8 or {own} (a .safetensors tensor of dtype {st} or U8)"
        )
    return _check_2d(arr, name, origin)


def _check_2d(arr: np.ndarray, name: str, origin: str) -> np.ndarray:
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ConfigError(
            f"tables[{name!r}]: expected a 2-D [rows, dim] table with rows, dim >= 1, "
            f"got shape {tuple(arr.shape)} from {origin}"
        )
    return arr


# What a header may hold: the safetensors library's own limit on its length, and numpy's
# on dimensions. Bits per element of the format's dtypes, for the shape-against-bytes check;
# a dtype not listed here (a newer one) is checked for its offsets only.
MAX_HEADER_BYTES = 100_000_000
MAX_JSON_BYTES = 100_000_000  # an index or a config.json
MAX_DIMS = 64
_ST_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: a hostile header's values can be megabytes."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "null" if value is None else "a number"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@contextlib.contextmanager
def _open_regular(path: str, what: str) -> Iterator[tuple[int, int]]:
    """``(fd, size)`` of ``path``, refused unless it is a regular file: opened non-blocking
    and checked with ``fstat`` before any read, so a FIFO or a device never hangs the caller."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:  # permissions, out of descriptors: about the process, not the file's bytes
        raise OSError(e.errno, f"{path}: cannot open the {what}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: not a regular file, so not a {what}: give the file itself")
        yield fd, st.st_size
    finally:
        os.close(fd)


_NPY_MAX_HEADER = 1 << 20  # bytes; numpy's own default limit is 10,000


def check_npy_header(fd: int, size: int, path: str) -> None:
    """``FormatError`` naming ``path`` unless the ``.npy`` file of ``size`` bytes open at
    ``fd`` has a header numpy reads whose shape is integers ``>= 0`` and whose data
    (shape x item size) fits the bytes after the header. Checked before ``np.load`` maps it:
    a negative or huge dimension there is an ``OverflowError`` or an opaque ``ValueError``."""
    head = _pread_exact(fd, path, min(size, 10 + _NPY_MAX_HEADER), 0) if size else b""
    buf = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(buf)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(buf, _NPY_MAX_HEADER)
        elif version in ((2, 0), (3, 0)):
            shape, _, dtype = np.lib.format.read_array_header_2_0(buf, _NPY_MAX_HEADER)
        else:
            raise ValueError(f"version {version} of the format is not one numpy writes")
    except (ValueError, EOFError, OverflowError, SyntaxError) as e:
        raise FormatError(f"{path}: not a readable .npy file ({e or 'empty'})") from e
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise FormatError(
            f"{path}: the .npy header's shape {_short(shape)} has a dimension that is not an "
            "integer >= 0: the file is damaged or not written by numpy"
        )
    need = dtype.itemsize if 0 not in shape else 0
    for d in shape if need else ():
        need *= d
        if need > size:  # past the file already: no product of a hostile size
            break
    if need > size - buf.tell():
        raise FormatError(
            f"{path}: the .npy header's shape {_short(shape)} of {dtype} needs at least "
            f"{need:,} bytes of data, the file holds {size - buf.tell():,} after its header: "
            "the file is truncated or its header damaged"
        )


def _pread_exact(fd: int, path: str, n: int, offset: int) -> bytes:
    parts, got = [], 0
    while got < n:
        try:
            b = os.pread(fd, n - got, offset + got)
        except OSError as e:
            raise FormatError(f"{path}: read failed ({e.strerror})") from e
        if not b:
            raise FormatError(
                f"{path}: the file ended after {offset + got:,} bytes while being read"
            )
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def _json_object(data: bytes, where: str) -> dict[str, Any]:
    """``data`` parsed as a JSON object; one-line ``FormatError`` naming ``where`` otherwise."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise FormatError(
            f"{where}: its JSON nests too deeply to be read; the file is damaged or not what "
            "it is named"
        ) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer too long
        raise FormatError(f"{where}: not JSON ({_short(str(e), 120)})") from None
    if not isinstance(value, dict):
        raise FormatError(f"{where}: holds {_kind(value)}, not a JSON object")
    return value


def _check_entry(path: str, name: str, spec: Any, data_bytes: int) -> None:
    """One tensor's entry: dtype, shape, data_offsets inside the data, shape x dtype = bytes."""
    where = f"{path}: tensor {_short(name)}"
    if not isinstance(spec, dict):
        raise FormatError(
            f"{where}: its entry is {_kind(spec)}, not an object of dtype, shape, data_offsets"
        )
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(dtype, str):
        raise FormatError(f"{where}: dtype is {_short(dtype)}, not a string such as 'BF16'")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise FormatError(f"{where}: shape {_short(shape)} is not a list of integers >= 0")
    if len(shape) > MAX_DIMS:
        raise FormatError(f"{where}: shape has {len(shape):,} dimensions; at most {MAX_DIMS}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise FormatError(
            f"{where}: data_offsets {_short(offsets)} is not a pair [begin, end] of integers "
            "with 0 <= begin <= end"
        )
    begin, end = offsets
    if end > data_bytes:
        raise FormatError(
            f"{where}: data_offsets {_short(offsets)} end past the {data_bytes:,} bytes of data "
            "the file holds after its header: the file is truncated or damaged"
        )
    bits = _ST_BITS.get(dtype)
    if bits is not None:
        span, count = (end - begin) * 8, 0 if 0 in shape else 1
        for d in shape if count else ():  # stop once past the span: no product of a hostile size
            count *= d
            if count * bits > span:
                break
        if count * bits != span:
            need = f"{count * bits // 8:,}" if count * bits < span else f"more than {span // 8:,}"
            raise FormatError(
                f"{where}: shape {_short(shape)} of {dtype} needs {need} bytes, its "
                f"data_offsets span {span // 8:,}: the header is damaged"
            )


def safetensors_header(path: str) -> dict[str, Any]:
    """The JSON header of a ``.safetensors`` file, checked, plus ``"__data_start__"``.

    The format is an 8-byte little-endian header length, a JSON header mapping
    names to ``dtype``, ``shape`` and ``data_offsets`` (and an optional
    ``__metadata__`` object), then the raw data. The header is checked before it is
    trusted: the file is a regular file (a FIFO would hang the read), the length fits in
    the file and in 100 MB, the header is a JSON object, every tensor's offsets lie inside
    the data and its shape times its dtype's size equals its bytes. Any failure is a
    one-line :class:`FormatError` naming the file and the tensor.
    """
    with _open_regular(path, ".safetensors file") as (fd, size):
        if size < 8:
            raise FormatError(
                f"{path}: {size} bytes, too short for a .safetensors file (it begins with an "
                "8-byte header length)"
            )
        head = _pread_exact(fd, path, 8, 0)
        (hlen,) = struct.unpack("<Q", head)
        if hlen > size - 8:
            hint = (
                " It begins like a JSON file: a sharded checkpoint's "
                "model.safetensors.index.json? Give the index (or its directory) as the "
                "checkpoint: --safetensors INDEX, rowcache.embed.table_sources(INDEX)."
                if head.lstrip()[:1] in (b"{", b"[")
                else " The file is truncated or not a .safetensors file."
            )
            raise FormatError(
                f"{path}: header length {hlen:,} runs past the end of the file "
                f"({size:,} bytes).{hint}"
            )
        if hlen > MAX_HEADER_BYTES:
            raise FormatError(
                f"{path}: header of {hlen:,} bytes, over the format's limit of "
                f"{MAX_HEADER_BYTES:,}: not a .safetensors file, or a damaged one"
            )
        raw = _pread_exact(fd, path, hlen, 8)
    header = _json_object(raw, f"{path}: the .safetensors header")
    data_bytes = size - 8 - hlen
    for name, spec in header.items():
        if name == "__metadata__":
            if not isinstance(spec, dict):
                raise FormatError(
                    f"{path}: the header's __metadata__ is {_kind(spec)}, not a JSON object"
                )
            continue
        _check_entry(path, name, spec, data_bytes)
    header["__data_start__"] = 8 + hlen
    return header


def safetensors_tensor(path: str, tensor: str) -> np.ndarray:
    """Memory-map one tensor of a ``.safetensors`` file (BF16, F32, F16, F8_E4M3 or U8)
    without loading it (its rows are then read with ``pread``: ``Source``)."""
    header = safetensors_header(path)
    if tensor not in header or tensor.startswith("__"):
        names = [k for k in header if not k.startswith("__")]
        near = [k for k in names if "ngram" in k or "embed" in k][:6]
        raise ConfigError(
            f"{path}: no tensor named {tensor!r}; it has {len(names)} tensors"
            + (f", e.g. {near}" if near else "")
        )
    spec = header[tensor]
    dtype = _ST_DTYPES.get(spec["dtype"])
    if dtype is None:
        raise ConfigError(
            f"{path}: tensor {tensor!r}: dtype {_short(spec['dtype'])} is not supported; "
            f"allowed: {sorted(_ST_DTYPES)}"
        )
    start, stop = spec["data_offsets"]
    shape = tuple(spec["shape"])
    if start == stop:  # an empty tensor: nothing to map
        return np.zeros(shape, dtype=dtype)
    return np.memmap(
        path, dtype=dtype, mode="r", offset=header["__data_start__"] + start, shape=shape
    )


def read_json_object(path: str, what: str, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """The JSON object in file ``path`` (a regular file of at most ``limit`` bytes), or a
    one-line :class:`FormatError` naming the file as the ``what`` it should be: never a hang
    on a FIFO, a whole huge file read, or a ``RecursionError`` from deeply nested JSON."""
    with _open_regular(path, what) as (fd, size):
        if size > limit:
            raise FormatError(
                f"{path}: {size:,} bytes, over the {limit:,}-byte limit of a {what}: "
                "check that this is the right file"
            )
        raw = _pread_exact(fd, path, size, 0)
    return _json_object(raw, f"{path}: the {what}")


def safetensors_index(path: str) -> dict[str, str]:
    """Tensor name -> shard file of a sharded checkpoint's ``model.safetensors.index.json``.

    The index is a JSON object whose ``weight_map`` maps each tensor's name to the file
    name of its shard, beside the index. Checked like a header: a regular file of at most
    100 MB, a JSON object, a ``weight_map`` object of strings, each a file name inside the
    index's directory (no absolute path, no ``..``). The shards are not opened here.
    """
    index = read_json_object(path, "safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        got = _kind(weight_map) if "weight_map" in index else "missing"
        raise FormatError(
            f"{path}: the index's weight_map is {got}; a model.safetensors.index.json maps "
            'tensor names to shard file names in a "weight_map" object'
        )
    directory = os.path.dirname(path)
    files: dict[str, str] = {}
    for name, fn in weight_map.items():
        if not isinstance(fn, str) or not fn:
            got = _kind(fn) if not isinstance(fn, str) else "empty"
            raise FormatError(f"{path}: weight_map[{_short(name)}] is {got}, not a shard file name")
        parts = fn.replace("\\", "/").split("/")
        if os.path.isabs(fn) or ".." in parts or "\0" in fn:
            raise FormatError(
                f"{path}: weight_map[{_short(name)}] = {_short(fn)} is not a file name inside "
                f"the index's directory {directory or '.'}"
            )
        files[name] = os.path.join(directory, fn)
    return files


def split_tensor_source(text: str) -> tuple[str, str] | None:
    """``("file.safetensors", tensor)`` from ``"file.safetensors:tensor"``, or
    ``("model.safetensors.index.json", tensor)`` from ``"model.safetensors.index.json:tensor"``
    (any ``*.json``); None for anything else."""
    for ext in (".safetensors:", ".json:"):
        if ext in text:
            path, tensor = text.split(ext, 1)
            return path + ext[:-1], tensor
    return None


def resolve_source(name: str, src: Any) -> Source:
    """A :class:`Source` from an array, a ``.npy`` path, ``(file.safetensors, tensor)``,
    :class:`GeneratedRows`, :class:`ConcatRows`, :class:`Fp8TableScaleSource`,
    :class:`Fp8BlockScaleSource` or :class:`DecodedRows`.

    A string ``"file.safetensors:tensor.name"`` is accepted as well. In place of the
    ``.safetensors`` file, a sharded checkpoint's ``model.safetensors.index.json`` names
    the tensor's shard through its ``weight_map``. An :class:`Fp8TableScaleSource` gives a
    source of uint8 codes marked ``fp8_table_scale`` (``Source.codec``) with its scale, an
    :class:`Fp8BlockScaleSource` one of records marked ``fp8_block_e8m0`` with its block
    size, a :class:`DecodedRows` one of bfloat16 values.
    """
    if isinstance(src, Fp8TableScaleSource):
        params = table_scale_params(_scale_value(name, src.scale), f"tables[{name!r}].scale")
        return _resolve(name, src.codes, "codes").encoded_as("fp8_table_scale", params)
    if isinstance(src, Fp8BlockScaleSource):
        codes = _resolve(name, src.codes, "codes")
        try:
            scales = _resolve(name, src.scales, "scales")
        except BaseException:
            codes.close()
            raise
        try:
            return BlockScaledSource(name, codes, scales, src.block_size)
        except BaseException:
            codes.close()
            scales.close()
            raise
    if isinstance(src, DecodedRows):
        if isinstance(src.source, DecodedRows):
            raise ConfigError(f"tables[{name!r}]: DecodedRows of DecodedRows; give it once")
        return DecodedSource(name, resolve_source(name, src.source))
    return _resolve(name, src, "values")


def _scale_value(name: str, scale: Any) -> Any:
    """A table scale as given, or read from a ``.safetensors`` tensor of one value."""
    if isinstance(scale, str) and split_tensor_source(scale) is not None:
        scale = split_tensor_source(scale)
    if not (isinstance(scale, tuple) and len(scale) == 2):
        return scale
    path, tensor = _tensor_file(name, os.fspath(scale[0]), scale[1])
    arr = safetensors_tensor(path, tensor)  # checks the header; the map is never read
    if arr.size != 1 or arr.dtype not in (BF16, np.dtype("<f4")):
        raise ConfigError(
            f"tables[{name!r}].scale: {path}:{tensor} is {arr.dtype}{list(arr.shape)}; a "
            "table's scale is one BF16 (or F32) value"
        )
    offset = int(arr.offset) if isinstance(arr, np.memmap) else -1
    with _open_regular(path, ".safetensors file") as (fd, _):
        raw = _pread_exact(fd, path, arr.dtype.itemsize, offset)
    return np.frombuffer(raw, dtype=arr.dtype).reshape(())


def _tensor_file(name: str, path: str, tensor: str) -> tuple[str, str]:
    """``(shard file, tensor)`` of a tensor named in a file or a checkpoint's index."""
    if not os.path.exists(path):
        raise ConfigError(f"tables[{name!r}]: file {path!r} does not exist")
    if path.endswith(".json"):
        index, shards = path, safetensors_index(path)
        if tensor not in shards:
            raise ConfigError(
                f"tables[{name!r}]: {index}: the weight_map has no tensor {tensor!r} "
                f"({len(shards)} tensors)"
            )
        path = shards[tensor]
        if not os.path.exists(path):
            raise ConfigError(
                f"tables[{name!r}]: {index} puts {tensor!r} in {path}, which does not "
                "exist: download that shard"
            )
    return path, tensor


def _resolve(name: str, src: Any, kind: str) -> Source:
    """:func:`resolve_source` of a plain source of ``kind`` (:func:`_as_array`): values, E4M3
    codes or UE8M0 scale bytes."""
    if isinstance(src, np.ndarray):
        return Source(name, "array", _as_array(src, name, "array", kind))
    if isinstance(src, ConcatRows):
        parts: list[Source] = []
        try:
            for i, p in enumerate(src.parts):
                if isinstance(
                    p, (ConcatRows, Fp8TableScaleSource, Fp8BlockScaleSource, DecodedRows)
                ):
                    raise ConfigError(
                        f"tables[{name!r}]: ConcatRows part {i} is a {type(p).__name__}; "
                        "parts are plain sources (arrays, files, tensors)"
                    )
                parts.append(_resolve(name, p, kind))
            return ConcatSource(name, parts)
        except BaseException:
            for p in parts:
                p.close()
            raise
    if isinstance(src, GeneratedRows) and (kind != "values") == (np.dtype(src.dtype) == _U8):
        return _GeneratedSource(name, src)  # values, or (uint8) an encoded source's bytes
    if isinstance(src, str) and split_tensor_source(src) is not None:
        src = split_tensor_source(src)
    if isinstance(src, tuple) and len(src) == 2:
        path, tensor = _tensor_file(name, os.fspath(src[0]), src[1])
        arr = safetensors_tensor(path, tensor)
        return _file_source(name, arr, path, f"{path}:{tensor}", kind)
    if isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        if not os.path.exists(path):
            raise ConfigError(f"tables[{name!r}]: file {path!r} does not exist")
        if not path.endswith(".npy"):
            raise ConfigError(
                f"tables[{name!r}]: {path!r} is neither a .npy file nor "
                "'file.safetensors:tensor' / (file.safetensors, tensor)"
            )
        with _open_regular(path, ".npy file") as (fd, size):  # a FIFO would hang np.load
            check_npy_header(fd, size, path)
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError, OverflowError) as e:
            raise FormatError(f"{path}: not a readable .npy file ({e or 'empty'})") from e
        return _file_source(name, arr, path, path, kind)
    allowed = (
        "uint8 [rows, dim] array, .npy path, (file.safetensors, tensor name), ConcatRows"
        if kind != "values"
        else "2-D numpy array, .npy path, (file.safetensors, tensor name), GeneratedRows, "
        "ConcatRows, Fp8TableScaleSource, Fp8BlockScaleSource, DecodedRows"
    )
    what = kind if kind != "values" else "a source"
    raise ConfigError(
        f"tables[{name!r}]: {what} of type {type(src).__name__} is not supported; allowed: "
        f"{allowed}"
    )
