"""The parameters of Qwen3.8-Flash-Next's (``qwen4_exp``) n-gram hash.

Owns :class:`Qwen4NgramConfig` (frozen, validated; transformers' ``Qwen4ExpTextConfig``
defaults where that class has them, :meth:`~Qwen4NgramConfig.release` for the released
checkpoint's values, :meth:`~Qwen4NgramConfig.from_config` for a ``config.json``). The
multipliers, head primes and offsets they fix live with the hash
(``rowcache.embed.qwen4.hash``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rowcache.errors import ConfigError

MAX_NGRAM = 16  # the native hash's bounds (csrc/engram_hash.c)
MAX_HEADS = 4096
MAX_VOCAB = 2**31 - 1
MAX_HEAD_ROWS = 1 << 40
_DEFAULT_HIDDEN_SIZE = 2048  # Qwen4ExpTextConfig.hidden_size: ple_embed_dim's default


@dataclass(frozen=True, kw_only=True)
class Qwen4NgramConfig:
    """The n-gram hash of one ``qwen4_exp`` checkpoint (docs/qwen4-spec.md, "Config").

    Defaults are ``Qwen4ExpTextConfig``'s (transformers 5.25) where it has one; the fields it
    leaves unset (``eos_token_id``, ``ple_layer_ids``, ``ple_embed_dim``) must be given.
    :meth:`release` is the released checkpoint's values.

    Parameters
    ----------
    vocab_size : token ids, ``[0, vocab_size)`` (248,320; raw ids, no compression).
    eos_token_id : the segment separator, and what positions before a sequence's start read
        (release 248,044; config.json's list: its first).
    ngram_size : the largest n-gram (3: orders 2 and 3), 2..16.
    heads_per_ngram : hashed heads per order (8).
    ngram_vocab_size_base : where the head primes' search starts (20,000,000): head ``h`` of
        table ``L`` has the ``(heads * L + h + 1)``-th prime above ``base - 1``.
    make_ngram_vocab_size_divisible_by : the table's rows are padded up to a multiple (128).
    split_ngram_parts : checkpoint shards of the table (class default 512; release 128).
    ple_layer_ids : 1-based decoder layers with a table (release ``(2,)``); kept sorted and
        distinct, as transformers keeps them. A table's index in it is its ``L``.
    ple_embed_dim : one position's output width, all heads' rows together (release 2,560).
    seed : the multipliers' seed (1234).
    defaulted : the fields :meth:`from_config` did not find (not compared).
    """

    vocab_size: int = 248_320
    eos_token_id: int
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    split_ngram_parts: int = 512
    ple_layer_ids: tuple[int, ...]
    ple_embed_dim: int
    seed: int = 1234
    defaulted: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        vocab = _integer("vocab_size", self.vocab_size, 1, MAX_VOCAB)
        _integer("eos_token_id", self.eos_token_id, 0, vocab - 1)
        n = _integer("ngram_size", self.ngram_size, 2, MAX_NGRAM)
        heads = _integer("heads_per_ngram", self.heads_per_ngram, 1, MAX_HEADS)
        if (n - 1) * heads > MAX_HEADS:
            raise ConfigError(
                f"heads_per_ngram={heads}: (ngram_size - 1) * heads_per_ngram is at most "
                f"{MAX_HEADS}"
            )
        _integer("ngram_vocab_size_base", self.ngram_vocab_size_base, 2, MAX_HEAD_ROWS)
        _integer(
            "make_ngram_vocab_size_divisible_by",
            self.make_ngram_vocab_size_divisible_by,
            1,
            MAX_HEAD_ROWS,
        )
        _integer("split_ngram_parts", self.split_ngram_parts, 1, MAX_HEAD_ROWS)
        layers = self.ple_layer_ids
        if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
            raise ConfigError(
                f"ple_layer_ids={layers!r}: give a sequence of 1-based decoder layer ids"
            )
        layers = tuple(layers)
        if not layers:
            raise ConfigError(
                "ple_layer_ids=(): give the 1-based decoder layers with an n-gram table "
                "(release: (2,))"
            )
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 1:
                raise ConfigError(
                    f"ple_layer_ids={self.ple_layer_ids!r}: give 1-based decoder layer ids "
                    "(integers >= 1)"
                )
        width = _integer("ple_embed_dim", self.ple_embed_dim, 1, 1 << 30)
        if width % ((n - 1) * heads):
            raise ConfigError(
                f"ple_embed_dim={width}: must be divisible by the heads, "
                f"(ngram_size - 1) * heads_per_ngram = {(n - 1) * heads}"
            )
        _integer("seed", self.seed, 0, 2**64 - 1)
        object.__setattr__(self, "ple_layer_ids", tuple(sorted({int(x) for x in layers})))
        for name in ("vocab_size", "eos_token_id", "ngram_size", "heads_per_ngram", "seed"):
            object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def heads(self) -> int:
        """Head tables of one position, ``(ngram_size - 1) * heads_per_ngram`` (16): the
        columns of the hash's ids."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def head_dim(self) -> int:
        """Values a table row holds, ``ple_embed_dim / heads`` (release 160)."""
        return self.ple_embed_dim // self.heads

    @classmethod
    def release(cls) -> Qwen4NgramConfig:
        """The released Qwen3.8-Flash-Next's ``text_config`` values (docs/qwen4-spec.md):
        one table at decoder layer 2, 16 heads of 160 values, 128 checkpoint shards."""
        return cls(
            vocab_size=248_320,
            eos_token_id=248_044,
            ngram_size=3,
            heads_per_ngram=8,
            ngram_vocab_size_base=20_000_000,
            make_ngram_vocab_size_divisible_by=128,
            split_ngram_parts=128,
            ple_layer_ids=(2,),
            ple_embed_dim=2560,
            seed=1234,
        )

    @classmethod
    def from_config(cls, source: Mapping[str, Any] | str | os.PathLike[str]) -> Qwen4NgramConfig:
        """The hash of a checkpoint's config.

        Parameters
        ----------
        source : a ``config.json`` path, or its directory; the full config dict (its
            ``text_config`` is read); or the text config dict.

        Fields absent (or null) take ``Qwen4ExpTextConfig``'s defaults and are named in
        ``defaulted`` (``ple_embed_dim``'s default is ``hidden_size``, itself 2,048 if
        absent); ``eos_token_id`` and ``ple_layer_ids`` have none and must be there. A value
        that is invalid is a ConfigError naming its key.
        """
        config = _load(source)
        text = config.get("text_config")
        if isinstance(text, Mapping):
            config = text
        found: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name != "defaulted" and config.get(f.name) is not None:
                found[f.name] = config[f.name]
        eos = found.get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            if not eos:
                raise ConfigError("config['eos_token_id'] = []: give the EOS token id")
            found["eos_token_id"] = eos[0]  # transformers takes the first
        for name in ("eos_token_id", "ple_layer_ids"):
            if name not in found:
                raise ConfigError(
                    f"config has no {name!r}: a qwen4_exp text config with an n-gram table "
                    "states it (transformers has no default)"
                )
        defaulted = [
            f.name for f in dataclasses.fields(cls) if f.name not in found and f.name != "defaulted"
        ]
        if "ple_embed_dim" not in found:
            hidden = config.get("hidden_size")
            found["ple_embed_dim"] = _DEFAULT_HIDDEN_SIZE if hidden is None else hidden
        try:
            return cls(**found, defaulted=tuple(defaulted))
        except ConfigError as e:
            message = str(e)
            for name in found:
                if message.startswith(f"{name}="):
                    key = "hidden_size" if name == "ple_embed_dim" and name in defaulted else name
                    message = f"config[{key!r}]: {message}"
                    break
            raise ConfigError(message) from None


def _load(source: Mapping[str, Any] | str | os.PathLike[str]) -> Mapping[str, Any]:
    """The config dict of ``source``: itself, or the JSON of a path (a directory: its
    ``config.json``)."""
    if isinstance(source, Mapping):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(
            f"config must be a dict or a config.json path, got {type(source).__name__}"
        )
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"config {str(path)!r}: cannot be read ({e.strerror})") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"config {str(path)!r}: not JSON ({e})") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"config {str(path)!r}: holds {type(data).__name__}, not an object")
    return data


def _integer(name: str, value: Any, low: int, high: int) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or not low <= value <= high
    ):
        raise ConfigError(f"{name}={value!r}: give an integer in [{low}, {high}]")
    return int(value)
