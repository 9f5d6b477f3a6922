"""The judges' memory-mapped series: a table read through the page cache, capped like an arena.

Owns :class:`Cgroup` (a memory cgroup for the series' process: v2 where allowed, else v1, else
none, and why), :class:`FileMap` (files mapped end to end into one reserved address range, as
an engine maps its table file), :func:`run_mapped` (the series in a spawned child placed in
its cgroup, whose limit is the budget's bytes plus the child's own memory after its start-up
plus a slack: the page cache holds what an arena of the budget holds) and the child's side,
:func:`mapped_worker`. What a lookup reads and how the page cache is warmed is the judge's:
``spec["server"]`` names a class (``"module:Class"``, e.g. ``bench.qwen4:MappedServer``)
that the child makes with ``(spec, xp)`` and that offers

- ``modes`` (``bench.modes.Mode``) and ``steps_of`` (each mode's ``(tokens, context)``s);
- ``check(mode)``: the first ``spec["check_steps"]`` steps' results, host uint16 bits;
- ``open()`` / ``close()``: map and unmap its files;
- ``warm()``: read what the history left in the page cache (after the limit is set);
- ``lookups()``: ``[(layer, lookup(tokens, context))]``, as ``bench.modes.run_series`` takes.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import mmap
import multiprocessing as mp
import os
import resource
import time
import traceback
from typing import Any

import numpy as np

from bench._common import drop_cache
from bench.modes import Model, run_series

PAGE = 4096
MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 0x02, 0x10, 0x20  # Linux's mmap flags
MAP_FAILED = 2**64 - 1  # (void *) -1 as ctypes returns it


class Cgroup:
    """A memory cgroup for the mapped series' process: v2 where allowed, else v1, else none
    (``why`` says which and why)."""

    def __init__(self, allowed: bool = True) -> None:
        self.version: int | None = None
        self.parent = ""
        self.why = "not asked (--page-cache-cap none)"
        tried: list[str] = []
        if not allowed:
            return
        for version, find in ((2, self._v2), (1, self._v1)):
            try:
                self.parent = find()
                probe = os.path.join(self.parent, f"rowcache-probe-{os.getpid()}")
                os.mkdir(probe)
                ok = os.path.exists(os.path.join(probe, self.files(version)[0]))
                os.rmdir(probe)
                if not ok:
                    raise OSError("a child cgroup there has no memory controller")
                self.version = version
                self.why = f"cgroup v{version} under {self.parent}"
                return
            except OSError as e:
                tried.append(f"v{version}: {e}")
        self.why = "no memory cgroup could be made (" + "; ".join(tried) + ")"

    @staticmethod
    def files(version: int) -> tuple[str, str, str]:
        """(limit, usage, limit-hit counter) files of a cgroup of ``version``."""
        if version == 2:
            return "memory.max", "memory.current", "memory.events"
        return "memory.limit_in_bytes", "memory.usage_in_bytes", "memory.failcnt"

    @staticmethod
    def _own(controller: str) -> str:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                if (controller == "" and ctrls == "") or controller in ctrls.split(","):
                    return path
        raise OSError(f"/proc/self/cgroup names no {controller or 'v2'} hierarchy")

    def _v2(self) -> str:
        root = "/sys/fs/cgroup"
        if not os.path.exists(os.path.join(root, "cgroup.controllers")):
            raise OSError("/sys/fs/cgroup is not a cgroup v2 mount")
        own = os.path.join(root, self._own("").lstrip("/"))
        for parent in dict.fromkeys([os.path.normpath(own), root]):
            # a parent that hands the memory controller to its children already (this bench
            # never turns a controller on: that would change a cgroup it did not make)
            try:
                with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                    if "memory" in f.read().split():
                        return parent
            except OSError:
                continue
        raise OSError(
            "neither this process's cgroup nor the root hands the memory controller to children"
        )

    def _v1(self) -> str:
        root = "/sys/fs/cgroup/memory"
        if not os.path.exists(os.path.join(root, "memory.limit_in_bytes")):
            raise OSError("no cgroup v1 memory hierarchy at /sys/fs/cgroup/memory")
        return os.path.join(root, self._own("memory").lstrip("/"))

    def make(self, name: str) -> str | None:
        if self.version is None:
            return None
        path = os.path.join(self.parent, name)
        os.mkdir(path)
        return path

    @staticmethod
    def remove(path: str | None) -> None:
        if path:
            for _ in range(50):  # a just-exited child may still be listed a moment
                try:
                    os.rmdir(path)
                    return
                except OSError:
                    time.sleep(0.1)


def read_int(path: str) -> int | None:
    """The first integer of a file (a cgroup's counter), None where it cannot be read."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def limit_hits(path: str, version: int) -> int | None:
    """How often the cgroup at ``path`` hit its memory limit (v2: ``memory.events``' max)."""
    name = Cgroup.files(version)[2]
    if version == 1:
        return read_int(os.path.join(path, name))
    try:
        with open(os.path.join(path, name)) as f:
            for line in f:
                k, v = line.split()
                if k == "max":
                    return int(v)
    except OSError:
        pass
    return None


class FileMap:
    """``files`` memory-mapped read-only end to end into one reserved address range, so that
    byte ``i`` of the files joined is ``raw[i]`` (uint8 ``[total]``); ``advice="random"``
    gives the range ``MADV_RANDOM`` (no read-around: a fault reads its one page), else the
    kernel's read-around (what a plain ``np.memmap``/``torch.from_file`` gets). Each file
    but the last must be whole pages (its successor then starts on a page)."""

    def __init__(self, files: list[str], advice: str) -> None:
        self.files = list(files)
        self.sizes = [os.path.getsize(f) for f in self.files]
        if any(sz % PAGE for sz in self.sizes[:-1]):
            raise RuntimeError(f"files of {self.sizes} bytes: each but the last whole pages")
        self.total = sum(self.sizes)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (
            [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
        )
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.libc = libc
        size = -(-self.total // PAGE) * PAGE
        base = libc.mmap(None, size, 0, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)  # reserved
        if base in (None, MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap: reserving the table's address range")
        self.base: int | None = base
        self.size = size
        off = 0
        for f, sz in zip(self.files, self.sizes):
            fd = os.open(f, os.O_RDONLY)
            try:
                got = libc.mmap(base + off, sz, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd, 0)
            finally:
                os.close(fd)
            if got != base + off:
                err = ctypes.get_errno()
                self.close()
                raise OSError(err, f"mmap of {f} at its place in the table's range")
            off += sz
        if advice == "random":
            libc.madvise(base, size, mmap.MADV_RANDOM)
        self.raw: np.ndarray | None = np.frombuffer(
            (ctypes.c_uint8 * self.total).from_address(base), dtype=np.uint8
        )

    def close(self) -> None:
        """Unmap the files (their pages then leave the page cache on ``drop_cache``); views
        of :attr:`raw` must be dropped first."""
        self.raw = None
        if self.base is not None:
            self.libc.munmap(self.base, self.size)
            self.base = None


def mapped_worker(conn: Any, spec: dict[str, Any]) -> None:
    """The mapped series, in a child process (its own memory cgroup where one was made):
    the checks, a fresh mapping, the limit, the warm-up, then each mode timed; every
    result sent on ``conn`` as it comes."""
    try:
        if spec["cgroup"]:
            with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        xp: Any = np
        if spec["device"] == "cuda":
            import cupy as cp

            xp = cp
        module, _, name = spec["server"].partition(":")
        server = getattr(importlib.import_module(module), name)(spec, xp)
        model = Model(spec["device"], spec["layer_us"], spec["token_us"], spec["layers"])
        server.open()
        model.run(1, 1)  # compile the spin kernel
        for m in server.modes:  # the checks; they also bring every step size's buffers in
            conn.send(("check", m.name, server.check(m)))
        model.sync()
        # a fresh mapping, its pages dropped: what the cgroup holds now is the process's own
        server.close()
        gc.collect()
        drop_cache(spec["files"])
        server.open()
        info: dict[str, Any] = {"capped": False}
        cg = spec["cgroup"]
        if cg:
            limit_f, usage_f, _ = Cgroup.files(spec["cgroup_version"])
            base = read_int(os.path.join(cg, usage_f)) or 0
            limit = base + spec["budget_bytes"] + spec["slack"]
            with open(os.path.join(cg, limit_f), "w") as f:
                f.write(str(limit))
            if spec["cgroup_version"] == 2 and os.path.exists(os.path.join(cg, "memory.swap.max")):
                try:
                    with open(os.path.join(cg, "memory.swap.max"), "w") as f:
                        f.write("0")
                except OSError:
                    pass
            info.update(capped=True, own_bytes=base, limit_bytes=limit)
        conn.send(("limit", info))
        t0 = time.perf_counter()
        server.warm()
        model.sync()
        conn.send(("warmed", time.perf_counter() - t0))
        for mode in server.modes:
            flt0 = [0]

            def start(flt0: list[int] = flt0) -> None:
                flt0[0] = resource.getrusage(resource.RUSAGE_SELF).ru_majflt

            r = run_series(
                server.lookups(),
                mode,
                server.steps_of[mode.name],
                model,
                spec["layers"],
                at_start=start,
            )
            flt = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - flt0[0]
            timed = mode.steps - mode.start
            r.update({"majflt/step": flt / timed, "majflt/tok": flt / (timed * mode.B * mode.T)})
            conn.send(("mode", mode.name, r))
        if cg:
            info["limit_hits"] = limit_hits(cg, spec["cgroup_version"])
        server.close()
        conn.send(("done", info))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_mapped(spec: dict[str, Any], cg: Cgroup, tag: str, on_mode: Any = None) -> dict[str, Any]:
    """The mapped series of one budget in a child process: its messages, collected
    (``on_mode(name, result)`` as each mode's result comes: a run cut short still said it)."""
    from bench import mapped as me  # by its module name: the spawned child imports it so

    path = cg.make(f"rowcache-mmap-{os.getpid()}-{tag}") if cg.version else None
    spec = dict(spec, cgroup=path, cgroup_version=cg.version)
    drop_cache(spec["files"])
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=me.mapped_worker, args=(b, spec))
    got: dict[str, Any] = {"modes": {}, "checks": {}}
    try:
        p.start()
        b.close()
        while True:
            try:
                kind, *rest = a.recv()
            except EOFError:
                break
            if kind == "limit":
                got["limit"] = rest[0]
            elif kind == "warmed":
                got["warm_s"] = rest[0]
            elif kind == "check":
                got["checks"][rest[0]] = rest[1]
            elif kind == "mode":
                got["modes"][rest[0]] = rest[1]
                if on_mode is not None:
                    on_mode(rest[0], rest[1])
            elif kind == "done":
                got["done"] = rest[0]
            elif kind == "error":
                got["error"] = rest[0]
        p.join()
        if "done" not in got and "error" not in got:
            got["error"] = f"the mapped series' process ended with exit code {p.exitcode}" + (
                " (killed: the cgroup's limit?)" if p.exitcode and p.exitcode < 0 else ""
            )
    finally:
        if p.is_alive():
            p.kill()
            p.join()
        a.close()
        Cgroup.remove(path)
        drop_cache(spec["files"])
    return got
