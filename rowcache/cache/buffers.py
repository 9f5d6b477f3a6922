"""The fault path's buffers of ``NgramRowCache``: staging, side buffer, the GPU arena.

Owns the mixin :class:`FaultBuffers`: on the GPU the arena's set-up (device memory, or
pinned host memory mapped into the device), the pinned staging buffer the fault kernel
reads in place, the pinned int32 side buffer of its launch, the launch itself
(``rowcache.kernels.scatter.FaultCommit``: records, device map, slots in one launch), and the
ring of pinned buffers that carries int32 arrays to the device (:data:`OUT_RING`); on
the CPU, the staging buffer. Does not choose victims, read or commit
(``rowcache.cache.fault``, ``rowcache.cache.deferred``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.cache.state import CacheState

OUT_RING = 8  # pinned buffers for int32 arrays on their way to the device (slots, map updates)


class FaultBuffers(CacheState):
    """Buffers and launch of :class:`rowcache.cache.fault.FaultPath` (a mixin)."""

    dtype: str
    record_bytes: int
    arena_kind: str
    table: Any
    scales: Any
    _staging: Any

    def _value_dtype(self) -> Any:
        from rowcache.store.sources import BF16

        return BF16 if self.dtype == "bf16" else np.uint8

    def _init_gpu(self, S: int, dim: int, rec: int) -> None:
        cp = self._xp
        vdt = self._value_dtype()
        nbytes = S * dim * np.dtype(vdt).itemsize
        if self.arena_kind == "device":
            self.table = cp.zeros((S, dim), dtype=vdt)
            self.scales = cp.ones(S, dtype=cp.float32) if self.dtype == "fp8" else None
        else:
            self._host_mem: list[Any] = []
            self.table = self._mapped_array((S, dim), vdt, nbytes)
            self.table[...] = 0
            if self.dtype == "fp8":
                self.scales = self._mapped_array((S,), np.float32, S * 4)
                self.scales[...] = 1
            else:
                self.scales = None
        self._stream = cp.cuda.get_current_stream()
        self._device_id = cp.cuda.Device().id
        self._staging = np.empty((0, rec), dtype=np.uint8)
        self._side = np.empty(0, dtype=np.int32)
        self._commit: Any = None  # rowcache.kernels.scatter.FaultCommit over the staging buffer
        # events made once and re-recorded (a fresh one per record is one more CUDA call)
        self._copy_event = cp.cuda.Event(disable_timing=True)
        self._copy_done = None  # _copy_event once a fault's launch has recorded it
        self._out_ring: list[tuple[np.ndarray, Any]] = [
            (np.empty(0, dtype=np.int32), None) for _ in range(OUT_RING)
        ]
        self._out_events = [cp.cuda.Event(disable_timing=True) for _ in range(OUT_RING)]
        self._out_next = 0

    def _pinned_host(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A NumPy array over pinned host memory mapped into the device (with unified
        addressing its host address is its device address)."""
        cp = self._xp
        nbytes = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
        mem = cp.cuda.PinnedMemory(nbytes, cp.cuda.runtime.hostAllocMapped)
        if not hasattr(self, "_host_mem"):
            self._host_mem = []
        self._host_mem.append(mem)
        ptr = cp.cuda.PinnedMemoryPointer(mem, 0)
        return np.frombuffer(ptr, dtype=dtype, count=int(np.prod(shape))).reshape(shape)

    def _mapped_array(self, shape: tuple[int, ...], dtype: Any, nbytes: int) -> Any:
        """A cupy array over pinned host memory mapped into the device (zero-copy)."""
        cp = self._xp
        mem = cp.cuda.PinnedMemory(max(nbytes, 1), cp.cuda.runtime.hostAllocMapped)
        self._host_mem.append(mem)
        um = cp.cuda.UnownedMemory(mem.ptr, max(nbytes, 1), mem)
        return cp.ndarray(shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(um, 0))

    def _staging_rows(self, n: int) -> np.ndarray:
        """Host staging buffer of at least ``n`` records (pinned on the GPU path)."""
        if self._staging.shape[0] < n:
            cap = max(n, 2 * self._staging.shape[0], 256)
            rec = self.record_bytes
            if self.device == "cuda":
                # pinned and mapped into the device: the fault kernel reads it in place
                import rowcache.kernels.scatter

                self._staging = self._pinned_host((cap, rec), np.uint8)
                self._commit = rowcache.kernels.scatter.FaultCommit(
                    self.table, self.scales, rec, self._staging.ctypes.data
                )
            else:
                self._staging = np.empty((cap, rec), dtype=np.uint8)
        return self._staging

    def _side_ints(self, n: int) -> np.ndarray:
        """The fault launch's pinned int32 side buffer, at least ``n`` long (GPU path;
        call only after the staging buffer's last copy has left it, as ``_fault_read``
        does)."""
        if self._side.size < n:
            self._side = self._pinned_host((max(n, 2 * self._side.size, 1024),), np.int32)
        return self._side

    def _fault_launch(self, n: int, e: int, out: Any, ctl: int = 0, seq: int = 0) -> None:
        """The GPU side of a fault whose ``n`` records are staged (or, with ``ctl``, being
        staged: ``rowcache.kernels.scatter.FaultCommit``) and whose side buffer holds ``[victims
        (n) | rows (n) | evicted (e) (| out)]``: one launch on the cache's stream writes
        the records, updates the device map and fills ``out`` (a cupy int32 array, or
        None)."""
        self._commit(self._staging.ctypes.data, self._side.ctypes.data, n, e, self._dev_map,
                     self._stream, out, ctl, seq)  # fmt: skip
        self._copy_event.record(self._stream)  # the buffers are free once it has run
        self._copy_done = self._copy_event

    def _to_device(self, out: np.ndarray) -> Any:
        """``out`` as a new cupy array, copied asynchronously through a ring of pinned buffers.

        A ring, so that a call waits only for the copy of the call ``OUT_RING`` calls
        ago (long done), never for the stream's recent work.
        """
        cp = self._xp
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
        with self._stream:
            dev.set(buf[:n], stream=self._stream)
            done = self._out_events[k]
            done.record(self._stream)
            self._out_ring[k] = (buf, done)
        return dev
