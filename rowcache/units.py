"""Byte sizes as users write them: ``"121GiB"``, ``"12G"``, ``"20e9"``.

Owns :func:`parse_bytes` (binary units, as every report prints; ``GB``-style units refused
as ambiguous) for every layer that takes a memory budget: the checkpoint loader, the tools
and the CLI. Nothing here knows a store or a cache.
"""

from __future__ import annotations

import re

import numpy as np

from rowcache.errors import ConfigError

# Binary units, as every report prints sizes (KiB, MiB, GiB): a bare K, M, G, T is the
# same as KiB, MiB, GiB, TiB. The SI spellings KB, MB, GB, TB are refused: "12GB" would
# otherwise read as 10^9 bytes beside reports in GiB (7% less than it looks).
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
}
_SI = {"kb": "KiB", "mb": "MiB", "gb": "GiB", "tb": "TiB"}
MAX_BYTES = 1 << 62


def parse_bytes(text: str | int, name: str = "size") -> int:
    """``"121GiB"``, ``"12G"`` (= 12 GiB), ``"1.5TiB"``, ``"4096"`` or ``"20e9"`` bytes -> int.

    Units are binary (K = KiB = 2^10, ... T = TiB = 2^40), as the reports print;
    ``KB``/``MB``/``GB``/``TB`` are refused as ambiguous. ``name`` labels errors.
    """
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        v = int(text)
        if not 0 <= v <= MAX_BYTES:
            raise ConfigError(f"{name}: {v} bytes is outside [0, 2^62]")
        return v
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m and unit in _SI:
        k = list(_SI).index(unit) + 1
        raise ConfigError(
            f"{name}: {text!r} is ambiguous (10^{3 * k} or 2^{10 * k} bytes?); write "
            f"{m.group(1)}{_SI[unit]} (or {m.group(1)}{_SI[unit][0]}: units are binary, as "
            f"reports print) or a byte count such as {m.group(1)}e{3 * k}"
        )
    if not m or unit not in _UNITS:
        raise ConfigError(
            f"{name}: {text!r} is not a size; use bytes (4096, 20e9) or a number with "
            "K, M, G, T or KiB, MiB, GiB, TiB (binary: G = GiB = 2^30 bytes)"
        )
    size = float(m.group(1)) * _UNITS[unit]
    if not size <= MAX_BYTES:  # also inf
        raise ConfigError(f"{name}: {text!r} is more than 2^62 bytes")
    return int(size)
