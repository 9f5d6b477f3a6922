"""What this machine can give a job now: memory for a new allocation, on the host and the GPU.

Owns :func:`available_memory` (Linux ``MemAvailable``) and :func:`available_device_memory`
(``cudaMemGetInfo``'s free bytes), read by the commands that estimate their own need before
they allocate (``profile``'s exact curves, ``demo``) so that a request too large for the
machine is refused with both figures instead of being killed by the kernel.
"""

from __future__ import annotations

from typing import Any


def available_memory() -> int | None:
    """Bytes of memory a new allocation can have now (Linux ``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_device_memory(xp: Any) -> int | None:
    """Free bytes of the current CUDA device plus what cupy's pool holds unused, or None."""
    try:
        free, _total = xp.cuda.runtime.memGetInfo()
        pool = xp.get_default_memory_pool()
        return int(free) + int(pool.free_bytes())
    except Exception:  # no runtime, no device: the caller skips the check
        return None
