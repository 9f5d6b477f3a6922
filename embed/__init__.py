"""The n-gram embedding layer: LongCat ids, tables, the fused embedding, the overlay."""

from __future__ import annotations

__all__: list[str] = []
