"""Attacks on a store that could end in a signal or a hang, each in a forked child with a
timeout (``tests.store.refusals``, kind ``python``; issue 39, items 1, 2, 8 and 9): a flipped
bit anywhere in the index's first pages or its marker, a FIFO in place of the index, the
marker or a shard (before and after open), a shard the user may not read, a source cut short
during the build. Each case asserts no signal, no hang, the exact error class and a message
naming the file."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.store.refusals import run_cases

# In scope of every case: `work` (its own empty directory) and these helpers.
PRELUDE = r"""
import json, os
import ml_dtypes
import numpy as np
import rowcache
from rowcache.errors import RowCacheError
from rowcache.store.handle import RowStore


def build(path, rows=300, dim=16, seed=0, **kw):
    x = np.random.default_rng(seed).standard_normal((rows, dim), dtype=np.float32)
    x = x.astype(ml_dtypes.bfloat16)
    kw.setdefault("shard_bytes", 8192)
    rowcache.build_store(path, {"t": x}, progress=False, **kw).close()
    return x


def rows_of(store):
    return store.read_rows("t", np.arange(store.tables[0].rows)).view(np.uint16)


def outcome(fn):
    try:
        return {"ok": fn()}
    except (RowCacheError, OSError) as e:
        return {"error": type(e).__name__, "message": str(e)}
"""


def assert_clean(outcome):
    """The child ended normally (no signal, no hang: SIGALRM after 30 s) and its case ran
    to the end; returns the case's ``result``."""
    assert outcome["status"] == 0, f"the child ended with status {outcome['status']}"
    (call,) = outcome["calls"]
    assert "result" in call, call
    return call["result"]


# Item 1, the "Done when" fuzz: every bit of the two LMDB meta pages' first 256 bytes (the
# meta records: magic, page size, roots, last page, transaction id), 1,500 bits drawn from
# the file's first four pages (the tree's pages: the meta, shard and page-CRC records) and
# every bit of the marker, each flipped alone. Each flip must open as the same store (same
# store_id, same rows) or be refused with FormatError; never a signal, a hang or another row.
FUZZ = r"""
import random
from rowcache.errors import FormatError
from rowcache.format import layout as fmt
s = os.path.join(work, "s")
build(s)
with RowStore.open(s) as h:
    want_id, want = h.store_id, rows_of(h)
outcomes = {"same": 0, "refused": 0, "other rows": 0}
odd = []

def flips(file, bits):
    fd = os.open(file, os.O_RDWR)
    data = open(file, "rb").read()
    try:
        for b, k in bits:
            os.pwrite(fd, bytes([data[b] ^ (1 << k)]), b)
            try:
                with RowStore.open(s) as h:
                    same = h.store_id == want_id and bool((rows_of(h) == want).all())
                outcomes["same" if same else "other rows"] += 1
            except FormatError as e:
                outcomes["refused"] += 1
                if s not in str(e):
                    odd.append((b, k, "FormatError not naming the store", str(e)))
            except Exception as e:
                odd.append((b, k, type(e).__name__, str(e)))
            finally:
                os.pwrite(fd, data[b : b + 1], b)
    finally:
        os.close(fd)
    return len(data)

index = os.path.join(s, fmt.INDEX_NAME, fmt.INDEX_FILE)
size = os.path.getsize(index)
rnd = random.Random(39)
bits = [(p * 4096 + b, k) for p in (0, 1) for b in range(256) for k in range(8)]
bits += [(rnd.randrange(min(size, 4 * 4096)), rnd.randrange(8)) for _ in range(1500)]
flips(index, bits)
marker = os.path.join(s, fmt.MARKER_NAME)
marker_bits = [(b, k) for b in range(os.path.getsize(marker)) for k in range(8)]
flips(marker, marker_bits)
result = {"outcomes": outcomes, "odd": odd[:5], "flips": len(bits) + len(marker_bits)}
"""

FIFO = r"""
from rowcache.cli.app import main
import contextlib, io
from rowcache.format import layout as fmt
s = os.path.join(work, "s")
build(s, rows=600)  # 5 pages: shards of 2 pages, shard 2 the last
result = {}

def fifo_in_place(p):
    os.rename(p, p + ".saved")
    os.mkfifo(p)

def restore(p):
    os.unlink(p)
    os.rename(p + ".saved", p)

for what, rel in (("index", os.path.join(fmt.INDEX_NAME, fmt.INDEX_FILE)),
                  ("marker", fmt.MARKER_NAME), ("shard", "t0000-s000001.bin")):
    p = os.path.join(s, rel)
    fifo_in_place(p)
    result[what] = outcome(lambda: RowStore.open(s) and None)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["inspect", s])
    result[what + " cli"] = {"rc": rc, "stderr": err.getvalue()}
    restore(p)
# A shard replaced by a FIFO after the open, before any read of it.
h = RowStore.open(s)
fifo_in_place(os.path.join(s, "t0000-s000002.bin"))
result["shard after open"] = outcome(lambda: rows_of(h) and None)
r = h.new_reader()  # a cache's reader: the same refusal
result["reader after open"] = outcome(lambda: r.read_records(0, np.arange(520, 530)) and None)
"""

CUT_SOURCE = r"""
import rowcache.store.builder as builder
import rowcache.store.pages as pages
builder.CHUNK_BYTES = 16 << 10
builder.FP8_ENGINE = "reference"
x = np.random.default_rng(1).standard_normal((2000, 64), dtype=np.float32)
result = {}
for kind in ("npy", "fortran", "safetensors"):
    for dtype in ("bf16", "fp8"):
        src = os.path.join(work, f"{kind}-{dtype}.{'npy' if kind == 'fortran' else kind}")
        if kind == "npy":
            np.save(src, x)
            table = src
        elif kind == "fortran":  # read column by column, through no map either (issue 51)
            np.save(src, np.asfortranarray(x))
            table = src
        else:
            head = json.dumps({"w": {"dtype": "F32", "shape": list(x.shape),
                                     "data_offsets": [0, x.nbytes]}}).encode()
            with open(src, "wb") as f:
                f.write(len(head).to_bytes(8, "little") + head + x.tobytes())
            table = (src, "w")
        calls = []
        real = pages.pack_pages

        def cut_after_first(info, records, src=src):  # the first chunk is packed: cut the file
            calls.append(1)
            if len(calls) == 1:
                os.truncate(src, 40000)
            return real(info, records)

        builder.pack_pages = pages.pack_pages = cut_after_first
        try:
            result[f"{kind} {dtype}"] = outcome(lambda: rowcache.build_store(
                os.path.join(work, f"s-{kind}-{dtype}"), {"t": table}, dtype=dtype,
                progress=False).close())
        finally:
            builder.pack_pages = pages.pack_pages = real
        result[f"{kind} {dtype} left"] = sorted(os.listdir(work))

# A Fortran-order .npy cut short before the build, and cut by another thread while the
# build reads it (the thread truncates once the first chunk is packed; the build waits).
import threading
src = os.path.join(work, "fortran-before.npy")
np.save(src, np.asfortranarray(x))
os.truncate(src, 40000)
result["fortran before"] = outcome(lambda: rowcache.build_store(
    os.path.join(work, "s-fortran-before"), {"t": src}, progress=False).close())
src = os.path.join(work, "fortran-thread.npy")
real = pages.pack_pages
for n in range(3):
    np.save(src, np.asfortranarray(x))
    packed, cut = threading.Event(), threading.Event()

    def cutter():
        packed.wait(10)
        os.truncate(src, 128 + 16000 * n)  # the header, mid first column, mid second column
        cut.set()

    def pack_then_wait(info, records):
        packed.set()
        cut.wait(10)
        return real(info, records)

    t = threading.Thread(target=cutter)
    t.start()
    builder.pack_pages = pages.pack_pages = pack_then_wait
    try:
        result[f"fortran thread {n}"] = outcome(lambda: rowcache.build_store(
            os.path.join(work, f"s-fortran-thread-{n}"), {"t": src}, progress=False).close())
    finally:
        builder.pack_pages = pages.pack_pages = real
        t.join()
"""

EACCES = r"""
import ctypes
s = os.path.join(work, "s")
build(s)
os.chmod(os.path.join(s, "t0000-s000001.bin"), 0)
if os.getuid() == 0:  # root reads any file: read as nobody, keeping /proc/self/fd readable
    os.setgid(65534)
    os.setuid(65534)
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
h = RowStore.open(s)
result = {"root": h.root, "read": outcome(lambda: rows_of(h) and None)}
"""


@pytest.fixture(scope="module")
def attacks(tmp_path_factory):
    work = tmp_path_factory.mktemp("attacks")
    base = tempfile.mkdtemp(prefix="rowcache-eacces-")
    os.chmod(base, 0o755)  # the unprivileged child must reach the store
    cases = {"fuzz": FUZZ, "fifo": FIFO, "cut": CUT_SOURCE, "eacces": EACCES}
    try:
        code = {}
        for name, body in cases.items():
            d = base if name == "eacces" else str(work / name)
            os.makedirs(d, exist_ok=True)
            code[name] = [("python", f"{PRELUDE}\nwork = {d!r}\n{body}")]
        yield run_cases(code, work)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_every_single_bit_flip_of_the_index_opens_the_same_store_or_is_refused(attacks):
    got = assert_clean(attacks["fuzz"])  # no signal, no hang
    assert got["odd"] == [], got["odd"]  # every refusal a FormatError naming the store
    assert got["flips"] > 5000
    # The marker's CRC32C catches every single-bit error of the index (and the marker's own
    # fields every flip of the marker): none opens, so none can open as another store.
    assert got["outcomes"] == {"same": 0, "refused": got["flips"], "other rows": 0}


@pytest.mark.parametrize("what", ["index", "marker", "shard"])
def test_a_fifo_in_place_of_a_store_file_is_refused_not_waited_on(attacks, what):
    got = assert_clean(attacks["fifo"])
    name = {"index": "data.mdb", "marker": "rowcache-store.json", "shard": "t0000-s000001.bin"}
    assert got[what]["error"] == "FormatError", got[what]
    assert "not a regular file" in got[what]["message"] and name[what] in got[what]["message"]
    cli = got[what + " cli"]
    assert cli["rc"] == 2 and cli["stderr"].count("\n") == 1, cli
    assert name[what] in cli["stderr"] and "not a regular file" in cli["stderr"], cli


@pytest.mark.parametrize("how", ["shard after open", "reader after open"])
def test_a_shard_replaced_by_a_fifo_after_open_is_refused_by_the_reads(attacks, how):
    got = assert_clean(attacks["fifo"])[how]
    assert got["error"] == "CorruptDataError", got
    assert "t0000-s000002.bin" in got["message"] and "not a regular file" in got["message"]
    assert "/proc/self/fd" not in got["message"], got


SOURCES = ["npy", "fortran", "safetensors"]


@pytest.mark.parametrize("source", [f"{k} {d}" for k in SOURCES for d in ("bf16", "fp8")])
def test_a_source_cut_short_during_the_build_is_an_error_naming_it(attacks, source):
    got = assert_clean(attacks["cut"])  # a Fortran-order .npy was a SIGBUS (issue 51, 3)
    kind, dtype = source.split()
    assert got[source]["error"] == "FormatError", got[source]
    msg = got[source]["message"]
    ext = "npy" if kind == "fortran" else kind
    assert f"{kind}-{dtype}.{ext}" in msg and "while being read" in msg, msg
    assert "\n" not in msg, msg
    assert not any(n.startswith(".s-") for n in got[source + " left"]), got[source + " left"]


def test_a_fortran_order_npy_cut_short_before_the_build_is_refused(attacks):
    got = assert_clean(attacks["cut"])["fortran before"]
    assert got["error"] == "FormatError", got
    assert "fortran-before.npy" in got["message"] and "\n" not in got["message"], got


@pytest.mark.parametrize("n", range(3))
def test_a_fortran_order_npy_cut_by_another_thread_during_the_build(attacks, n):
    got = assert_clean(attacks["cut"])[f"fortran thread {n}"]
    assert got["error"] == "FormatError", got
    msg = got["message"]
    assert "fortran-thread.npy" in msg and "while being read" in msg and "\n" not in msg, got


def test_a_shard_the_user_may_not_read_is_named_as_the_user_knows_it(attacks):
    got = assert_clean(attacks["eacces"])
    read = got["read"]
    assert read["error"] == "PermissionError", read
    msg = read["message"]
    assert "t0000-s000001.bin" in msg and "rowcache-eacces-" in msg, msg
    assert "/proc/self/fd" not in msg, (got["root"], msg)
