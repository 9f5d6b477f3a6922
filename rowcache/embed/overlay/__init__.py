"""Token overlay: per-sequence adapters that override vocab rows of the embedding and LM head.

:class:`TokenOverlay` (``overlay``) is the public class; ``tables`` builds the adapters'
override tables, ``lmhead_paths`` chooses and sizes the GPU LM-head path.
"""

from __future__ import annotations

from rowcache.embed.overlay.overlay import OverlayAdapterInfo, TokenOverlay

__all__ = ["OverlayAdapterInfo", "TokenOverlay"]
