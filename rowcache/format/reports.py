"""The JSON reports' format: their names and versions, the table shape they carry, and the
check every reader of one runs.

Owns the contract of the three reports one command writes and another reads
(``rowcache profile -o`` -> ``tune``; ``bench-io -o`` -> ``tune --disk``; ``tune -o`` ->
``from_pretrained(tune=...)``): each carries ``"format"`` (:data:`PROFILE`, :data:`TUNE`,
:data:`BENCH_IO`) and ``"version"`` (:data:`VERSIONS`), and the profile and tune reports
the shape of the tables they were made for (``"shape"``: table name -> rows). A reader calls
:func:`check_report`: another report, or a newer version, is refused naming the file; a
report from before versions existed is read as version 1 and, read from a file, warned
about once (:func:`warn_unversioned`). Comparing a report's shape with what it is applied
to is the applier's (``rowcache.embed.tune_report``); :func:`describe_shape` words both
sides. Here beside the store's layout because both are what rowcache writes for itself to
read back; no I/O here either.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from rowcache.errors import ConfigError

PROFILE = "rowcache.profile"
TUNE = "rowcache.tune"
BENCH_IO = "rowcache.bench-io"
#: the version each report is written at, and the newest each reader reads
VERSIONS: dict[str, int] = {PROFILE: 1, TUNE: 1, BENCH_IO: 1}
#: what each report is, as a message names it
WHAT: dict[str, str] = {
    PROFILE: "a fault-rate profile (from `rowcache profile -o`)",
    TUNE: "a tune report (from `rowcache tune -o`)",
    BENCH_IO: "a disk profile (from `rowcache bench-io -o`)",
}


def stamp(kind: str) -> dict[str, Any]:
    """``{"format": kind, "version": VERSIONS[kind]}``: the first keys of a report."""
    return {"format": kind, "version": VERSIONS[kind]}


def check_report(d: Mapping[str, Any], kind: str, source: str) -> bool:
    """Whether the report ``d`` (read from ``source``) is a versioned ``kind`` report
    (False: one from before versions existed, read as version 1).

    Raises
    ------
    ConfigError
        ``d`` is another kind of report, or a version this rowcache cannot read (a newer
        one, or not a positive integer), naming ``source``.
    """
    fmt, ver = d.get("format"), d.get("version")
    if fmt is None and ver is None:
        return False
    if fmt != kind:
        other = WHAT.get(fmt) if isinstance(fmt, str) else None
        raise ConfigError(f"{source} is {other or f'a report of format {fmt!r}'}, not {WHAT[kind]}")
    newest = VERSIONS[kind]
    if isinstance(ver, bool) or not isinstance(ver, int) or ver < 1:
        raise ConfigError(f"{source}: 'version' {ver!r} is not a report version (1..{newest})")
    if ver > newest:
        raise ConfigError(
            f"{source}: {WHAT[kind]} of version {ver}, made by a newer rowcache; this one reads "
            f"versions 1..{newest}: upgrade rowcache, or remake the report with this one"
        )
    return True


def warn_unversioned(source: str, kind: str, unchecked: str) -> None:
    """Warn that ``source`` is a ``kind`` report from before reports carried a version,
    so that ``unchecked`` (what a version and shape would have let the reader check) is not."""
    warnings.warn(
        f"{source}: {WHAT[kind]} without a format version, made before reports were "
        f"versioned: read as version 1, {unchecked}; remake it to record its version and shape",
        UserWarning,
        stacklevel=3,
    )


def read_shape(d: Mapping[str, Any], source: str) -> dict[str, int] | None:
    """A report's ``"shape"`` (table name -> rows), checked; None where it has none."""
    shape = d.get("shape")
    if shape is None:
        return None
    if not isinstance(shape, Mapping) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 1
        for k, v in shape.items()
    ):
        raise ConfigError(f"{source}: 'shape' must map table names to their rows (integers >= 1)")
    return dict(shape)


def describe_shape(shape: Mapping[str, int]) -> str:
    """``shape`` in a few words: ``"tables 0 (1,537 rows), 1 (1,539 rows)"`` or, for more
    than three tables, ``"12 tables 0..11 of 10,223,617 to 10,223,639 rows"``."""
    if not shape:
        return "no tables"
    if len(shape) <= 3:
        return "tables " + ", ".join(f"{k} ({v:,} rows)" for k, v in shape.items())
    names, rows = list(shape), list(shape.values())
    lo, hi = min(rows), max(rows)
    span = f"{lo:,} rows" if lo == hi else f"{lo:,} to {hi:,} rows"
    return f"{len(shape)} tables {names[0]}..{names[-1]} of {span}"


__all__ = [
    "BENCH_IO",
    "PROFILE",
    "TUNE",
    "VERSIONS",
    "check_report",
    "describe_shape",
    "read_shape",
    "stamp",
    "warn_unversioned",
]
