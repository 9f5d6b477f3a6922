"""Input checks of the token-overlay kernels (launchers and references alike).

Owns the argument checks that raise ``ConfigError`` naming the argument, what was
given and what is allowed: bf16 matrices, int vectors, routing (``seq_slot`` /
``active``), thresholds, logits, per-adapter lists and the device tables of the
launchers. Computes nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels.loader import is_device_array
from rowcache.kernels.reference import BF16


def describe_array(a: Any) -> str:
    if a is None:
        return "None"
    dtype = getattr(a, "dtype", None)
    shape = getattr(a, "shape", None)
    if dtype is None or shape is None:
        return type(a).__name__
    return f"{type(a).__module__.split('.')[0]} {dtype}{list(shape)}"


def check_bf16_2d(name: str, a: Any, *, rows: int | None = None, cols: int | None = None) -> None:
    """Raise ConfigError unless ``a`` is a C-contiguous bfloat16 ``[rows, cols]`` array."""
    if getattr(a, "ndim", None) != 2 or a.dtype != BF16:
        raise ConfigError(f"{name} must be a 2-D bfloat16 array, got {describe_array(a)}")
    if rows is not None and a.shape[0] != rows:
        raise ConfigError(f"{name} must have {rows} rows, got {describe_array(a)}")
    if cols is not None and a.shape[1] != cols:
        raise ConfigError(f"{name} must have {cols} columns, got {describe_array(a)}")
    if not a.flags.c_contiguous:
        raise ConfigError(f"{name} must be C-contiguous (it is written or read by row)")


def check_int_1d(name: str, a: Any, *, length: int | None = None) -> None:
    """Raise ConfigError unless ``a`` is a 1-D integer array (of ``length`` when given)."""
    if getattr(a, "ndim", None) != 1 or a.dtype.kind not in "iu":
        raise ConfigError(f"{name} must be a 1-D integer array, got {describe_array(a)}")
    if length is not None and a.shape[0] != length:
        raise ConfigError(
            f"{name} must have {length} entries (one per row), got {describe_array(a)}"
        )


def check_route(seq_slot: Any, active: Any, n: int) -> int:
    """Validate the routing arguments shared by both overlays; returns ``active`` as int."""
    if seq_slot is not None:
        check_int_1d("seq_slot", seq_slot, length=n)
    if isinstance(active, bool):
        raise ConfigError(f"active must be an int adapter slot (or -1 for none), got {active!r}")
    try:
        act = operator.index(active)
    except TypeError:
        raise ConfigError(
            f"active must be an int adapter slot (or -1 for none), got {active!r}"
        ) from None
    if not -(2**31) <= act < 2**31:
        raise ConfigError(f"active must fit in int32, got {act}")
    return act


def check_thresh(thresh: Any) -> np.float32:
    t = np.float32(thresh)
    if not np.isfinite(t) or t < 0:
        raise ConfigError(f"thresh must be a finite float >= 0, got {thresh!r}")
    return t


def check_pair(base: Any, served: Any) -> None:
    check_bf16_2d("base", base)
    check_bf16_2d("served", served)
    if base.shape != served.shape:
        raise ConfigError(
            f"base and served must have the same shape, got {describe_array(base)} "
            f"and {describe_array(served)}; compare the rows both have (slice them first)"
        )


def check_logits(logits: Any, n: int) -> None:
    if getattr(logits, "ndim", None) != 2 or logits.dtype not in (np.dtype(np.float32), BF16):
        raise ConfigError(
            f"logits must be a 2-D float32 or bfloat16 array, got {describe_array(logits)}"
        )
    if logits.shape[0] != n:
        raise ConfigError(
            f"logits must have {n} rows (one per hidden row), got {describe_array(logits)}"
        )


def _adapters(name: str, tables: Sequence[Any]) -> list[Any]:
    if isinstance(tables, (str, bytes)) or not isinstance(tables, Sequence):
        raise ConfigError(f"{name} must be a sequence with one entry per adapter, got {tables!r}")
    return list(tables)


def paired_adapters(
    names: tuple[str, str], a: Sequence[Any], b: Sequence[Any]
) -> tuple[list[Any], list[Any]]:
    """Two per-adapter lists (``_adapters``) of one length each, e.g. ids and rows."""
    la, lb = _adapters(names[0], a), _adapters(names[1], b)
    if len(la) != len(lb):
        raise ConfigError(
            f"{names[0]} and {names[1]} must have one entry per adapter each, "
            f"got {len(la)} and {len(lb)}"
        )
    return la, lb


def route_slots(seq_slot: Any, act: int, n: int) -> np.ndarray:
    """int64[n]: each row's adapter slot (``act`` for every row when ``seq_slot`` is None)."""
    return np.full(n, act, np.int64) if seq_slot is None else np.asarray(seq_slot, np.int64)


def check_packed_call(
    hidden: Any, seq_slot: Any, active: Any, rows_all: Any, logits: Any, extra: tuple = ()
) -> tuple[int, int, int]:
    """The checks the packed-table LM-head launchers share: ``hidden`` bfloat16[n, h],
    ``rows_all`` bfloat16[cap, h], ``logits`` [n, n_cols] C-contiguous and the
    ``extra`` (name, array) pairs all cupy; the routing. Returns ``(n, h, active)``."""
    check_bf16_2d("hidden", hidden)
    n, hidden_size = hidden.shape
    for name, a in (("hidden", hidden), ("rows_all", rows_all), ("logits", logits), *extra):
        if not is_device_array(a):
            raise ConfigError(f"{name} must be a cupy array here, got {describe_array(a)}")
    check_logits(logits, n)
    if not logits.flags.c_contiguous:
        raise ConfigError(f"logits must be C-contiguous, got {describe_array(logits)}")
    act = check_route(seq_slot, active, n)
    check_bf16_2d("rows_all", rows_all, cols=hidden_size)
    return n, hidden_size, act


def check_table(name: str, a: Any, dtype: Any, length: int) -> None:
    if not is_device_array(a) or a.ndim != 1 or a.dtype != dtype or a.shape[0] != length:
        want = "L" if length < 0 else str(length)
        raise ConfigError(
            f"{name} must be a cupy {np.dtype(dtype)}[{want}] array (one entry per adapter), "
            f"got {describe_array(a)}"
        )
