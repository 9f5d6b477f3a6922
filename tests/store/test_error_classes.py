"""The error a user meets says what happened, in its right class (issue 51, item 7).

Each case runs in a child process (``tests.store.refusals``: one forked child a case, an
alarm against hangs), where a signal, a hang or a traceback shows as what it is:

- out of file descriptors while opening a healthy store is an ``OSError`` (EMFILE) that
  says so, never the ``FormatError`` promised for a damaged index;
- a store or trace name of 233 to 255 bytes (legal: NAME_MAX is 255) builds, its hidden
  siblings' names cut to fit (``rowcache.store.replace.sibling_stem``);
- a ``.npy`` header with a negative or huge dimension is a ``FormatError`` naming the file;
- an empty table name is refused before anything is written;
- a disk that fills during ``build`` (a real tmpfs of 1 MiB, in a mount namespace) is an
  ``OSError`` naming the store, through the API and the CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.store.refusals import run_cases

PRELUDE = r"""
import errno, json, os, resource
import numpy as np
import rowcache
from rowcache.errors import RowCacheError
from rowcache.store.handle import RowStore


def outcome(fn):
    try:
        return {"ok": fn()}
    except (RowCacheError, OSError) as e:
        return {"error": type(e).__name__, "errno": getattr(e, "errno", None),
                "message": str(e)}
"""

DESCRIPTORS = r"""
s = os.path.join(work, "s")
x = (np.arange(6000 * 16) % 200).astype(np.float32).reshape(6000, 16)  # exact in bf16
rowcache.build_store(s, {"a": x, "b": x[:100]}, progress=False, shard_bytes=8192).close()


def open_and_read():
    with RowStore.open(s) as h:
        got = h.read_rows("a", np.arange(6000))
        return bool(np.array_equal(got.astype(np.float32), x))


base = len(os.listdir("/proc/self/fd"))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
result = []
for extra in range(0, 40):  # every point of the open and the first read runs out once
    resource.setrlimit(resource.RLIMIT_NOFILE, (base + extra, hard))
    try:
        result.append(outcome(open_and_read))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
result.append(outcome(open_and_read))  # and the store is still healthy
"""

LONG_NAMES = r"""
from rowcache.embed import NgramDims
from rowcache.store.replace import find_leftovers, sibling_name
from rowcache.tools.trace_build import build_trace

x = np.arange(64, dtype=np.float32).reshape(8, 8)
result = {}
for n in (232, 233, 240, 255):
    p = os.path.join(work, "s" * n)

    def build_twice(p=p):
        for dtype in ("bf16", "fp8"):  # the second replaces the first (its old-* sibling)
            rowcache.build_store(p, {"t": x}, dtype=dtype, progress=False, overwrite=True).close()
        with RowStore.open(p) as h:
            return [h.tables[0].dtype, [q for q in os.listdir(work) if q.startswith(".")]]

    result[str(n)] = outcome(build_twice)
    # a sibling a killed build would leave is found (and its name fits)
    left = sibling_name(p, "building")
    os.mkdir(left)
    result[f"{n} leftover"] = [len(os.fsencode(os.path.basename(left))),
                               [lo.kind for lo in find_leftovers(p)]]
    os.rmdir(left)
u = os.path.join(work, "\u00e9" * 127)  # 254 bytes of UTF-8
result["utf-8"] = outcome(lambda: rowcache.build_store(u, {"t": x}, progress=False).close())
dims = NgramDims(vocab_size=300, hidden_size=48, max_ngram=3, splits=2, ratio=2.5,
                 eos_token_id=2)
reqs = [np.arange(3, 40), np.arange(50, 90)]
tdir = os.path.join(work, "traces")
os.mkdir(tdir)
t = os.path.join(tdir, "t" * 255)
result["trace"] = outcome(lambda: build_trace(reqs, dims, t, progress=False).path.name == "t" * 255)
"""

NPY = r"""
good = np.arange(12, dtype=np.float32).reshape(4, 3)
np.save(os.path.join(work, "good.npy"), good)
raw = open(os.path.join(work, "good.npy"), "rb").read()
result = {}
for name, shape in (("neg0", "(-4, 3)"), ("neg1", "(4, -3)"), ("bigneg", "(-9223372036854775809, 3)"),
                    ("huge", "(18446744073709551616, 3)"), ("long", "(9223372036854775807, 3)"),
                    ("short", "(5, 3)")):
    path = os.path.join(work, name + ".npy")
    # the header keeps its length: the shape is padded with the spaces after it
    head_len = int.from_bytes(raw[8:10], "little")
    header = raw[10:10 + head_len].decode("latin1").replace("(4, 3)", shape)
    header = header.rstrip("\n").rstrip(" ")
    header = header + " " * (head_len - 1 - len(header)) + "\n"
    assert len(header) == head_len, (name, len(header), head_len)
    open(path, "wb").write(raw[:10] + header.encode("latin1") + raw[10 + head_len:])
    result[name] = outcome(lambda: rowcache.build_store(
        os.path.join(work, "s-" + name), {"t": path}, progress=False).close())
    result[name + " left"] = sorted(n for n in os.listdir(work) if n.startswith((".s-", "s-")))
result["good"] = outcome(lambda: rowcache.build_store(
    os.path.join(work, "s-good"), {"t": os.path.join(work, "good.npy")}, progress=False).close())
"""

EMPTY_NAME = r"""
x = np.ones((4, 4), np.float32)
result = {
    "api": outcome(lambda: rowcache.build_store(os.path.join(work, "s"), {"": x},
                                                progress=False).close()),
    "left": sorted(os.listdir(work)),
}
"""


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    work = tmp_path_factory.mktemp("errors")
    code = {}
    for name, body in (
        ("descriptors", DESCRIPTORS),
        ("long names", LONG_NAMES),
        ("npy", NPY),
        ("empty name", EMPTY_NAME),
    ):
        d = work / name.replace(" ", "-")
        d.mkdir()
        code[name] = [("python", f"{PRELUDE}\nwork = {str(d)!r}\n{body}")]
    code["empty name cli"] = [
        (
            "python",
            f"import numpy as np\nnp.save({str(work / 'e.npy')!r}, np.ones((4, 4), np.float32))",
        ),
        ("cli", ["build", str(work / "e-store"), "--table", f"={work / 'e.npy'}"]),
    ]
    return run_cases(code, work)


def result_of(cases, name):
    out = cases[name]
    assert out["status"] == 0, f"the child ended with status {out['status']}"
    (call,) = [c for c in out["calls"] if c["kind"] == "python"][-1:]
    assert "error" not in call, call
    return call["result"]


def test_out_of_descriptors_opening_a_healthy_store_is_an_oserror_saying_so(cases):
    got = result_of(cases, "descriptors")
    assert got[-1] == {"ok": True}, got[-1]  # the store was healthy all along
    failed = [r for r in got if "error" in r]
    assert len(failed) >= 3, got  # the index, its copy, the shards each ran out once
    for r in failed:
        # FormatError says "the store is damaged": it never was
        assert r["error"] == "OSError" and r["errno"] == 24, r
        assert "Too many open files" in r["message"] and "\n" not in r["message"], r
    assert any("out of file descriptors" in r["message"] for r in failed), failed
    assert all(r == {"ok": True} for r in got[got.index(failed[-1]) + 1 :])


@pytest.mark.parametrize("n", ["232", "233", "240", "255"])
def test_a_store_name_up_to_name_max_builds_and_replaces(cases, n):
    got = result_of(cases, "long names")
    assert got[n] == {"ok": ["fp8", []]}, got[n]  # built, replaced, nothing left beside it
    size, kinds = got[f"{n} leftover"]
    assert size <= 255 and kinds == ["building"], got[f"{n} leftover"]


def test_a_utf8_store_name_and_a_trace_name_of_255_bytes_build(cases):
    got = result_of(cases, "long names")
    assert got["utf-8"] == {"ok": None}, got["utf-8"]
    assert got["trace"] == {"ok": True}, got["trace"]


@pytest.mark.parametrize("name", ["neg0", "neg1", "bigneg", "huge", "long", "short"])
def test_a_npy_header_with_a_bad_shape_is_a_format_error_naming_the_file(cases, name):
    got = result_of(cases, "npy")
    r = got[name]
    assert r.get("error") == "FormatError", r  # was OverflowError for the negative ones
    assert f"{name}.npy" in r["message"] and "shape" in r["message"], r
    assert "\n" not in r["message"]
    assert got[name + " left"] == [], got[name + " left"]  # refused before anything was written
    assert got["good"] == {"ok": None}


def test_an_empty_table_name_is_refused_before_anything_is_written(cases):
    got = result_of(cases, "empty name")
    r = got["api"]
    assert r.get("error") == "ConfigError", r
    assert "named ''" in r["message"] and "non-empty" in r["message"], r
    assert got["left"] == [], got["left"]


def test_the_cli_names_a_table_given_without_a_name_after_its_file(cases):
    out = cases["empty name cli"]
    assert out["status"] == 0
    cli = out["calls"][-1]["result"]
    assert cli["rc"] == 0, cli  # `--table =FILE` takes the file's stem: "e"


# --- a disk that fills during the build: a real tmpfs in a mount namespace ------------------

FULL_DISK = r"""
import json, os, sys
from types import SimpleNamespace
import numpy as np
import rowcache
from rowcache.cli.app import main
from rowcache.store import builder
from rowcache.store.handle import RowStore

mnt, src = sys.argv[1], sys.argv[2]
# The free-space check before a build would refuse it up front (tested in test_store_races);
# here it is told there is room, so that the disk fills for real while shards are written.
builder.STATVFS = lambda p: SimpleNamespace(f_bavail=1 << 30, f_frsize=4096)
x = np.load(src)
out = {}
for dtype in ("bf16", "fp8"):
    try:
        rowcache.build_store(os.path.join(mnt, "s"), {"t": x}, dtype=dtype, progress=False)
        out[dtype] = {"ok": True}
    except OSError as e:
        out[dtype] = {"error": type(e).__name__, "errno": e.errno, "message": str(e)}
    out[dtype + " left"] = os.listdir(mnt)
rowcache.build_store(os.path.join(mnt, "old"), {"t": x[:100]}, progress=False).close()
try:
    rowcache.build_store(os.path.join(mnt, "old"), {"t": x}, overwrite=True, progress=False)
except OSError as e:
    out["overwrite"] = {"errno": e.errno, "message": str(e)}
with RowStore.open(os.path.join(mnt, "old")) as h:
    out["old intact"] = bool(np.array_equal(h.read_rows("t", np.arange(100)).astype(np.float32),
                                            x[:100].astype(np.float32)))
import contextlib, io
err = io.StringIO()
with contextlib.redirect_stderr(err):
    out["cli rc"] = main(["build", os.path.join(mnt, "c"), "--table", f"t={src}"])
out["cli"] = err.getvalue()
print(json.dumps(out))
"""


def test_a_disk_filling_during_the_build_names_the_store(tmp_path):
    import numpy as np

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) to make a mount namespace for a small tmpfs")
    probe = subprocess.run(
        [unshare, "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {tmp_path}"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    src = tmp_path / "rows.npy"
    np.save(src, np.ones((20000, 64), np.float32))  # 2.5 MiB of bf16: more than the disk
    script = tmp_path / "full.py"
    script.write_text(textwrap.dedent(FULL_DISK))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [
            unshare,
            "-rm",
            "sh",
            "-c",
            'mount -t tmpfs -o size=1m tmpfs "$1" && exec "$2" "$3" "$1" "$4"',
            "sh",
            str(mnt),
            sys.executable,
            str(script),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    got = json.loads(proc.stdout.splitlines()[-1])
    store = str(mnt / "s")
    for dtype in ("bf16", "fp8"):
        r = got[dtype]
        assert r.get("errno") == 28, r  # ENOSPC, class and errno kept
        assert store in r["message"] and "No space left" in r["message"], r
        assert "no store was made" in r["message"], r
        assert got[dtype + " left"] == [], got[dtype + " left"]
    assert got["overwrite"]["errno"] == 28 and str(mnt / "old") in got["overwrite"]["message"]
    assert "unchanged" in got["overwrite"]["message"]
    assert got["old intact"]
    cli = got["cli"]
    assert got["cli rc"] == 2 and cli.count("\n") == 1, cli
    assert cli.startswith("rowcache build: error: ") and str(mnt / "c") in cli, cli
    assert ".building-" not in cli and "No space left" in cli, cli
