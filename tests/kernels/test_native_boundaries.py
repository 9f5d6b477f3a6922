"""The native extensions refuse bad arguments at their boundary: a one-line error, never a
signal. Each attack runs in a child process, where a SIGSEGV or SIGFPE shows as what it is."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rowcache.kernels.host import native

pytestmark = pytest.mark.skipif(native is None, reason="rowcache.kernels._host is not built")


def run_child(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (a signal if < 0): {proc.stderr}"
    return proc.stdout


def test_hash_packed_refuses_a_table_of_no_rows_and_lengths_that_wrap():
    out = run_child(
        """
        import numpy as np
        from rowcache.errors import ConfigError
        from rowcache.kernels.host import hash_packed

        t = np.arange(10, dtype=np.int64)
        m = np.ones((2, 3), dtype=np.int64)
        big = 2**62
        cases = {
            "rows 0": (t, np.array([10]), np.array([3]), np.array([5, 0])),
            "wrapping ctx_lens": (t, np.array([big, big, big, big + 10]),
                                  np.array([1, 1, 1, 1]), np.array([5, 7])),
            "huge seq_lens": (t, np.array([10]), np.array([big]), np.array([5, 7])),
            "seq > ctx": (t, np.array([4, 6]), np.array([5, 1]), np.array([5, 7])),
        }
        for name, (tok, ctx, seq, rows) in cases.items():
            try:
                hash_packed(tok, ctx, seq, m, rows, 2)
            except ConfigError as e:
                print(name, "->", str(e).splitlines()[0])
            else:
                print(name, "-> accepted")
        """
    )
    lines = out.splitlines()
    assert len(lines) == 4 and not any(ln.endswith("accepted") for ln in lines), out
    assert "every table has >= 1 row" in lines[0]


def test_quantize_pages_refuses_sizes_that_overflow():
    out = run_child(
        """
        import numpy as np
        from rowcache.kernels import _quantize
        from rowcache.kernels.quantize import quantize_fp8_pages
        from rowcache.errors import ConfigError
        from rowcache.kernels.reference import BF16

        x = np.zeros((4, 8), dtype=np.uint16)
        pages = np.zeros(4096, dtype=np.uint8)
        M = 2**62
        for args in [
            (x, 2, 4, 8, pages, M, 1, 4096),       # first + rows wraps
            (x, 2, M, M, pages, 0, 1, 4096),       # rows * dim * itemsize wraps
            (x, 2, 4, 8, pages, 0, M, 4096),       # rows_per_page * record wraps
            (x, 2, 4, 8, pages, 0, 1, 0),          # no page
            (x, 2, 4, 8, pages, 2**40, 1, 4096),   # records past the pages
        ]:
            try:
                _quantize.quantize_pages(*args)
                print("accepted")
            except ValueError as e:
                print("refused:", e)
        try:
            quantize_fp8_pages(np.zeros((4, 8), BF16), pages, rows_per_page=1, page_bytes=4096,
                               first=-3)
            print("accepted")
        except ConfigError as e:
            print("refused:", e)
        """
    )
    lines = out.splitlines()
    assert len(lines) == 6 and all(ln.startswith("refused:") for ln in lines), out


def test_lru_touch_refuses_keys_that_are_not_row_ids():
    out = run_child(
        """
        import numpy as np
        from rowcache.kernels import _host

        S, n = 8, 4
        row_slot = np.full(16, -1, dtype=np.int32)
        last_used = np.zeros(S, dtype=np.int64)
        log = np.zeros(64, dtype=np.int32)
        log_pos = np.full(S, -1, dtype=np.int32)
        slot_row, state = np.full(S, -1, dtype=np.int32), np.zeros(S, dtype=np.uint8)
        lru = _host.LruState(row_slot, slot_row, state, last_used, log, log_pos,
                             np.array([0, 16], dtype=np.int64), np.zeros(1, dtype=np.int64))
        for keys in ([1, 2, 3, 1 << 30], [-5, 0, 1, 2]):
            scratch = np.zeros(2 * n, dtype=np.int32)
            scratch[:n] = keys
            try:
                h = lru.touch_start(scratch, n, 0, 0, 1, 1)
                res = h if isinstance(h, tuple) else _host.lru_touch_wait(h)
                print("accepted", res)
            except ValueError as e:
                print("refused:", e)
        print("untouched", int(last_used.sum()), int((log_pos != -1).sum()))
        """
    )
    lines = out.splitlines()
    assert (
        lines[:2]
        == [
            "refused: LruState.touch_start: a key in scratch is not a row id (0 <= key < rows)"
        ]
        * 2
    ), out
    assert lines[2] == "untouched 0 0", out


def test_row_hash_refuses_junk_arguments_with_one_line_errors():
    """RowHash (csrc/row_map.c) given wrong item sizes, strided or read-only buffers, lengths
    that differ, ids far outside its rows, and an LruState given a map of the wrong rows:
    ValueError or TypeError each time, the map unchanged, never a signal."""
    out = run_child(
        """
        import numpy as np
        from rowcache.kernels.host import native

        h = native.RowHash(1000, 64)
        h.set(np.arange(10, dtype=np.int64), np.arange(10, dtype=np.int32))
        ro = np.arange(4, dtype=np.int32); ro.flags.writeable = False
        cases = [
            lambda: h.get(np.arange(4, dtype=np.int32), np.empty(4, np.int32)),
            lambda: h.get(np.arange(8, dtype=np.int64)[::2], np.empty(4, np.int32)),
            lambda: h.get(np.arange(4, dtype=np.int64), ro),
            lambda: h.get(np.arange(4, dtype=np.int64), np.empty(3, np.int32)),
            lambda: h.get(np.array([2**40, -2**40], np.int64), np.empty(2, np.int32)),
            lambda: h.set(np.arange(3, dtype=np.int64), np.arange(2, dtype=np.int32)),
            lambda: h.set(np.array([2**31 + 5], np.int64), np.zeros(1, np.int32)),
            lambda: h.set(np.arange(100, 200, dtype=np.int64), np.arange(100, dtype=np.int32)),
            lambda: h.unset(np.array([1000], np.int64)),
            lambda: h.fill(np.empty(999, np.int32)),
            lambda: h.get("not a buffer", None),
            lambda: native.LruState(h, np.full(8, -1, np.int32), np.zeros(8, np.uint8),
                                    np.zeros(8, np.int64), np.zeros(16, np.int32),
                                    np.zeros(8, np.int32), np.array([0, 999], np.int64),
                                    np.zeros(1, np.int64)),
        ]
        for k, case in enumerate(cases):
            try:
                case()
                print(k, "accepted")
            except (ValueError, TypeError) as e:
                assert "\\n" not in str(e), str(e)
                print(k, "refused")
        print("count", h.count, "check", h.check())
        """
    )
    lines = out.splitlines()
    assert lines[:12] == [f"{k} refused" for k in range(12)], out
    assert lines[12] == "count 10 check []", out
