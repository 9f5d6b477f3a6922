"""The device row -> slot map of ``NgramRowCache`` on the GPU.

Owns the mixin :class:`DeviceMap`: the cupy int32[rows] mirror of the host row map
(made on first ``device_map()`` call), its updates in stream order after each
fault's or prefetch's arena writes, and the cache's CUDA stream. Decides nothing
about residency (``rowcache.cache.lru``, ``rowcache.cache.fault``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rowcache.cache.state import BUSY_READING, CacheState
from rowcache.errors import ConfigError


class DeviceMap(CacheState):
    """The device map of :class:`rowcache.cache.row_cache.NgramRowCache` (a mixin)."""

    _stream: Any

    def device_map(self) -> Any:
        """The row -> slot map on the GPU: cupy int32[rows] (-1: not resident).

        Made on first call (``rows`` x 4 bytes of device memory) and from then on
        updated by every fault, on the cache's stream after the fault's arena writes:
        a kernel on that stream can look rows up without the host. A slot read this
        way is only safe to use while the row is pinned, so a caller that gathers
        through the map first must still :meth:`resolve` the rows (which pins them and
        keeps the LRU exact), and redo its gathers if that call faulted
        (:attr:`last_faults`), as ``rowcache.embed.NgramEmbedding`` does.
        """
        if self.device != "cuda":
            raise ConfigError("device_map() needs a cache with device='cuda'")
        with self._lock:
            if self._dev_map is None:
                m = self._row_slot
                if self._n_busy:  # rows whose prefetch is still reading are not mapped yet
                    m = m.copy()
                    m[self._slot_row[np.flatnonzero(self._busy == BUSY_READING)]] = -1
                with self._stream:
                    self._dev_map = self._xp.asarray(m)
            return self._dev_map

    def _sync_device_map(self, evicted: np.ndarray, rows: np.ndarray, victims: np.ndarray) -> None:
        # One packed upload (rows, then their slots; evicted rows map to -1) through the
        # pinned ring, then one scatter, both in stream order after the arena writes. A
        # row evicted and faulted back in by one call cannot happen (its slot would be a
        # hit), so the order within the update is moot.
        m = evicted.size + rows.size
        if m == 0:
            return
        packed = np.empty(2 * m, dtype=np.int32)
        packed[: evicted.size] = evicted
        packed[evicted.size : m] = rows
        packed[m : m + evicted.size] = -1
        packed[m + evicted.size :] = victims
        dev = self._to_device(packed)
        with self._stream:
            self._dev_map[dev[:m]] = dev[m:]

    @property
    def stream(self) -> Any:
        """The CUDA stream the cache writes the arena on (``device="cuda"``), else None."""
        return getattr(self, "_stream", None)
