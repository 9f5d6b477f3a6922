"""``scatter_records``: the cache's fault path, staged store records into arena slots.

Owns the launcher of ``scatter.cu``. NumPy arenas run ``scatter_records_reference``
(the spec); cupy arenas run the kernel, bit-identical. Does not read the store or
choose slots: the cache does both and hands over records and distinct slots.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels.gather import (
    check_array,
    check_index,
    check_rows_contiguous,
    describe,
    device_index,
    host_index,
    row_launch,
    vector_bytes,
)
from rowcache.kernels.loader import RawLaunch, get_kernel, is_device_array, require_cupy
from rowcache.kernels.reference import BF16, scatter_records_reference

_SOURCE = "scatter.cu"
_U8 = np.dtype(np.uint8)
_F32 = np.dtype(np.float32)


def _check(records: Any, slots: Any, table: Any, scales: Any) -> int:
    """Validate the arguments; returns the bytes of one record the kernel copies."""
    check_array("records", records, ndim=2, dtypes=(_U8,))
    check_index("slots", slots)
    check_array("table", table, ndim=2, dtypes=(BF16, _U8))
    if slots.shape[0] != records.shape[0]:
        raise ConfigError(
            f"slots must have one entry per record ({records.shape[0]}), got {describe(slots)}"
        )
    d = int(table.shape[1])
    fp8 = scales is not None  # codes + a float32 scale a record; else the row verbatim
    if fp8:
        if table.dtype != _U8:
            raise ConfigError(
                f"scales must be None for a bf16 arena (table {describe(table)}), "
                f"got {describe(scales)}; per-row scales go with a uint8 FP8 code arena"
            )
        check_array("scales", scales, ndim=1, dtypes=(_F32,))
        if scales.shape[0] != table.shape[0]:
            raise ConfigError(
                f"scales must have one entry per slot of table ({table.shape[0]}), "
                f"got {describe(scales)}"
            )
        if is_device_array(scales) != is_device_array(table):
            raise ConfigError(
                f"scales must live where table does ({describe(table)}), got {describe(scales)}"
            )
        need, what = d + 4, f"{d} E4M3 codes + a float32 scale"
    elif table.dtype == _U8:
        need, what = d, f"{d} E4M3 codes (a table-scaled codec: its scale is the table's)"
    else:
        need, what = 2 * d, f"{d} bf16 values"
    if records.shape[1] < need:
        raise ConfigError(
            f"records must hold {need} bytes per row ({what}), got {describe(records)}"
        )
    return d if fp8 else d * table.itemsize


def scatter_records(records: Any, slots: Any, table: Any, scales: Any = None) -> None:
    """Write store records into arena slots, in place: ``table[slots[i]] = row of records[i]``.

    Parameters
    ----------
    records : uint8[n, record_bytes], numpy or cupy
        Rows as stored (``rowcache.format.codecs``): the arena row verbatim (``2*d`` bf16
        bytes, or ``d`` E4M3 codes of a table-scaled codec), or, with ``scales``, ``d`` E4M3
        codes followed by a little-endian float32 scale. Longer records (padding) are fine.
        With a cupy arena, numpy records are copied to the device; a cupy array over
        pinned host memory mapped into the device is read in place.
    slots : int32[n] or int64[n], numpy or cupy
        Destination slot of each record. Must be distinct and in ``[0, slots)``: the
        GPU path does not check (a check would sync the device), the CPU path raises
        IndexError for a slot out of range.
    table : bfloat16[S, d] or uint8[S, d], numpy or cupy
        The arena: bf16 values, or E4M3 codes (with ``scales`` for the per-row-scaled
        ``fp8`` codec, without for a table-scaled one such as ``fp8_table_scale``).
    scales : float32[S], optional
        The FP8 per-row scale arena (contiguous on the GPU); None where rows are copied
        verbatim.
    """
    row_bytes = _check(records, slots, table, scales)
    n = int(records.shape[0])
    if not is_device_array(table):
        host_slots = host_index(slots)
        s = table.shape[0]
        if n and (int(host_slots.min()) < 0 or int(host_slots.max()) >= s):
            bad = int(np.flatnonzero((host_slots < 0) | (host_slots >= s))[0])
            raise IndexError(f"slots[{bad}] = {int(host_slots[bad])} is outside the {s} slots")
        scatter_records_reference(host_index(records), host_slots, table, scales)
        return

    cupy = require_cupy("scatter_records")
    check_rows_contiguous("table", table)
    if n == 0:
        return
    if table.shape[0] == 0:
        raise IndexError(f"{n} records were given but table has 0 slots")
    if is_device_array(records):
        check_rows_contiguous("records", records)
    else:
        records = cupy.asarray(np.ascontiguousarray(records))
    if scales is not None and scales.strides[0] != 4:
        raise ConfigError(
            f"scales must be contiguous on the GPU, got strides {tuple(scales.strides)}"
        )
    if row_bytes == 0 and scales is None:
        return
    dev_slots = device_index(cupy, slots)
    vec = vector_bytes(
        row_bytes,
        records.strides[0],
        table.strides[0],
        records.data.ptr,
        table.data.ptr,
        widths=(16, 8, 4, 2, 1),
    )
    words = row_bytes // vec
    suffix = "i32" if dev_slots.dtype == np.int32 else "i64"
    kernel = get_kernel(_SOURCE, f"scatter_rows_{vec}_{suffix}")
    grid, block = row_launch(cupy, n, words)
    kernel(
        grid,
        block,
        (
            records,
            dev_slots,
            table,
            scales if scales is not None else np.uint64(0),
            np.int64(n),
            np.int64(words),
            np.int64(records.strides[0] // vec),
            np.int64(table.strides[0] // vec),
            np.int64(table.shape[1]),
        ),
    )


WAIT_TIMEOUT_NS = 30 * 10**9
"""How long a deferred fault's ``fault_wait`` holds its stream for the host's read at most
(a read still unfinished then is treated as failed: nothing is written)."""


def fault_commit_reference(
    records: np.ndarray,
    side: np.ndarray,
    n_evicted: int,
    table: np.ndarray,
    scales: np.ndarray | None,
    row_map: np.ndarray | None,
    out: np.ndarray | None = None,
) -> None:
    """What ``FaultCommit`` does on the GPU, in NumPy (the spec): ``side`` int32 is
    ``[slots (n) | rows (n) | evicted rows (n_evicted) | out (len(out))]``; the records
    go into their slots (``scatter_records_reference``), ``row_map`` (int32[rows],
    optional) maps the evicted rows to -1 and the new rows to their slots, and ``out``
    (int32, optional: a resolve's slots in its input order) gets the last part."""
    n = records.shape[0]
    scatter_records_reference(records, side[:n], table, scales)
    if out is not None:
        out[:] = side[2 * n + n_evicted : 2 * n + n_evicted + out.shape[0]]
    if row_map is not None:
        row_map[side[2 * n : 2 * n + n_evicted]] = -1
        row_map[side[n : 2 * n]] = side[:n]


class FaultCommit:
    """The GPU side of a row-cache fault in ONE launch: records into their slots, the
    device row -> slot map's update and, optionally, the resolve's slots into a device
    array, all read in place from pinned host memory mapped into the device
    (``fault_commit`` in scatter.cu). Built once per arena (checks and the kernel choice
    happen here, not per fault): the hot path is one ``cuLaunchKernel`` on arguments
    packed once (``rowcache.kernels.loader.RawLaunch``).

    Parameters
    ----------
    table, scales : the cupy arena (as :func:`scatter_records`).
    record_bytes : bytes per staged record (rows of the staging buffer).
    staging_ptr : device-visible address of the staging buffer (mapped pinned memory).
    """

    def __init__(self, table: Any, scales: Any, record_bytes: int, staging_ptr: int) -> None:
        cupy = require_cupy("FaultCommit")
        check_rows_contiguous("table", table)
        fake = np.empty((1, record_bytes), dtype=np.uint8)
        row_bytes = _check(fake, np.zeros(1, np.int32), table, scales)
        self.cupy, self.table, self.scales = cupy, table, scales
        self.vec = vector_bytes(
            row_bytes,
            record_bytes,
            table.strides[0],
            staging_ptr,
            table.data.ptr,
            widths=(16, 8, 4, 2, 1),
        )
        self.words = row_bytes // self.vec
        self.record_bytes = record_bytes
        self.kernel = get_kernel(_SOURCE, f"fault_commit_{self.vec}")
        # records, side, table, scales, row_map, out, n, n_evicted, n_out, 4 fixed, ctl, seq
        self._launch = RawLaunch(self.kernel, 15)
        self._wait: RawLaunch | None = None  # fault_wait, made on a deferred fault's first
        # row_launch's shape for this arena, found once: blocks = min(ceil(rows / ty), cap)
        (self._max_grid,), self._block = row_launch(cupy, 1 << 40, self.words)
        # fault_commit's parameters fixed for this arena (by their index in scatter.cu's
        # list); __call__ writes the others (records, side, row_map, out, n, n_evicted,
        # n_out, ctl, seq) before each launch
        fixed = {
            2: table.data.ptr,  # table
            3: scales.data.ptr if scales is not None else 0,  # scales
            9: self.words,  # words
            10: record_bytes // self.vec,  # records_stride
            11: table.strides[0] // self.vec,  # table_stride
            12: table.shape[1],  # scale_offset
        }
        self._launch.pack(tuple(fixed.get(i, 0) for i in range(15)))

    def __call__(
        self,
        records_ptr: int,
        side_ptr: int,
        n: int,
        n_evicted: int,
        row_map: Any,
        stream: Any,
        out: Any = None,
        ctl_ptr: int = 0,
        seq: int = 0,
    ) -> None:
        """Launch on ``stream``: ``n`` records at ``records_ptr`` (rows of
        ``record_bytes``), ``side_ptr`` int32 ``[slots | rows | evicted | out]`` (both
        device addresses of mapped pinned memory), ``row_map`` cupy int32[rows] or None,
        ``out`` a contiguous cupy int32 array (or None) that gets the side's last part.

        ``ctl_ptr`` (a deferred fault, whose records a host thread is still reading): the
        device address of mapped pinned int32[2] that the thread sets to ``(seq, seq)``
        once the records are staged cleanly (``(seq, other)`` after a failed read,
        ``_rcio.Reader.read_runs_start``). The stream waits for ``ctl[0] == seq`` (at most
        :data:`WAIT_TIMEOUT_NS`), and the launch writes nothing unless the read was clean."""
        if n == 0:
            return
        if ctl_ptr:
            if self._wait is None:
                self._wait = RawLaunch(get_kernel(_SOURCE, "fault_wait"), 3)
            self._wait.pack((ctl_ptr, seq, WAIT_TIMEOUT_NS))
            self._wait((1,), (1,), stream.ptr)
        ty = self._block[1]
        grid = (max(1, min(-(-max(n, n_evicted) // ty), self._max_grid)),)
        v = self._launch.values
        v[0] = records_ptr
        v[1] = side_ptr
        v[4] = row_map.data.ptr if row_map is not None else 0
        v[5] = out.data.ptr if out is not None else 0
        v[6] = n
        v[7] = n_evicted
        v[8] = out.size if out is not None else 0
        v[13] = ctl_ptr
        v[14] = seq
        self._launch(grid, self._block, stream.ptr)
