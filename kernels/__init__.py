"""GPU kernels of rowcache, each with its launcher and its NumPy reference.

Every public function here takes NumPy or cupy arrays and runs the NumPy reference
or the CUDA kernel accordingly; the results are bit-identical where the spec says so.
"""

from __future__ import annotations

from ._cuda import gpu_available
from .gather import batched_embed, batched_embed_fp8
from .quantize import quantize_fp8
from .scatter import scatter_records

__all__ = [
    "batched_embed",
    "batched_embed_fp8",
    "gpu_available",
    "quantize_fp8",
    "scatter_records",
]
