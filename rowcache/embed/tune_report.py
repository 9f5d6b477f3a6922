"""A ``rowcache tune`` report where it is applied: slots per table, checked against the tables.

Owns :func:`tune_slots`, which reads a report (its file, its dict or a ``TuneReport``) and
checks it: its format and version (``rowcache.format.reports``: another report or a newer
version refused), its slots, and, given the tables it is applied to, its shape: a report
made for other tables is refused in one line naming the file and both shapes. (A tune.json
made for 10.2M-row tables, applied to a 1.5K-row checkpoint, once clamped 1,033,594 slots to
1,537 without a word.) A report file from before reports were versioned, or one whose
profile did not state its tables, cannot be checked: it is read with a warning, which says
where its slots exceed the tables' rows. Choosing the caches from the slots is the
loader's (``rowcache.embed.checkpoint.load_pretrained``).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

from rowcache.errors import ConfigError
from rowcache.format import reports

SHARED = "shared"  # a tune report's entry for one arena over every cached table


def _read(report: Any) -> tuple[str, Any, bool]:
    """``(source, the report's dict, whether it came from a file)``."""
    if isinstance(report, (str, os.PathLike)):
        source = os.fspath(report)
        try:
            with open(report, encoding="utf-8") as f:
                return source, json.load(f), True
        except (OSError, ValueError, RecursionError) as e:
            raise ConfigError(f"tune={source!r}: not a readable JSON file ({e})") from e
    d = report.to_dict() if hasattr(report, "to_dict") else report
    return "the tune report", d, False


def tune_slots(report: Any, *, table_rows: Mapping[str, int] | None = None) -> dict[str, int]:
    """Arena rows per table from a ``rowcache tune`` report, checked.

    Parameters
    ----------
    report : ``TuneReport``, its ``to_dict()``, or the path of ``rowcache tune -o`` (or
        ``--json``) output.
    table_rows : ``{table name: rows}`` of the tables the report is applied to (every table
        of the model, named as the profile named them: ``"0" .. "T-1"``), or None to skip
        the shape check.

    Returns
    -------
    ``{table name: slots}``: the names ``"0" .. "T-1"`` (or ``"shared"`` for one arena
    over every table) of the profile.

    Raises
    ------
    ConfigError
        Not a tune report, a newer version, slots that are not integers, or (given
        ``table_rows``) a report made for tables of another shape: one line naming the
        file, the shape it was made for and the shape it is applied to.
    """
    source, d, from_file = _read(report)
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: not a report of `rowcache tune -o` (not a JSON object)")
    versioned = reports.check_report(d, reports.TUNE, source)
    rows = d.get("rows")
    if not isinstance(rows, Mapping) or not rows:
        raise ConfigError(f"{source}: not a report of `rowcache tune -o` (no 'rows' per table)")
    try:
        slots = {str(k): int(v) for k, v in rows.items()}
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: 'rows' must map table names to ints ({e})") from e
    if table_rows is None:
        return slots
    applied = {str(k): int(v) for k, v in table_rows.items()}
    shape = reports.read_shape(d, source) if versioned else None
    if shape is not None:
        if shape != applied:
            raise ConfigError(
                f"{source} was made for {reports.describe_shape(shape)}, and is applied to "
                f"{reports.describe_shape(applied)}: tune a profile of these tables (rowcache "
                "trace --config with this model's config.json, then profile -o and tune -o)"
            )
        return slots
    if from_file:
        _warn_unchecked(source, versioned, slots, applied)
    return slots


def _warn_unchecked(
    source: str, versioned: bool, slots: Mapping[str, int], applied: Mapping[str, int]
) -> None:
    """A report whose shape is unknown: say so, and where its slots exceed the rows."""
    over = [k for k, v in slots.items() if k in applied and v > applied[k]]
    if SHARED in slots and slots[SHARED] > sum(applied.values()):
        over.append(SHARED)
    unchecked = f"its slots unchecked against {reports.describe_shape(applied)}" + (
        f"; its slots exceed the rows of table(s) {', '.join(over)}, which get all their rows: "
        "it was likely made for larger tables"
        if over
        else ""
    )
    if not versioned:
        reports.warn_unversioned(source, reports.TUNE, unchecked)
        return
    warnings.warn(
        f"{source}: a tune report whose profile did not state its tables' rows: {unchecked}",
        UserWarning,
        stacklevel=4,
    )


__all__ = ["SHARED", "tune_slots"]
