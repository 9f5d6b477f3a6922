"""How an Engram checkpoint stores its tables, as its config states it.

Owns :class:`EngramTableFormat`: the config's ``engram_dtype`` (``"bf16"``: one table of
values a layer, the demo's; ``"fp8"``: E4M3 codes with block scales, DeepSeek-V4.1's),
``engram_block_size`` and ``engram_scale_fmt`` (``"ue8m0"``), validated (a value rowcache
does not know is refused, naming the key). A field the config leaves out is taken from the
tensors, and the tensors are checked against the fields it gives, by
``rowcache.embed.engram.checkpoint``. The hash's fields are
:class:`~rowcache.embed.engram.config.EngramConfig`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from rowcache.errors import ConfigError

DTYPE_KEY = "engram_dtype"
BLOCK_KEY = "engram_block_size"
SCALE_KEY = "engram_scale_fmt"


@dataclass(frozen=True, kw_only=True)
class EngramTableFormat:
    """The format of a checkpoint's Engram tables (docs/engram-spec.md, its last section).

    Parameters
    ----------
    dtype : ``"bf16"`` (values: a BF16, F32 or F16 tensor a layer) or ``"fp8"`` (E4M3 codes,
        ``layers.{L}.engram.embed.weight``, with one scale a block of values,
        ``layers.{L}.engram.embed.scale``); None where the config does not say.
    block_size : values one scale covers (V4.1: 32); None where the config does not say.
    scale_fmt : the scales' format, ``"ue8m0"`` (one exponent byte, ``2**(e - 127)``, 255
        NaN); None where the config does not say.
    """

    DTYPES: ClassVar[tuple[str, ...]] = ("bf16", "fp8")
    SCALE_FMTS: ClassVar[tuple[str, ...]] = ("ue8m0",)

    dtype: str | None = None
    block_size: int | None = None
    scale_fmt: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in self.DTYPES:
            raise ConfigError(
                f"config[{DTYPE_KEY!r}] is {self.dtype!r}; rowcache reads "
                "'fp8' (E4M3 codes with block scales) or 'bf16' (values)"
            )
        b = self.block_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1):
            raise ConfigError(
                f"config[{BLOCK_KEY!r}] is {b!r}; give the values one scale covers, an integer >= 1"
            )
        if self.scale_fmt is not None and self.scale_fmt not in self.SCALE_FMTS:
            raise ConfigError(
                f"config[{SCALE_KEY!r}] is {self.scale_fmt!r}; rowcache reads block scales "
                f"as {', '.join(map(repr, self.SCALE_FMTS))} (one exponent byte a block)"
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> EngramTableFormat:
        """The format a checkpoint's ``config.json`` dict (or its ``engram_config`` part)
        states; fields it leaves out are None."""
        if not isinstance(config, Mapping):
            raise ConfigError(f"config must be a dict, got {type(config).__name__}")
        nested = config.get("engram_config")
        if isinstance(nested, Mapping):
            config = {**config, **nested}
        return cls(
            dtype=config.get(DTYPE_KEY),
            block_size=config.get(BLOCK_KEY),
            scale_fmt=config.get(SCALE_KEY),
        )

    @property
    def block_scaled(self) -> bool:
        """The config says FP8 codes with block scales."""
        return self.dtype == "fp8"


__all__ = ["BLOCK_KEY", "DTYPE_KEY", "SCALE_KEY", "EngramTableFormat"]
