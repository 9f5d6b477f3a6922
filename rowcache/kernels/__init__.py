"""GPU kernels of rowcache, each with its launcher and its NumPy reference.

Every public function here takes NumPy or cupy arrays and runs the NumPy reference
or the CUDA kernel accordingly; the results are bit-identical where the spec says so.
"""

from __future__ import annotations

from rowcache.kernels.gather import (
    batched_embed,
    batched_embed_fp8,
    batched_embed_fp8_block,
    batched_embed_fp8_table_scale,
)
from rowcache.kernels.gemm import gemm_bf16_f32, gemm_bf16_f32_parts, scale_sum
from rowcache.kernels.loader import gpu_available
from rowcache.kernels.ngram.hash import hash_gather, ngram_hash
from rowcache.kernels.ngram.stacked import StackedTables, gather_stacked
from rowcache.kernels.overlay.routed import (
    embed_overlay_routed,
    embed_rowdiff,
    lmhead_overlay_mma,
    lmhead_overlay_routed,
)
from rowcache.kernels.quantize import quantize_fp8
from rowcache.kernels.scatter import scatter_records

__all__ = [
    "StackedTables",
    "batched_embed",
    "batched_embed_fp8",
    "batched_embed_fp8_block",
    "batched_embed_fp8_table_scale",
    "embed_overlay_routed",
    "embed_rowdiff",
    "gather_stacked",
    "gemm_bf16_f32",
    "gemm_bf16_f32_parts",
    "gpu_available",
    "hash_gather",
    "lmhead_overlay_mma",
    "lmhead_overlay_routed",
    "ngram_hash",
    "quantize_fp8",
    "scale_sum",
    "scatter_records",
]
