"""``rowcache bench-io`` in a child process (issue 51, item 11): a row larger than the file is
refused (it read short and reported more MB/s than the file holds), ``--seconds`` is what a
point takes even on a slow disk (a batch of 256 reads per thread made ``--seconds 0.2`` take
~13 s a point), and ``--queue-depths`` and ``--seconds`` are bounded, each one line (exit 2)."""

from __future__ import annotations

import json

import pytest

from tests.cli.support import one_error_line, run_cli

# A slow disk: every read takes 20 ms (the GIL released while it waits, as a real read's is).
# The child prints how long the command took, imports excluded, as its last stderr line.
SLOW_DISK = """
import atexit, os, sys, time
import rowcache.cli.app
real_preadv = os.preadv
def preadv(*a):
    time.sleep(0.02)
    return real_preadv(*a)
os.preadv = preadv
t0 = time.perf_counter()
atexit.register(lambda: sys.stderr.write(f"took {time.perf_counter() - t0:.3f}\\n"))
"""


@pytest.fixture
def small(tmp_path):
    f = tmp_path / "small.bin"
    f.write_bytes(bytes(range(256)) * 400)  # 102,400 bytes: 25 whole pages
    return f


def test_bench_io_refuses_a_row_larger_than_the_file(small):
    for flags, most in ((["--buffered"], 102_400), ([], None)):
        p = run_cli("bench-io", str(small), "--record-bytes", "102401", *flags)
        err = one_error_line(p, "bench-io")
        assert "--record-bytes 102,401" in err and str(small) in err, err
        assert "102,400 bytes" in err and "give at most" in err, err
        if most is not None:
            assert "give at most 102,400" in err, err
    # A row as large as the file: every read is the whole file, never more.
    p = run_cli(
        "bench-io", str(small), "--record-bytes", "102400", "--buffered", "--queue-depths", "2",
        "--seconds", "0.05", "--json",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    prof = json.loads(p.stdout)
    assert prof["bytes_per_read"]["102400"] == 102_400 and prof["file_bytes"] == 102_400


def test_bench_io_a_point_takes_about_seconds_on_a_slow_disk(small):
    argv = ["bench-io", str(small), "--queue-depths", "1,8", "--seconds", "0.1", "--json"]
    p = run_cli(*argv, "--buffered", prelude=SLOW_DISK, timeout=120)
    assert p.returncode == 0, p.stderr
    took = float(p.stderr.strip().splitlines()[-1].removeprefix("took "))
    # 4 random points and the sequential one at 0.1 s each, a 20 ms read in flight at each
    # deadline; a batch of 256 reads a thread would take >= 5 s a point.
    assert took < 3.0, f"5 points of --seconds 0.1 took {took:.1f} s"
    prof = json.loads(p.stdout)
    one = prof["random"]["512"]["1"]
    assert 10 < one <= 55, f"one thread of 20 ms reads measured {one:.0f} reads/s"


@pytest.mark.parametrize(
    "flag, value, want",
    [
        ("--queue-depths", "100000", "'100000' is not an integer from 1 to 1,024"),
        ("--queue-depths", "1,0", "'0' in '1,0' is not an integer from 1 to 1,024"),
        ("--seconds", "1e300", "give a number of seconds > 0 and at most 3,600"),
        ("--seconds", "0", "give a number > 0"),
        ("--record-bytes", "1e13", "is not an integer; give one from 1 to 67,108,864"),
    ],
)
def test_bench_io_bounds_are_one_line_naming_the_flag(small, flag, value, want):
    err = one_error_line(run_cli("bench-io", str(small), flag, value), "bench-io")
    assert f"argument {flag}" in err and want in err, err
