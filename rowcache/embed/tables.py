"""Table variants of the n-gram embedding: resident BF16, resident FP8 (a scale a row),
resident FP8 with one scale a table, resident FP8 with one power-of-two scale a block of
values, cached.

Owns :class:`Bf16Table`, :class:`Fp8Table`, :class:`Fp8TableScaleTable`,
:class:`Fp8BlockScaleTable` and :class:`CachedTable`. Each answers
``gather(ids, out=None) -> bfloat16[n, d]`` with the kernels of ``kernels`` (NumPy
references on the CPU, CUDA kernels for cupy arrays), so ``NgramEmbedding`` mixes
them freely. Does not hash ids or project rows.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import rowcache.kernels
from rowcache.errors import ConfigError
from rowcache.format.codecs import (
    Fp8TableScaleCodec,
    block_scale_params,
    get_codec,
    table_scale_params,
)
from rowcache.kernels.loader import is_device_array, require_cupy
from rowcache.kernels.reference import BF16

_U8 = np.dtype(np.uint8)
_E4M3 = np.dtype("float8_e4m3fn")
_E8M0 = np.dtype("float8_e8m0fnu")
_U16 = np.dtype(np.uint16)
_V2 = np.dtype("V2")
_F32 = np.dtype(np.float32)


def _load_npy(path: str | os.PathLike[str]) -> np.ndarray:
    """A ``.npy`` table memory-mapped; a missing or unreadable file names itself."""
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise ConfigError(f"Bf16Table: file {p!r} does not exist")
    if not p.endswith(".npy"):
        raise ConfigError(f"Bf16Table: {p!r} is not a .npy file")
    try:
        return np.load(p, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ConfigError(f"{p}: not a readable .npy file ({e or 'empty'})") from e


def _describe(a: Any) -> str:
    lib = "cupy" if is_device_array(a) else type(a).__module__.split(".")[0]
    shape = list(getattr(a, "shape", ()))
    return f"{getattr(a, 'dtype', type(a).__name__)}{shape} ({lib})"


def _device_of(a: Any) -> str:
    return "cuda" if is_device_array(a) else "cpu"


def _to_device(a: Any, device: str) -> Any:
    if device == "cpu":
        return a.get() if is_device_array(a) else a
    if device == "cuda":
        cp = require_cupy("a table on device='cuda'")
        return a if is_device_array(a) else cp.asarray(a)
    raise ConfigError(f"device={device!r} is not supported; allowed: 'cpu', 'cuda'")


class Bf16Table:
    """A resident bfloat16 table.

    Parameters
    ----------
    array : bfloat16[rows, d], its uint16 view, or float32[rows, d], numpy or cupy; or a
        ``.npy`` path (memory-mapped, not loaded) of any of these, as ``build_store`` takes.
        float32 is rounded to bfloat16 (nearest even). A cupy array makes a GPU table.
    """

    kind = "bf16"

    def __init__(self, array: Any) -> None:
        if isinstance(array, (str, os.PathLike)):
            array = _load_npy(array)
        if hasattr(array, "dtype") and array.dtype in (_U16, _V2):
            array = array.view(BF16)  # bf16 saved by NumPy without ml_dtypes: same bits
        if not hasattr(array, "ndim") or array.ndim != 2:
            raise ConfigError(f"Bf16Table array must be 2-D [rows, dim], got {_describe(array)}")
        if array.dtype == _F32:
            array = array.astype(BF16)
        if array.dtype != BF16:
            raise ConfigError(
                "Bf16Table array must be bfloat16 or float32 (or bfloat16's uint16 view), "
                f"got {_describe(array)}"
            )
        self.array = array

    @property
    def rows(self) -> int:
        return int(self.array.shape[0])

    @property
    def dim(self) -> int:
        return int(self.array.shape[1])

    @property
    def device(self) -> str:
        """``"cuda"`` for a cupy array, else ``"cpu"``."""
        return _device_of(self.array)

    @property
    def nbytes(self) -> int:
        """Bytes held resident."""
        return int(self.array.nbytes)

    def to(self, device: str) -> Bf16Table:
        """This table on ``device`` (``"cpu"`` or ``"cuda"``); self when already there."""
        moved = _to_device(self.array, device)
        return self if moved is self.array else Bf16Table(moved)

    @property
    def arrays(self) -> tuple[Any, None]:
        """``(rows, None)``: what ``rowcache.kernels.ngram.stacked.StackedTables`` reads."""
        return self.array, None

    def gather(self, ids: Any, out: Any = None) -> Any:
        """``out[k] = array[ids[k]]``: ids int[n] -> bfloat16[n, d] (``rowcache.kernels.batched_embed``)."""
        return rowcache.kernels.batched_embed(ids, self.array, out)

    def end_step(self) -> None:
        """Nothing to release for a resident table."""

    def end_batch(self) -> None:
        """Deprecated alias of :meth:`end_step`, kept for one release."""

    def __repr__(self) -> str:
        return f"Bf16Table(rows={self.rows}, dim={self.dim}, device={self.device!r})"


class Fp8Table:
    """A resident FP8 (E4M3) table with one float32 scale per row.

    Parameters
    ----------
    codes : uint8[rows, d], numpy or cupy
        E4M3 bit patterns.
    scales : float32[rows], same library as ``codes``
        Row ``r`` decodes as ``bf16(e4m3(codes[r]) * scales[r])``.
    """

    kind = "fp8"

    def __init__(self, codes: Any, scales: Any) -> None:
        if not hasattr(codes, "ndim") or codes.ndim != 2 or codes.dtype != _U8:
            raise ConfigError(f"Fp8Table codes must be uint8[rows, dim], got {_describe(codes)}")
        if (
            not hasattr(scales, "ndim")
            or scales.ndim != 1
            or scales.dtype != _F32
            or scales.shape[0] != codes.shape[0]
        ):
            raise ConfigError(
                f"Fp8Table scales must be float32[{codes.shape[0]}] (one per row of codes), "
                f"got {_describe(scales)}"
            )
        if is_device_array(codes) != is_device_array(scales):
            raise ConfigError(
                f"Fp8Table codes and scales must live on one device, got {_describe(codes)} "
                f"and {_describe(scales)}"
            )
        self.codes = codes
        self.scales = scales

    @classmethod
    def quantize(cls, array: Any) -> Fp8Table:
        """Quantize a bfloat16 (or float32) table on load, per row absmax.

        ``rowcache.kernels.quantize_fp8``: the store's FP8 rule (scale = amax / 448, 1 where
        that is 0: an all-zero row or one below ~3e-43; codes = satfinite E4M3 of
        ``x / scale``), on the GPU for a cupy array and bit-identical to the NumPy reference.
        """
        if not hasattr(array, "ndim") or array.ndim != 2 or array.dtype not in (BF16, _F32):
            raise ConfigError(
                f"Fp8Table.quantize takes a bfloat16 or float32 [rows, dim] array, "
                f"got {_describe(array)}"
            )
        codes, scales = rowcache.kernels.quantize_fp8(array)
        return cls(codes, scales)

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def dim(self) -> int:
        return int(self.codes.shape[1])

    @property
    def device(self) -> str:
        return _device_of(self.codes)

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scales.nbytes)

    def to(self, device: str) -> Fp8Table:
        """This table on ``device``; self when already there."""
        codes = _to_device(self.codes, device)
        if codes is self.codes:
            return self
        return Fp8Table(codes, _to_device(self.scales, device))

    @property
    def arrays(self) -> tuple[Any, Any]:
        """``(codes, scales)``: what ``rowcache.kernels.ngram.stacked.StackedTables`` reads."""
        return self.codes, self.scales

    def gather(self, ids: Any, out: Any = None) -> Any:
        """Dequantized rows: ids int[n] -> bfloat16[n, d] (``rowcache.kernels.batched_embed_fp8``)."""
        return rowcache.kernels.batched_embed_fp8(ids, self.codes, self.scales, out)

    def end_step(self) -> None:
        """Nothing to release for a resident table."""

    def end_batch(self) -> None:
        """Deprecated alias of :meth:`end_step`, kept for one release."""

    def __repr__(self) -> str:
        return f"Fp8Table(rows={self.rows}, dim={self.dim}, device={self.device!r})"


class Fp8TableScaleTable:
    """A resident FP8 table of the ``fp8_table_scale`` codec: E4M3 codes, ONE bf16 scale.

    The "resident" counterpart of a cache over an ``fp8_table_scale`` store (what a
    checkpoint such as Qwen3.8-Flash-Next's FP8 release ships): rows gather as
    ``bf16_rn(bf16(code) * scale)`` through ``rowcache.kernels.batched_embed_fp8_table_scale``,
    the kernel a cache's arena is read with.

    Parameters
    ----------
    codes : uint8[rows, d] (or float8_e4m3fn, viewed as its bytes), numpy or cupy
        E4M3 bit patterns.
    scale : one finite bfloat16 value (a ``ml_dtypes.bfloat16``, a float that is exactly
        one, a one-value array); never rounded.
    """

    kind = "fp8_table_scale"
    codec = get_codec("fp8_table_scale")

    def __init__(self, codes: Any, scale: Any) -> None:
        if hasattr(codes, "dtype") and codes.dtype == np.dtype("float8_e4m3fn"):
            codes = codes.view(np.uint8)
        if not hasattr(codes, "ndim") or codes.ndim != 2 or codes.dtype != _U8:
            raise ConfigError(
                f"Fp8TableScaleTable codes must be uint8[rows, dim] E4M3 codes, "
                f"got {_describe(codes)}"
            )
        self.codes = codes
        self.params = table_scale_params(scale, "Fp8TableScaleTable scale")

    @property
    def scale(self) -> np.ndarray:
        """The table's scale, a 0-d bfloat16 array."""
        return Fp8TableScaleCodec.scale(self.params)

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def dim(self) -> int:
        return int(self.codes.shape[1])

    @property
    def device(self) -> str:
        return _device_of(self.codes)

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes)

    def to(self, device: str) -> Fp8TableScaleTable:
        """This table on ``device``; self when already there."""
        codes = _to_device(self.codes, device)
        return self if codes is self.codes else Fp8TableScaleTable(codes, self.scale)

    @property
    def arrays(self) -> tuple[Any, None]:
        """``(codes, None)``: ``rowcache.kernels.ngram.stacked.StackedTables`` refuses it
        (the fused step reads bf16 rows or per-row-scaled codes), with a ConfigError."""
        return self.codes, None

    def gather(self, ids: Any, out: Any = None) -> Any:
        """Dequantized rows: ids int[n] -> bfloat16[n, d]."""
        return self.codec.gather(ids, self.codes, None, self.params, out)

    def end_step(self) -> None:
        """Nothing to release for a resident table."""

    def end_batch(self) -> None:
        """Deprecated alias of :meth:`end_step`, kept for one release."""

    def __repr__(self) -> str:
        return (
            f"Fp8TableScaleTable(rows={self.rows}, dim={self.dim}, "
            f"scale={self.params['scale']!r}, device={self.device!r})"
        )


class Fp8BlockScaleTable:
    """A resident FP8 table of the ``fp8_block_e8m0`` codec: E4M3 codes and one UE8M0 scale
    byte a block of values, as DeepSeek-V4.1's checkpoint ships its Engram tables.

    The "resident" counterpart of a cache over an ``fp8_block_e8m0`` store (also what the
    engines hold: the two tensors, in device or pinned host memory): value ``j`` of a row
    gathers as ``bf16_rn(e4m3(code_j) * 2**(e_{j // B} - 127))`` through
    ``rowcache.kernels.batched_embed_fp8_block``, the kernel a cache's arena is read with.

    Parameters
    ----------
    codes : uint8[rows, d] (or float8_e4m3fn, viewed as its bytes), numpy or cupy
        E4M3 bit patterns (a memory map of a checkpoint's tensor is read in place).
    scales : uint8[rows, d / B] (or float8_e8m0fnu), on the device of ``codes``
        UE8M0 bytes, one a block of ``B`` values; kept verbatim (0 is ``2**-127``, 255 NaN).
    block_size : B; None takes ``d / scales.shape[1]``, given it is checked against it.
    """

    kind = "fp8_block_e8m0"
    codec = get_codec("fp8_block_e8m0")

    def __init__(self, codes: Any, scales: Any, block_size: int | None = None) -> None:
        codes = _bytes_view(codes, _E4M3)
        scales = _bytes_view(scales, _E8M0)
        if not hasattr(codes, "ndim") or codes.ndim != 2 or codes.dtype != _U8:
            raise ConfigError(
                f"Fp8BlockScaleTable codes must be uint8[rows, dim] E4M3 codes, "
                f"got {_describe(codes)}"
            )
        rows, dim = int(codes.shape[0]), int(codes.shape[1])
        if (
            not hasattr(scales, "ndim")
            or scales.ndim != 2
            or scales.dtype != _U8
            or scales.shape[0] != rows
            or scales.shape[1] < 1
        ):
            raise ConfigError(
                f"Fp8BlockScaleTable scales must be uint8[{rows}, dim / block] UE8M0 bytes (one "
                f"row a row of codes), got {_describe(scales)}"
            )
        if is_device_array(codes) != is_device_array(scales):
            raise ConfigError(
                f"Fp8BlockScaleTable codes and scales must live on one device, got "
                f"{_describe(codes)} and {_describe(scales)}"
            )
        blocks = int(scales.shape[1])
        if block_size is None and dim % blocks == 0:
            block_size = dim // blocks
        self.params = block_scale_params(block_size, dim, "Fp8BlockScaleTable block_size")
        if dim // self.params["block_size"] != blocks:
            raise ConfigError(
                f"Fp8BlockScaleTable scales have {blocks} bytes a row; rows of {dim} codes in "
                f"blocks of {self.params['block_size']} need {dim // self.params['block_size']}"
            )
        self.codes = codes
        self.scales = scales

    @property
    def block_size(self) -> int:
        """Values one scale byte covers."""
        return int(self.params["block_size"])

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def dim(self) -> int:
        return int(self.codes.shape[1])

    @property
    def device(self) -> str:
        return _device_of(self.codes)

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scales.nbytes)

    def to(self, device: str) -> Fp8BlockScaleTable:
        """This table on ``device``; self when already there."""
        codes = _to_device(self.codes, device)
        if codes is self.codes:
            return self
        return Fp8BlockScaleTable(codes, _to_device(self.scales, device), self.block_size)

    @property
    def arrays(self) -> tuple[Any, None]:
        """``(codes, None)``: ``rowcache.kernels.ngram.stacked.StackedTables`` refuses it
        (the fused step reads bf16 rows or per-row-scaled codes), with a ConfigError."""
        return self.codes, None

    def gather(self, ids: Any, out: Any = None) -> Any:
        """Dequantized rows: ids int[n] -> bfloat16[n, d]."""
        return rowcache.kernels.batched_embed_fp8_block(ids, self.codes, self.scales, out)

    def end_step(self) -> None:
        """Nothing to release for a resident table."""

    def end_batch(self) -> None:
        """Deprecated alias of :meth:`end_step`, kept for one release."""

    def __repr__(self) -> str:
        return (
            f"Fp8BlockScaleTable(rows={self.rows}, dim={self.dim}, "
            f"block_size={self.block_size}, device={self.device!r})"
        )


def _bytes_view(a: Any, fp8: np.dtype) -> Any:
    """``a`` viewed as its bytes (uint8) where it is an array of the one-byte ``fp8`` dtype."""
    return a.view(np.uint8) if getattr(a, "dtype", None) == fp8 else a


class CachedTable:
    """A table served through a row cache (``rowcache.NgramRowCache``).

    Parameters
    ----------
    cache : NgramRowCache
        Over one table of a store, or over several tables of one dim and dtype
        sharing one arena and LRU (``NgramRowCache(store, [t0, t1, ...], slots=...)``).
        Its arena (``cache.table``, and ``cache.scales`` for FP8 stores) lives on
        the CPU (NumPy) or the GPU (cupy).
    part : int
        Which of the cache's tables this is (``cache.parts[part]``); its rows are
        addressed in the cache as ``cache.row_offsets[part] + local_id``. Default 0,
        the only part of a single-table cache.

    Notes
    -----
    Step lifetime: :meth:`gather` resolves the ids (faulting misses in and pinning
    their slots) and gathers from the arena by slot. The slots stay pinned until
    :meth:`end_step`, which ``NgramEmbedding`` calls (through its ``StepRows``) once per
    ``embed`` call and cache, after every gather of the step (on the GPU, after the current stream has
    finished the gathers), so a fault of the next step can never overwrite a row
    still being read. ``NgramEmbedding`` resolves every part of one shared cache
    with a single ``resolve`` per step.
    """

    kind = "cached"

    def __init__(self, cache: Any, part: int = 0) -> None:
        for attr in ("resolve", "end_step", "table", "dtype"):
            if not hasattr(cache, attr):
                raise ConfigError(
                    f"CachedTable needs a rowcache.NgramRowCache, got {type(cache).__name__} "
                    f"(no {attr!r})"
                )
        # a shared cache has parts (and its .info raises); a single-table one may not
        parts = getattr(cache, "parts", None)
        parts = list(parts) if parts else [cache.info]
        if isinstance(part, bool) or not isinstance(part, (int, np.integer)):
            raise ConfigError(f"part={part!r} must be an int in [0, {len(parts)})")
        if not 0 <= part < len(parts):
            raise ConfigError(
                f"part={part} is out of range: the cache holds {len(parts)} table(s), "
                f"allowed 0..{len(parts) - 1}"
            )
        self.cache = cache
        self.part = int(part)
        self.info = parts[self.part]
        # the rows' codec: the store's (every part of a cache shares it); the part's params
        self.codec = get_codec(cache.dtype)
        self.params = dict(self.info.params)
        offsets = getattr(cache, "row_offsets", None)
        self.offset = int(offsets[self.part]) if offsets is not None else 0
        self._shared = len(parts) > 1

    @property
    def rows(self) -> int:
        return int(self.info.rows)

    @property
    def dim(self) -> int:
        return int(self.info.dim)

    @property
    def device(self) -> str:
        return _device_of(self.cache.table)

    @property
    def nbytes(self) -> int:
        """Bytes of the (possibly shared) arena, codes and scales; not of the table."""
        scales = self.cache.scales
        return int(self.cache.table.nbytes + (0 if scales is None else scales.nbytes))

    @property
    def arrays(self) -> tuple[Any, Any]:
        """``(arena, scales or None)``, read by slot; fixed for the cache's lifetime."""
        return self.cache.table, self.cache.scales

    def resolve(self, ids: Any) -> Any:
        """Arena slots (int32[n]) holding rows ``ids`` of this part, faulting misses
        in; pinned until :meth:`end_step`. Raises ``ArenaExhaustedError`` when the
        batch's distinct rows exceed the free slots."""
        if self._shared:  # range-checked against this part, not the whole arena
            ids = self.cache.global_ids(self.part, ids)
        return self.cache.resolve(ids)

    def gather_slots(self, slots: Any, out: Any = None) -> Any:
        """Rows of the arena at ``slots`` (from :meth:`resolve`): bfloat16[n, d], decoded
        by the cache's codec (``rowcache.format.codecs``) with this part's parameters."""
        return self.codec.gather(slots, self.cache.table, self.cache.scales, self.params, out)

    def gather(self, ids: Any, out: Any = None) -> Any:
        """Resolve ``ids`` to arena slots, then gather those slots: bfloat16[n, d].

        Part of the current step until :meth:`end_step`. Raises
        ``ArenaExhaustedError`` when the batch's distinct rows exceed the free slots.
        """
        return self.gather_slots(self.resolve(ids), out)

    def end_step(self) -> None:
        """Unpin the slots of this step (``cache.end_step()``; every part of a shared
        cache ends together)."""
        self.cache.end_step()

    def end_batch(self) -> None:
        """Deprecated alias of :meth:`end_step`, kept for one release."""
        self.end_step()

    def stats(self, reset: bool = False) -> Any:
        """The cache's ``CacheStats`` snapshot (of every part, for a shared cache)."""
        return self.cache.stats(reset=reset)

    def __repr__(self) -> str:
        return (
            f"CachedTable(rows={self.rows}, dim={self.dim}, part={self.part}, "
            f"slots={self.cache.table.shape[0]}, device={self.device!r})"
        )


Table = Bf16Table | Fp8Table | Fp8TableScaleTable | Fp8BlockScaleTable | CachedTable

__all__ = [
    "Bf16Table",
    "CachedTable",
    "Fp8BlockScaleTable",
    "Fp8Table",
    "Fp8TableScaleTable",
    "Table",
]
