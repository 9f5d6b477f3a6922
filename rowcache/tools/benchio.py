"""Disk measurements for sizing: random-read rate vs queue depth, sequential rate.

Owns :func:`measure_io` and the :class:`DeviceProfile` it saves as JSON, which
``tune`` turns into fault time per token. Random reads are ``os.pread`` calls from
``queue_depth`` threads (the GIL is released during the read), with ``O_DIRECT``
where the file system allows it so the page cache does not flatter the disk; the
profile records whether it did. Does not read through a store's index.
"""

from __future__ import annotations

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
from rowcache.store.safeopen import read_regular_text, write_regular_text

PAGE = 4096
# Below this, random reads may come from the disk's or the hypervisor's cache.
FAIR_FILE_BYTES = 1 << 30


@dataclass(frozen=True)
class DeviceProfile:
    """Measured rates of one file system.

    ``random[str(read_bytes)][str(queue_depth)]`` = reads per second;
    ``bytes_per_read[str(read_bytes)]`` = bytes each of those reads transferred (a
    whole 4 KiB page per row under ``O_DIRECT``); ``latency_us[str(read_bytes)]
    [str(queue_depth)]`` = ``{"p50": ..., "p99": ...}`` microseconds per read;
    ``sequential_bytes_per_s``; ``direct``: whether ``O_DIRECT`` was used. Profiles
    saved before ``bytes_per_read`` and ``latency_us`` existed load with them empty.
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

    def reads_per_s(self, read_bytes: int, queue_depth: int | None = None) -> tuple[float, int]:
        """``(reads/s, queue depth)``: the best measured rate for the read size closest
        to ``read_bytes``, or the rate at ``queue_depth``."""
        if not self.random:
            raise ConfigError("the device profile has no random-read measurements")
        sizes = sorted(int(k) for k in self.random)
        size = min(sizes, key=lambda s: (abs(s - read_bytes), s))
        row = {int(q): r for q, r in self.random[str(size)].items()}
        if queue_depth is not None:
            if queue_depth not in row:
                raise ConfigError(f"queue_depth={queue_depth} was not measured; have {sorted(row)}")
            return row[queue_depth], queue_depth
        q = max(row, key=lambda k: row[k])
        return row[q], q

    def save(self, path: str | os.PathLike[str]) -> None:
        write_regular_text(path, json.dumps(asdict(self), indent=1))

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

    The threads stop at the deadline, at the first error of any of them (raised here), or
    when this thread is interrupted (``KeyboardInterrupt``: they are joined before it goes
    on, so that nothing reads ``fd`` once the caller closes it).
    """
    slots = max(1, (size - read_bytes) // align)
    lat: list[np.ndarray] = [np.zeros(0, np.int64)] * qd
    stop = threading.Event()
    errors: list[BaseException] = []
    deadline = time.perf_counter() + seconds

    def worker(i: int) -> None:
        rng = np.random.default_rng(seed + i)
        buf = mmap.mmap(-1, max(PAGE, -(-read_bytes // PAGE) * PAGE))
        view = memoryview(buf)[:read_bytes]
        clock = time.perf_counter_ns
        got: list[int] = []
        try:
            while True:  # at least one batch: a thread that starts late still measures
                for off in (rng.integers(0, slots, 256) * align).tolist():
                    t0 = clock()
                    os.preadv(fd, [view], off)
                    got.append(clock() - t0)
                if stop.is_set() or time.perf_counter() >= deadline:
                    break
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
            t.join()
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
    progress: bool = True,
) -> DeviceProfile:
    """Measure random reads of ``record_bytes`` and of 4 KiB, and sequential reads.

    Parameters
    ----------
    path : a store directory (its largest shard file is read) or any file
    record_bytes : the store's row size (with ``O_DIRECT`` a row costs one aligned
        page read, which is what is measured)
    queue_depths : threads issuing reads at once
    seconds : time per measured point
    """
    if record_bytes < 1:
        raise ConfigError(f"record_bytes must be >= 1; got {record_bytes}")
    if not queue_depths or min(queue_depths) < 1:
        raise ConfigError(f"queue_depths must be ints >= 1; got {list(queue_depths)}")
    if seconds <= 0:
        raise ConfigError(f"seconds must be > 0; got {seconds}")
    f = _files_of(Path(path))[0]
    size = f.stat().st_size
    if size < 2 * PAGE:
        raise ConfigError(f"{f} has {size} bytes; need at least {2 * PAGE} to measure")
    fd, used_direct = _open(f, direct)
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
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(jobs) + 1, desc="bench-io", unit="point")
        for rb, q in jobs:
            # O_DIRECT needs page-aligned offsets and lengths: a row costs one page.
            eff = -(-rb // PAGE) * PAGE if used_direct else rb
            align = PAGE if used_direct else rb
            rate, lat = _random_rate(fd, size, eff, align, int(q), seconds, seed=q)
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
