"""Disk measurements for sizing: random-read rate vs queue depth, sequential rate.

Owns :func:`measure_io` and the :class:`DeviceProfile` it saves as JSON, which
``tune`` turns into fault time per token. Random reads are ``os.pread`` calls from
``queue_depth`` threads (the GIL is released during the read), with ``O_DIRECT``
where the file system allows it so the page cache does not flatter the disk; the
profile records whether it did. Does not read through a store's index.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.format import reports
from rowcache.store.safeopen import read_regular_text, write_regular_text

PAGE = 4096
# Below this, random reads may come from the disk's or the hypervisor's cache.
FAIR_FILE_BYTES = 1 << 30
MAX_QUEUE_DEPTH = 1024  # reads in flight: one thread each
MAX_SECONDS = 3600  # a measured point


@dataclass(frozen=True)
class DeviceProfile:
    """Measured rates of one file system.

    ``random[str(read_bytes)][str(queue_depth)]`` = reads per second;
    ``bytes_per_read[str(read_bytes)]`` = bytes each of those reads transferred (a
    whole 4 KiB page per row under ``O_DIRECT``); ``latency_us[str(read_bytes)]
    [str(queue_depth)]`` = ``{"p50": ..., "p99": ...}`` microseconds per read;
    ``sequential_bytes_per_s``; ``direct``: whether ``O_DIRECT`` was used. Profiles
    saved before ``bytes_per_read`` and ``latency_us`` existed load with them empty.
    ``format`` and ``version`` are the report's (``rowcache.format.reports``); a profile
    saved before they existed loads as version 1, with a warning.
    """

    path: str
    file_bytes: int
    direct: bool
    random: dict[str, dict[str, float]]
    sequential_bytes_per_s: float
    seconds_per_point: float
    record_bytes: int = PAGE
    notes: list[str] = field(default_factory=list)
    bytes_per_read: dict[str, int] = field(default_factory=dict)
    latency_us: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    format: str = reports.BENCH_IO
    version: int = reports.VERSIONS[reports.BENCH_IO]

    def to_dict(self) -> dict[str, Any]:
        """The JSON of ``bench-io --json`` and ``-o``: format and version first."""
        return {**reports.stamp(reports.BENCH_IO), **asdict(self)}

    def read_size(self, read_bytes: int) -> int:
        """The measured read size whose rate stands for reads of ``read_bytes``: the
        closest (``reads_per_s``)."""
        if not self.random:
            raise ConfigError("the device profile has no random-read measurements")
        return min((int(k) for k in self.random), key=lambda s: (abs(s - read_bytes), s))

    def reads_per_s(self, read_bytes: int, queue_depth: int | None = None) -> tuple[float, int]:
        """``(reads/s, queue depth)``: the best measured rate for the read size closest
        to ``read_bytes``, or the rate at ``queue_depth``."""
        size = self.read_size(read_bytes)
        row = {int(q): r for q, r in self.random[str(size)].items()}
        if queue_depth is not None:
            if queue_depth not in row:
                raise ConfigError(f"queue_depth={queue_depth} was not measured; have {sorted(row)}")
            return row[queue_depth], queue_depth
        q = max(row, key=lambda k: row[k])
        return row[q], q

    def save(self, path: str | os.PathLike[str]) -> None:
        write_regular_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DeviceProfile:
        """A profile saved by :meth:`save` (``rowcache bench-io -o``), checked."""
        try:
            d = json.loads(read_regular_text(path))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(
                f"{path}: not a disk profile (from `rowcache bench-io -o`): {e}"
            ) from e
        except RecursionError:
            raise ConfigError(
                f"{path}: not a disk profile (from `rowcache bench-io -o`): nested too deeply "
                "to read"
            ) from None
        # another report, or a newer version, is refused; an unversioned one warned below
        versioned = isinstance(d, dict) and reports.check_report(d, reports.BENCH_IO, str(path))
        if isinstance(d, dict) and "tables" in d and "random" not in d:
            raise ConfigError(
                f"{path} is a fault-rate profile (from `rowcache profile`), not a disk profile "
                "(from `rowcache bench-io -o`)"
            )
        known = {f.name for f in fields(cls)}
        need = {
            f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
        }
        if not isinstance(d, dict) or not need <= set(d) or set(d) - known:
            what = sorted(set(d) - known)[:3] if isinstance(d, dict) else type(d).__name__
            raise ConfigError(
                f"{path}: not a disk profile (from `rowcache bench-io -o`): "
                + (
                    f"unexpected keys {what}"
                    if isinstance(d, dict) and set(d) - known
                    else f"needs {sorted(need)}, got {what}"
                )
            )
        rnd = d["random"]
        ok = isinstance(rnd, dict) and all(
            isinstance(row, dict)
            and all(isinstance(r, (int, float)) and r > 0 for r in row.values())
            and all(str(q).isdigit() for q in row)
            and str(rb).isdigit()
            for rb, row in rnd.items()
        )
        if not ok:
            raise ConfigError(
                f"{path}: 'random' must map read sizes to {{queue depth: reads/s > 0}}"
            )
        if not versioned:
            reports.warn_unversioned(str(path), reports.BENCH_IO, "its rates taken as they are")
        return cls(**d)


def _files_of(path: Path) -> list[Path]:
    """``path`` itself, or a directory's shard files (``*.bin``, else any files), largest first."""
    if path.is_file():
        return [path]
    if path.is_dir():
        for pattern in ("*.bin", "*"):
            files = sorted(
                (f for f in path.rglob(pattern) if f.is_file() and not f.is_symlink()),
                key=lambda f: -f.stat().st_size,
            )
            if files:
                return files
        raise ConfigError(f"{path} is a directory with no files to read")
    raise ConfigError(f"{path} is neither a file nor a directory")


def _open(path: Path, direct: bool) -> tuple[int, bool]:
    flags = os.O_RDONLY
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, flags | os.O_DIRECT)
            buf = mmap.mmap(-1, PAGE)
            try:
                os.preadv(fd, [buf], 0)
                return fd, True
            except OSError:
                os.close(fd)
            finally:
                buf.close()
        except OSError:
            pass
    return os.open(path, flags), False


def _random_rate(
    fd: int, size: int, read_bytes: int, align: int, qd: int, seconds: float, seed: int
) -> tuple[float, np.ndarray]:
    """``(reads per second, latency of each read in ns)`` of ``qd`` threads reading at random.

    Each thread checks the deadline and the stop flag after every read (not after a batch:
    on a slow or busy disk a batch of reads outlasted ``seconds`` many times over), and
    makes at least one read, so a thread that starts after the deadline still measures.
    The threads stop at the deadline, at the first error of any of them (raised here), or
    when this thread is interrupted (``KeyboardInterrupt``: they stop after their read in
    flight and are joined before it goes on, so that nothing reads ``fd`` once the caller
    closes it). This thread waits in short joins, so a Ctrl-C is taken within 50 ms
    whichever thread the kernel gave the signal to.
    """
    slots = max(1, (size - read_bytes) // align + 1)
    lat: list[np.ndarray] = [np.zeros(0, np.int64)] * qd
    stop = threading.Event()
    errors: list[BaseException] = []
    deadline = time.perf_counter_ns() + int(seconds * 1e9)

    def worker(i: int) -> None:
        rng = np.random.default_rng(seed + i)
        buf = mmap.mmap(-1, max(PAGE, -(-read_bytes // PAGE) * PAGE))
        view = memoryview(buf)[:read_bytes]
        clock = time.perf_counter_ns
        got: list[int] = []
        try:
            while True:
                for off in (rng.integers(0, slots, 256) * align).tolist():
                    t0 = clock()
                    n = os.preadv(fd, [view], off)
                    t1 = clock()
                    if n != read_bytes:  # the file shrank while it was measured
                        raise OSError(
                            errno.EIO, f"short read: {n} of {read_bytes} bytes at offset {off}"
                        )
                    got.append(t1 - t0)
                    if t1 >= deadline or stop.is_set():
                        return
        except BaseException as e:  # the caller raises it; a thread must not print it
            errors.append(e)
            stop.set()
        finally:
            lat[i] = np.asarray(got, dtype=np.int64)
            view.release()
            buf.close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(qd)]
    t0 = time.perf_counter()
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.05)
    except BaseException:
        stop.set()
        for t in threads:
            if t.ident is not None:
                t.join()
        raise
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    all_lat = np.concatenate(lat)
    return all_lat.size / elapsed, all_lat


def measure_io(
    path: str | os.PathLike[str],
    *,
    record_bytes: int = 512,
    queue_depths: Sequence[int] = (1, 4, 16, 32, 64),
    seconds: float = 1.0,
    direct: bool = True,
    progress: bool | None = None,
) -> DeviceProfile:
    """Measure random reads of ``record_bytes`` and of 4 KiB, and sequential reads.

    Parameters
    ----------
    path : a store directory (its largest shard file is read) or any file
    record_bytes : the store's row size (with ``O_DIRECT`` a row costs one aligned
        page read, which is what is measured)
    queue_depths : threads issuing reads at once, each 1 .. ``MAX_QUEUE_DEPTH``
    seconds : time per measured point, in (0, ``MAX_SECONDS``]: each thread stops after
        the read in flight at the deadline
    progress : a bar on stderr (None: only when stderr is a terminal)
    """
    if isinstance(record_bytes, bool) or not isinstance(record_bytes, int) or record_bytes < 1:
        raise ConfigError(f"record_bytes={record_bytes!r}: give an integer >= 1")
    qds = list(queue_depths)
    if not qds or not all(
        isinstance(q, int) and not isinstance(q, bool) and 1 <= q <= MAX_QUEUE_DEPTH for q in qds
    ):
        raise ConfigError(
            f"queue_depths={qds!r}: give integers from 1 to {MAX_QUEUE_DEPTH:,} (a thread each)"
        )
    if not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_SECONDS:
        raise ConfigError(f"seconds={seconds!r}: give a number > 0 and at most {MAX_SECONDS:,}")
    f = _files_of(Path(path))[0]
    size = f.stat().st_size
    if size < 2 * PAGE:
        raise ConfigError(f"{f} has {size} bytes; need at least {2 * PAGE} to measure")
    fd, used_direct = _open(f, direct)
    # Under O_DIRECT a row is read as whole pages: the largest read must fit in the file,
    # else the reads come back short and the rates count bytes the file does not hold.
    largest = -(-record_bytes // PAGE) * PAGE if used_direct else record_bytes
    if largest > size:
        os.close(fd)
        most = size // PAGE * PAGE if used_direct else size
        how = f" (read as {largest:,} under O_DIRECT)" if largest != record_bytes else ""
        raise ConfigError(
            f"record_bytes={record_bytes:,}: a row of {record_bytes:,} bytes{how} is larger "
            f"than {f} ({size:,} bytes); give at most {most:,}, or measure a larger file"
        )
    notes: list[str] = []
    if direct and not used_direct:
        notes.append("O_DIRECT unavailable here: buffered reads, page cache may inflate rates")
    if not direct:
        notes.append("buffered reads (no O_DIRECT): the page cache may serve them")
    if size < FAIR_FILE_BYTES:
        notes.append(
            f"{f} is only {size / 2**20:,.1f} MiB: random reads over a small file can be "
            "served from the disk's (or the hypervisor's) cache and flatter the disk; "
            "measure a file of several GiB, such as a shard of the real store"
        )
    try:
        random: dict[str, dict[str, float]] = {}
        latency: dict[str, dict[str, dict[str, float]]] = {}
        per_read: dict[str, int] = {}
        read_sizes = sorted({PAGE, record_bytes})
        jobs = [(rb, q) for rb in read_sizes for q in queue_depths]
        bar = None
        if progress is not False:
            from tqdm import tqdm

            # None: tqdm's own rule, a bar only when stderr is a terminal (as the CLI)
            bar = tqdm(
                total=len(jobs) + 1,
                desc="bench-io",
                unit="point",
                disable=None if progress is None else False,
            )
        for rb, q in jobs:
            # O_DIRECT needs page-aligned offsets and lengths: a row costs one page.
            eff = -(-rb // PAGE) * PAGE if used_direct else rb
            align = PAGE if used_direct else rb
            rate, lat = _random_rate(fd, size, eff, align, int(q), float(seconds), seed=q)
            random.setdefault(str(rb), {})[str(q)] = rate
            per_read[str(rb)] = eff
            p50, p99 = np.percentile(lat, [50, 99]) / 1e3 if lat.size else (np.nan, np.nan)
            latency.setdefault(str(rb), {})[str(q)] = {"p50": float(p50), "p99": float(p99)}
            if bar is not None:
                bar.update(1)
        block = 4 << 20
        buf = mmap.mmap(-1, block)
        done = 0
        t0 = time.perf_counter()
        off = 0
        while time.perf_counter() - t0 < seconds:
            n = os.preadv(fd, [buf], off)
            done += n
            off = off + n if n == block else 0
        seq = done / (time.perf_counter() - t0)
        buf.close()
        if bar is not None:
            bar.update(1)
            bar.close()
    finally:
        os.close(fd)
    return DeviceProfile(
        path=str(f),
        file_bytes=int(size),
        direct=used_direct,
        random=random,
        sequential_bytes_per_s=float(seq),
        seconds_per_point=float(seconds),
        record_bytes=int(record_bytes),
        notes=notes,
        bytes_per_read=per_read,
        latency_us=latency,
    )


def profile_summary(p: DeviceProfile) -> list[dict[str, Any]]:
    """Rows for printing: row size, bytes each read transferred, queue depth, reads/s,
    MB/s of those bytes, and latency p50/p99 in µs (NaN where the profile has none)."""
    out = []
    for rb, row in p.random.items():
        moved = int(p.bytes_per_read.get(rb, 0)) or (
            -(-int(rb) // PAGE) * PAGE if p.direct else int(rb)
        )
        for q, r in row.items():
            lat = p.latency_us.get(rb, {}).get(q, {})
            out.append(
                {
                    "read_bytes": int(rb),
                    "bytes_per_read": moved,
                    "queue_depth": int(q),
                    "reads_per_s": r,
                    "MB_per_s": r * moved / 1e6,
                    "p50_us": float(lat.get("p50", np.nan)),
                    "p99_us": float(lat.get("p99", np.nan)),
                }
            )
    return out
