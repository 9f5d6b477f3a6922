"""Token overlay: per-sequence adapters that override vocab rows of the embedding and LM head.

:class:`TokenOverlay` (``overlay``) is the public class. It owns two objects and calls them:
``tables.OverlayTables`` (the adapters' override tables and their device pointer tables) and
``lmhead_paths.LmHeadPaths`` (the GPU LM-head path choice, its knobs and the packed table).
"""

from __future__ import annotations

from rowcache.embed.overlay.overlay import OverlayAdapterInfo, TokenOverlay

__all__ = ["OverlayAdapterInfo", "TokenOverlay"]
