"""Launch plumbing of the token-overlay kernels (``rowcache/kernels/overlay/overlay.cu``).

Owns the source's kernel names and tiles (:data:`LMHEAD_TILES`, :data:`MMA_CONFIGS`),
the block and grid sizes, the argument conversions every launcher shares (bf16 as
uint16, the routing pointer, the logits' kernel variant), ``compile_overlay_kernels``
and the mma kernels' per-device cache (their shared-memory opt-in).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from rowcache.errors import ConfigError
from rowcache.kernels.loader import get_kernel, is_device_array, require_cupy
from rowcache.kernels.overlay.checks import describe_array

SOURCE = "overlay/overlay.cu"
# (overrides, rows) each LM-head warp works on at once; (1, 1) is one warp per (row, j).
LMHEAD_TILES = ((1, 1), (2, 2), (2, 4), (4, 4))
DEFAULT_LMHEAD_TILE = (4, 4)
KERNEL_NAMES = (
    "embed_rowdiff",
    "embed_overlay_routed_i32",
    "embed_overlay_routed_i64",
    *(f"lmhead_overlay_routed_{t}_j{j}r{r}" for t in ("f32", "bf16") for j, r in LMHEAD_TILES),
    "lmhead_overlay_scatter_f32",
    "lmhead_overlay_scatter_bf16",
)
# The tensor-core ("mma") path's kernels: (16-row tiles, warps, ring stages) per block.
# The warps split K; each lane streams its own operands through a ring of `stages`
# k-blocks of shared memory (2 * tiles + 4 chunks of 16 bytes each: 96 KiB per block for
# (1, 8, 4), two blocks per SM; 128 KiB for (2, 8, 4), one). Measured on the H200 and
# dropped (bench/overlay.py, 64 rows over 4 x 1,000 overrides, graph): 4 warps per
# block, (1, 4, 8) 0.031 ms and (2, 4, 6) 0.033 ms against 0.020-0.021 ms with 8, and a
# block-shared layout (a warp per tile, tiles and hidden rows staged together, a barrier
# per 128-column stage) 0.055-0.059 ms: the time follows the k-blocks each warp waits on
# in turn, not the bytes in flight.
MMA_CONFIGS = ((1, 8, 4), (2, 8, 4))
DEFAULT_MMA_CONFIG = (2, 8, 4)  # 0.0200 vs 0.0206 ms (above); half the hidden-row reads


def _mma_name(dtype: str, config: tuple[int, int, int]) -> str:
    t, w, st = config
    return f"lmhead_overlay_mma_{dtype}_t{t}w{w}d{st}"


def _mma_smem(config: tuple[int, int, int]) -> int:
    """Dynamic shared memory (bytes) of the mma kernel of ``config``."""
    t, w, st = config
    return st * (2 * t + 4) * w * 32 * 16


MMA_KERNEL_NAMES = tuple(_mma_name(d, c) for d in ("f32", "bf16") for c in MMA_CONFIGS)
KERNEL_NAMES = KERNEL_NAMES + MMA_KERNEL_NAMES
SCATTER_BLOCK = 256
BLOCK = 256  # threads per block of the rowdiff and embed kernels (8 warps)
WARPS = BLOCK // 32
ROW_TILE = 64  # LM-head rows per block along grid z (the kernel's LM_ROW_TILE: two ballots)
MAX_GRID = 1 << 20  # grid-stride loops cover anything larger


def compile_overlay_kernels() -> None:
    """Compile every overlay kernel now (NVRTC); raises GpuUnavailableError without a GPU."""
    for name in KERNEL_NAMES:
        get_kernel(SOURCE, name)
    for dtype in ("f32", "bf16"):  # and let the mma kernels use their shared memory
        for config in MMA_CONFIGS:
            mma_kernel(dtype, config)


def as_u16(cp: Any, a: Any) -> Any:
    return a.view(cp.uint16)


def aligned(*arrays: Any) -> bool:
    return all(a.data.ptr % 16 == 0 for a in arrays)


def logits_launch_arg(cp: Any, logits: Any) -> tuple[str, Any]:
    """The kernel variant of ``logits``' dtype (``"f32"`` or ``"bf16"``) and the array
    to pass (bf16 as uint16)."""
    if logits.dtype == np.float32:
        return "f32", logits
    return "bf16", as_u16(cp, logits)


def grid_size(n: int) -> int:
    return max(1, min(n, MAX_GRID))


def slot_arg(cp: Any, seq_slot: Any) -> Any:
    if seq_slot is None:
        return np.uint64(0)  # a null int32 pointer: every row takes `active`
    if not is_device_array(seq_slot):
        raise ConfigError(f"seq_slot must be a cupy array here, got {describe_array(seq_slot)}")
    return cp.ascontiguousarray(seq_slot, dtype=cp.int32)


@functools.cache
def _mma_kernel_on(dtype: str, config: tuple[int, int, int], device_id: int) -> tuple[Any, int]:
    kern = get_kernel(SOURCE, _mma_name(dtype, config))  # a cupy.RawKernel
    smem = _mma_smem(config)
    # Above 48 KiB of dynamic shared memory a kernel must opt in, once per device (not a
    # stream operation: done at first use, before any capture).
    kern.max_dynamic_shared_size_bytes = smem
    # All of the SM's unified L1/shared memory as shared, so that two blocks fit.
    kern.preferred_shared_memory_carveout = 100
    return kern, smem


def mma_kernel(dtype: str, config: tuple[int, int, int]) -> tuple[Any, int]:
    """The mma kernel of ``config`` ready to launch, and its dynamic shared memory."""
    cp = require_cupy("lmhead_overlay_mma")
    return _mma_kernel_on(dtype, config, cp.cuda.runtime.getDevice())
