"""Table sources for the builder: in-memory arrays, ``.npy`` files, ``.safetensors`` tensors.

Owns turning what a user hands ``build_store`` into a uniform streaming reader
(``rows``, ``dim``, ``read(start, stop)``). ``.npy`` and ``.safetensors`` are
memory-mapped, never loaded whole, so a 63 GB table set streams through a bounded
amount of memory. Does not convert or quantize; the builder does.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from rowcache.errors import ConfigError, FormatError

BF16 = np.dtype(ml_dtypes.bfloat16)

_ST_DTYPES = {"BF16": BF16, "F32": np.dtype("<f4"), "F16": np.dtype("<f2")}


@dataclass(frozen=True)
class Source:
    """A 2-D table to stream: ``array`` is in memory or memory-mapped, never copied whole."""

    name: str
    array: np.ndarray
    origin: str

    @property
    def rows(self) -> int:
        return int(self.array.shape[0])

    @property
    def dim(self) -> int:
        return int(self.array.shape[1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as bf16 or float32 (float16 is widened to float32)."""
        block = self.array[start:stop]
        if block.dtype == np.float16:
            return block.astype(np.float32)
        # A private copy: writing straight from a memory map faults its pages in inside
        # write(2) and runs at a third of the speed of writing from anonymous memory.
        return np.array(block, copy=True)

    def view(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` without a copy where the dtype allows (bf16, float32):
        for consumers that read every value once (the FP8 quantize), a private copy is
        one more pass over memory. float16 is widened to float32, as by :meth:`read`."""
        block = self.array[start:stop]
        if block.dtype == np.float16:
            return block.astype(np.float32)
        return block


def _as_table_array(arr: np.ndarray, name: str, origin: str) -> np.ndarray:
    if arr.dtype == np.uint16 or arr.dtype == np.dtype("V2"):
        arr = arr.view(BF16)
    if arr.dtype not in (BF16, np.float32, np.float16):
        raise ConfigError(
            f"tables[{name!r}]: dtype {arr.dtype} from {origin} is not supported; "
            "allowed: bfloat16 (or its uint16 view), float32, float16"
        )
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ConfigError(
            f"tables[{name!r}]: expected a 2-D [rows, dim] table with rows, dim >= 1, "
            f"got shape {tuple(arr.shape)} from {origin}"
        )
    return arr


def safetensors_header(path: str) -> dict[str, Any]:
    """The JSON header of a ``.safetensors`` file, plus ``"__data_start__"`` (its data offset).

    The format is an 8-byte little-endian header length, a JSON header mapping
    names to ``dtype``, ``shape`` and ``data_offsets``, then the raw data.
    """
    try:
        with open(path, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(hlen))
    except (OSError, struct.error, ValueError) as e:
        raise FormatError(f"{path}: not a readable .safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise FormatError(f"{path}: not a readable .safetensors file (header is not an object)")
    header["__data_start__"] = 8 + hlen
    return dict(header)


def safetensors_tensor(path: str, tensor: str) -> np.ndarray:
    """Memory-map one tensor of a ``.safetensors`` file (BF16, F32 or F16) without loading it."""
    header = safetensors_header(path)
    if tensor not in header:
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
            f"{path}:{tensor}: dtype {spec['dtype']} is not supported; allowed: {sorted(_ST_DTYPES)}"
        )
    start, stop = spec["data_offsets"]
    shape = tuple(spec["shape"])
    count = int(np.prod(shape)) if shape else 1
    if stop - start != count * dtype.itemsize:
        raise FormatError(f"{path}:{tensor}: data_offsets do not match shape {shape}")
    return np.memmap(
        path, dtype=dtype, mode="r", offset=header["__data_start__"] + start, shape=shape
    )


def resolve_source(name: str, src: Any) -> Source:
    """A :class:`Source` from an array, a ``.npy`` path, or ``(file.safetensors, tensor)``.

    A string ``"file.safetensors:tensor.name"`` is accepted as well.
    """
    if isinstance(src, np.ndarray):
        return Source(name, _as_table_array(src, name, "array"), "array")
    if isinstance(src, str) and ".safetensors:" in src:
        path, tensor = src.split(".safetensors:", 1)
        src = (path + ".safetensors", tensor)
    if isinstance(src, tuple) and len(src) == 2:
        path, tensor = src
        if not os.path.exists(path):
            raise ConfigError(f"tables[{name!r}]: file {path!r} does not exist")
        arr = safetensors_tensor(os.fspath(path), tensor)
        return Source(name, _as_table_array(arr, name, f"{path}:{tensor}"), f"{path}:{tensor}")
    if isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        if not os.path.exists(path):
            raise ConfigError(f"tables[{name!r}]: file {path!r} does not exist")
        if not path.endswith(".npy"):
            raise ConfigError(
                f"tables[{name!r}]: {path!r} is neither a .npy file nor "
                "'file.safetensors:tensor' / (file.safetensors, tensor)"
            )
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise FormatError(f"{path}: not a readable .npy file ({e})") from e
        return Source(name, _as_table_array(arr, name, path), path)
    raise ConfigError(
        f"tables[{name!r}]: a source of type {type(src).__name__} is not supported; allowed: "
        "2-D numpy array, .npy path, (file.safetensors, tensor name)"
    )
