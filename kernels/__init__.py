"""GPU kernels of rowcache, each with its launcher and its NumPy reference.

Every public function here takes NumPy or cupy arrays and runs the NumPy reference
or the CUDA kernel accordingly; the results are bit-identical where the spec says so.
"""

from __future__ import annotations

from ._cuda import gpu_available

__all__ = ["gpu_available"]
