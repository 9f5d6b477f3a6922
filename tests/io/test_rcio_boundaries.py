"""The I/O engine's extension (``rowcache.io._rcio``) refuses a layout or a batch that does
not fit, with a one-line error, never a signal. Each attack runs in a child process."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rowcache.io.native import NATIVE_BUILT, ReadStatus

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "rcio_status.h"

pytestmark = pytest.mark.skipif(not NATIVE_BUILT, reason="rowcache.io._rcio is not built")

SETUP = """
import os, tempfile
import numpy as np
from rowcache.io import _rcio

fd = os.open(tempfile.mkstemp()[1], os.O_RDWR)
os.ftruncate(fd, 1 << 20)
i64 = lambda *v: np.array(v, dtype=np.int64)

def layout(rows=1000, rpp=1, pps=10, file_base=(0, 100), nfds=100, crc=None, crc_base=None):
    r = _rcio.Reader(4, "threads")
    fds = np.full(nfds, fd, dtype=np.int32)
    r.set_layout(i64(rows), i64(rpp), i64(pps), i64(4096), i64(64), i64(*file_base), fds,
                 crc, crc_base, 0, 1 << 20, False)
    return r

def attempt(name, f):
    try:
        f()
        print(name, "accepted")
    except ValueError as e:
        print(name, "refused:", e)
"""


def run_child(code: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", SETUP + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode} (a signal if < 0): {proc.stderr}"
    return proc.stdout.splitlines()


def test_set_layout_refuses_files_that_do_not_cover_the_rows():
    lines = run_child(
        """
        layout()  # 1,000 rows, one a page, 10 pages a shard: 100 files
        print("good layout accepted")
        attempt("one file for 100 shards", lambda: layout(file_base=(0, 1), nfds=1))
        attempt("bases not from 0", lambda: layout(file_base=(5, 100)))
        attempt("two records over a page", lambda: layout(rpp=100))
        attempt("crc_base falling", lambda: layout(
            crc=np.zeros(10, np.uint32), crc_base=np.array([0] + [9] * 50 + [3] * 49 + [10])))
        """
    )
    assert lines[0] == "good layout accepted", lines
    assert all(" refused: set_layout:" in ln for ln in lines[1:]) and len(lines) == 5, lines


def test_read_runs_refuses_rows_without_parts():
    lines = run_child(
        """
        r = layout()
        out = np.zeros(64 * 3, dtype=np.uint8)
        empty = np.zeros(0, dtype=np.int64)
        attempt("rows, no parts", lambda: r.read_runs(
            i64(1, 2, 3), i64(0), np.zeros(0, np.int32), empty, out, False))
        st = r.read_runs(i64(1, 2, 3), i64(0, 3), np.zeros(1, np.int32), i64(0), out, False)
        print("a good batch:", st.status)
        """
    )
    assert lines[0].startswith("rows, no parts refused: read_runs:"), lines
    assert lines[1] == "a good batch: 0", lines


def test_read_statuses_and_result_fields_agree_with_c():
    """``ReadStatus`` is ``csrc/rcio_status.h``'s, as the header writes it and as the module
    exports it; ``_rcio.BatchResult``'s fields are the header's ``RC_B_*``, in order."""
    from rowcache.io import _rcio

    for s in ReadStatus:
        assert getattr(_rcio, f"READ_{s.name}") == int(s), s.name
    text = HEADER.read_text()
    in_header = {name: int(v) for name, v in re.findall(r"\bRC_READ_(\w+) = (\d+)", text)}
    assert in_header == {s.name: int(s) for s in ReadStatus}
    fields = [f.lower() for f in re.findall(r"^\s+RC_B_(\w+)\b", text, re.M) if f != "N"]
    assert fields == list(_rcio.BatchResult.__match_args__), fields
    assert _rcio.BatchResult.n_fields == len(fields)
