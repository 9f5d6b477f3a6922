"""Page checksums of shard files: CRC32C (Castagnoli) of each 4096-byte page.

Owns the one definition the builder (writing them) and the reader (checking them) share:
``crc32c(page, 0)`` as the PyPI ``crc32c`` package computes it, for every 4096-byte page of
a file, the last page being whatever bytes remain. Computed by ``rowcache.io._rcio`` (one C
loop over all pages, the GIL released) where it is built, else by the ``crc32c`` package.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from rowcache.kernels import extensions

PAGE = 4096

# no compiler on this platform: the crc32c package, same values (the first use warns once)
_rcio: Any = extensions.load("rowcache.io._rcio")


def page_crcs(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """uint32[ceil(len / 4096)]: crc32c of each 4096-byte page of ``data`` (a bytes-like
    object or a C-contiguous array, read as its raw bytes)."""
    arr = (
        np.ascontiguousarray(data)
        if isinstance(data, np.ndarray)
        else np.frombuffer(data, np.uint8)
    )
    mv = arr.reshape(-1).view(np.uint8)
    out = np.empty(-(-mv.size // PAGE), dtype=np.uint32)
    if _rcio is not None:
        _rcio.page_crcs(mv, out)
        return out
    import crc32c

    extensions.fallback("rowcache.io._rcio")
    for j in range(out.size):  # the package has no batch call: one call per page
        out[j] = crc32c.crc32c(mv[j * PAGE : (j + 1) * PAGE].tobytes())
    return out


def page_crcs_of_file(path: str | os.PathLike[str], chunk_pages: int = 4096) -> np.ndarray:
    """uint32[pages]: crc32c of each 4096-byte page of the file at ``path``, read in
    chunks of ``chunk_pages`` pages (bounded memory)."""
    parts = []
    with open(path, "rb") as f:  # buffered: read(n) returns n bytes until the end of file
        while True:
            buf = f.read(chunk_pages * PAGE)
            if not buf:
                break
            parts.append(page_crcs(buf))
            if len(buf) < chunk_pages * PAGE:
                break
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint32)
