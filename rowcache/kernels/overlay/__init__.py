"""Token-overlay kernels: ``embed_rowdiff``, ``embed_overlay_routed``, ``lmhead_overlay_routed``.

``routed`` (the launchers and the choice between the LM-head paths), ``lmhead`` (the packed
table's GEMM and mma paths), ``pack`` (packing the LM-head rows), ``launch`` (kernel names,
tiles, launch plumbing), ``checks`` (argument checks), ``reference`` (the NumPy
specification). CUDA source: ``overlay.cu`` beside them.
"""

from __future__ import annotations

from rowcache.kernels.overlay.routed import (
    embed_overlay_routed,
    embed_rowdiff,
    lmhead_overlay_mma,
    lmhead_overlay_routed,
)

__all__ = ["embed_overlay_routed", "embed_rowdiff", "lmhead_overlay_mma", "lmhead_overlay_routed"]
