"""The arena of ``NgramRowCache``: the slots' rows, the staging they are read into, the device map.

Owns :class:`Arena`: the row values (``table``, ``scales``: NumPy on the CPU; on the GPU
device memory, or pinned host memory mapped into the device), the demand fault's staging
buffer (pinned on the GPU, read in place by the fault's launch) and its int32 side buffer,
the launch itself (``rowcache.kernels.scatter.FaultCommit``: records, device map, slots in
one launch), the pinned ring that carries int32 arrays to the device, the cache's CUDA
stream and the device row -> slot map (cupy int32[rows], made on first use and updated in
stream order after every arena write). Decides nothing about residency (``rowcache.cache.slots``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.cache.slots import READING, SlotTable
from rowcache.format.codecs import get_codec
from rowcache.kernels.reference import scatter_records_reference

OUT_RING = 8  # pinned buffers for int32 arrays on their way to the device (slots, map updates)


def value_dtype(dtype: str) -> Any:
    """The arena's element type for a store of codec ``dtype`` (bf16 values or FP8 codes)."""
    return get_codec(dtype).value_dtype


class Arena:
    """Row slots' values and the buffers that fill them.

    Parameters
    ----------
    slots, dim, record_bytes : the arena's shape and a stored record's size.
    dtype : the store's codec (``rowcache.format.codecs``): the slots hold its
        ``value_dtype`` (bf16 values, or E4M3 codes for ``fp8`` and ``fp8_table_scale``,
        whole records of codes and scale bytes for ``fp8_block_e8m0``), ``arena_width`` of
        them a slot, and ``scales`` a float32 a slot where its records carry one (``fp8``),
        else None (the scale of an ``fp8_table_scale`` table is the table's, in its
        ``TableInfo``).
    device : ``"cpu"`` or ``"cuda"``; xp : numpy or cupy.
    kind : with ``cuda``, ``"device"`` (HBM) or ``"host"`` (pinned, mapped).
    params : the tables' codec parameters (one arena width for every table it serves).
    """

    def __init__(
        self,
        slots: int,
        dim: int,
        record_bytes: int,
        dtype: str,
        device: str,
        kind: str,
        xp: Any,
        params: dict[str, Any] | None = None,
    ) -> None:
        self.device = device
        self.kind = kind
        self.record_bytes = record_bytes
        self.xp = xp
        self.stream: Any = None
        self.device_id = -1
        self.dev_map: Any = None
        self._host_mem: list[Any] = []
        self._staging = np.empty((0, record_bytes), dtype=np.uint8)
        self._ctl: Any = None
        codec = get_codec(dtype)
        vdt = codec.value_dtype
        fp8 = codec.row_scales
        dim = codec.arena_width(dim, params)
        if device == "cpu":
            self.table: Any = np.zeros((slots, dim), dtype=vdt)
            self.scales: Any = np.ones(slots, dtype=np.float32) if fp8 else None
            return
        cp = xp
        if kind == "device":
            self.table = cp.zeros((slots, dim), dtype=vdt)
            self.scales = cp.ones(slots, dtype=cp.float32) if fp8 else None
        else:
            self.table = self._mapped_array((slots, dim), vdt)
            self.table[...] = 0
            self.scales = self._mapped_array((slots,), np.float32) if fp8 else None
            if self.scales is not None:
                self.scales[...] = 1
        self.stream = cp.cuda.get_current_stream()
        self.device_id = cp.cuda.Device().id
        self._side = np.empty(0, dtype=np.int32)
        self._commit: Any = None  # rowcache.kernels.scatter.FaultCommit over the staging buffer
        # events made once and re-recorded (a fresh one per record is one more CUDA call)
        self._copy_event = cp.cuda.Event(disable_timing=True)
        self._copy_done: Any = None  # _copy_event once a fault's launch has recorded it
        self._out_ring: list[tuple[np.ndarray, Any]] = [
            (np.empty(0, dtype=np.int32), None) for _ in range(OUT_RING)
        ]
        self._out_events = [cp.cuda.Event(disable_timing=True) for _ in range(OUT_RING)]
        self._out_next = 0

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    # -- pinned memory -----------------------------------------------------
    def pinned_host(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A NumPy array over pinned host memory mapped into the device (with unified
        addressing its host address is its device address)."""
        cp = self.xp
        count = int(np.prod(shape))
        nbytes = max(count * np.dtype(dtype).itemsize, 1)
        mem = cp.cuda.PinnedMemory(nbytes, cp.cuda.runtime.hostAllocMapped)
        self._host_mem.append(mem)
        ptr = cp.cuda.PinnedMemoryPointer(mem, 0)
        return np.frombuffer(ptr, dtype=dtype, count=count).reshape(shape)

    def _mapped_array(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A cupy array over pinned host memory mapped into the device (zero-copy)."""
        cp = self.xp
        nbytes = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
        mem = cp.cuda.PinnedMemory(nbytes, cp.cuda.runtime.hostAllocMapped)
        self._host_mem.append(mem)
        um = cp.cuda.UnownedMemory(mem.ptr, nbytes, mem)
        return cp.ndarray(shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(um, 0))

    # -- the demand fault's buffers ------------------------------------------
    def staging_rows(self, n: int) -> np.ndarray:
        """The staging buffer, at least ``n`` records (pinned on the GPU), once the last
        launch that reads it has run."""
        if self.gpu and self._copy_done is not None:
            self._copy_done.synchronize()  # the staging and side buffers' last launch ran
        if self._staging.shape[0] < n:
            cap = max(n, 2 * self._staging.shape[0], 256)
            rec = self.record_bytes
            if self.gpu:  # pinned and mapped into the device: the fault kernel reads it in place
                import rowcache.kernels.scatter

                self._staging = self.pinned_host((cap, rec), np.uint8)
                self._commit = rowcache.kernels.scatter.FaultCommit(
                    self.table, self.scales, rec, self._staging.ctypes.data
                )
            else:
                self._staging = np.empty((cap, rec), dtype=np.uint8)
        return self._staging

    def staged(self, n: int) -> np.ndarray:
        """The first ``n`` staged records."""
        return self._staging[:n]

    def side_ints(self, n: int) -> np.ndarray:
        """The fault launch's pinned int32 side buffer, at least ``n`` long (GPU; after
        :meth:`staging_rows`, which waits for the last launch)."""
        if self._side.size < n:
            self._side = self.pinned_host((max(n, 2 * self._side.size, 1024),), np.int32)
        return self._side

    def fill_side(
        self, slots: np.ndarray, rows: np.ndarray, evicted: np.ndarray, n_out: int = 0
    ) -> np.ndarray:
        """Write a fault's side buffer (GPU: its launch reads it in place): ``[slots (m) |
        rows (m) | evicted (e)]``, with room for ``n_out`` more entries after them (the
        call's slots, which the LRU's commit may write there for the launch to carry);
        returns the view of those ``n_out``."""
        m = slots.size
        e0 = 2 * m + evicted.size
        side = self.side_ints(e0 + n_out)
        side[:m] = slots
        side[m : 2 * m] = rows
        side[2 * m : e0] = evicted
        return side[e0 : e0 + n_out]

    def ctl(self) -> np.ndarray:
        """Pinned int32[2] a deferred read's end is written to and ``fault_wait`` polls."""
        if self._ctl is None:
            self._ctl = self.pinned_host((2,), np.int32)
            self._ctl[:] = 0
        return self._ctl

    def scatter(self, records: np.ndarray, slots: np.ndarray) -> None:
        """CPU: write ``records`` into ``slots``' rows."""
        scatter_records_reference(records, slots, self.table, self.scales)

    def launch(self, n: int, e: int, out: Any, ctl: int = 0, seq: int = 0) -> None:
        """The GPU side of a fault whose ``n`` records are staged (or, with ``ctl``, being
        staged) and whose side buffer holds ``[victims (n) | rows (n) | evicted (e) (|
        out)]``: one launch on the cache's stream writes the records, updates the device
        map and fills ``out`` (a cupy int32 array, or None)."""
        self._commit(
            self._staging.ctypes.data,
            self._side.ctypes.data,
            n,
            e,
            self.dev_map,
            self.stream,
            out,
            ctl,
            seq,
        )
        self._copy_event.record(self.stream)  # the buffers are free once it has run
        self._copy_done = self._copy_event

    def to_device(self, out: np.ndarray) -> Any:
        """``out`` as a new cupy array, copied asynchronously through a ring of pinned
        buffers: a call waits only for the copy of the call ``OUT_RING`` calls ago."""
        cp = self.xp
        n = out.size
        k = self._out_next
        self._out_next = (k + 1) % OUT_RING
        buf, done = self._out_ring[k]
        if done is not None:
            done.synchronize()  # this buffer's previous copy has left it
        if buf.size < n:
            import cupyx

            buf = cupyx.empty_pinned(max(n, 2 * buf.size, 1024), dtype=np.int32)
        buf[:n] = out
        dev = cp.empty(n, dtype=cp.int32)
        with self.stream:
            dev.set(buf[:n], stream=self.stream)
            done = self._out_events[k]
            done.record(self.stream)
            self._out_ring[k] = (buf, done)
        return dev

    # -- the device map ----------------------------------------------------
    def device_map(self, slots: SlotTable) -> Any:
        """The device row -> slot map, made from ``slots`` on first call (rows still being
        read by prefetch pieces are not shown yet)."""
        if self.dev_map is None:
            m = slots.row_map.to_dense()
            if slots.reserved:
                m = m.copy()
                m[slots.slot_row[np.flatnonzero(slots.state == READING)]] = -1
            with self.stream:
                self.dev_map = self.xp.asarray(m)
        return self.dev_map

    def sync_device_map(self, evicted: np.ndarray, rows: np.ndarray, slots: np.ndarray) -> None:
        """Show ``rows`` in ``slots`` and hide ``evicted`` in the device map (if made), in
        stream order after the arena writes: one packed upload, one scatter. A row evicted
        and mapped by one call cannot happen (its slot would be a hit)."""
        m = evicted.size + rows.size
        if self.dev_map is None or m == 0:
            return
        packed = np.empty(2 * m, dtype=np.int32)
        packed[: evicted.size] = evicted
        packed[evicted.size : m] = rows
        packed[m : m + evicted.size] = -1
        packed[m + evicted.size :] = slots
        dev = self.to_device(packed)
        with self.stream:
            self.dev_map[dev[:m]] = dev[m:]

    def stream_event(self) -> Any:
        """GPU: an event recorded on the cache's stream now (on its device)."""
        cp = self.xp
        with cp.cuda.Device(self.device_id):
            ev = cp.cuda.Event(block=False, disable_timing=True)
            ev.record(self.stream)
        return ev
