"""Offline tools: traces, miss-ratio curves, cache sizing."""

from __future__ import annotations

__all__: list[str] = []
