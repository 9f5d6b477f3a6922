"""An Engram checkpoint's memory: its config, tokenizer and per-layer tables, served.

Owns :func:`load_engram_memory`: a Hugging Face-style checkpoint (a ``.safetensors`` file, a
sharded one's index, or their directory, read by ``rowcache.embed.checkpoint.Checkpoint``)
holding one table per Engram layer (the reference module's
``layers.{L}.engram.multi_head_embedding.embedding.weight``: the layer's heads end to end),
its ``config.json`` (the ``engram_*`` fields, ``EngramConfig.from_config``) and its
``tokenizer.json``, made into an :class:`~rowcache.embed.engram.memory.EngramMemory` over
resident tables or over a store built from the checkpoint on first use (streamed, then
reused) behind one row cache shared by the layers.
"""

from __future__ import annotations

import os
import re
from typing import Any

from rowcache.embed.checkpoint import Checkpoint
from rowcache.embed.engram.config import EngramConfig
from rowcache.embed.engram.hash import EngramHash
from rowcache.embed.engram.memory import EngramMemory
from rowcache.embed.engram.vocab import CompressedVocab
from rowcache.embed.tables import Bf16Table, CachedTable, Fp8Table
from rowcache.errors import ConfigError

TABLE_PATTERN = r"(?:.*\.)?layers\.(\d+)\.engram\.multi_head_embedding\.embedding\.weight"
"""A layer's table as the reference module names it (any prefix: ``model.`` ...)."""


def engram_tables(ckpt: Checkpoint, pattern: str = TABLE_PATTERN) -> dict[int, str]:
    """``{layer_id: tensor name}`` of the tensors matching ``pattern`` (one group: the layer)."""
    rx = re.compile(pattern)
    found: dict[int, str] = {}
    for name in ckpt.files:
        m = rx.fullmatch(name)
        if m:
            layer = int(m.group(1))
            if layer in found:
                raise ConfigError(
                    f"checkpoint {ckpt.path}: two tensors match layer {layer}'s table "
                    f"({found[layer]!r}, {name!r}): give table_pattern= to choose"
                )
            found[layer] = name
    return dict(sorted(found.items()))


def load_engram_memory(
    path: str | os.PathLike[str],
    tokenizer: Any = None,
    *,
    cached: bool = True,
    dtype: str = "bf16",
    slots: int | None = None,
    arena_fraction: float = 0.25,
    device: str = "cpu",
    store: str | os.PathLike[str] | None = None,
    table_pattern: str = TABLE_PATTERN,
    config: EngramConfig | None = None,
    progress: bool | None = None,
) -> EngramMemory:
    """The Engram memory of a checkpoint.

    Parameters
    ----------
    path : the checkpoint: a ``.safetensors`` file, an index ``.json``, or their directory.
    tokenizer : what ``CompressedVocab.from_tokenizer`` takes; default the checkpoint
        directory's ``tokenizer.json``.
    cached : True: the tables from a store on disk (``store``, default
        ``<checkpoint dir>/rowcache-engram-<dtype>``, built from the checkpoint when missing)
        behind one ``NgramRowCache`` of ``slots`` rows (default ``arena_fraction`` of all the
        layers' rows) shared by the layers; False: resident tables.
    dtype : ``"bf16"`` or ``"fp8"``, the rows as stored (or held, resident).
    device : ``"cpu"`` or ``"cuda"``.
    table_pattern : a regex with one group, the layer id, over the checkpoint's tensor names.
    config : the hash's parameters; default ``EngramConfig.from_config`` of ``config.json``.
    """
    from rowcache.cache.row_cache import NgramRowCache
    from rowcache.store.builder import build_store
    from rowcache.store.handle import RowStore

    if dtype not in ("bf16", "fp8"):
        raise ConfigError(f"dtype={dtype!r} is not supported; allowed: bf16, fp8")
    if not 0 < arena_fraction <= 1:
        raise ConfigError(f"arena_fraction={arena_fraction!r} must be in (0, 1]")
    ckpt = Checkpoint(path)
    if config is None:
        meta = ckpt.config()
        if meta is None:
            raise ConfigError(
                f"checkpoint {ckpt.path}: no config.json beside it; give config=EngramConfig(...)"
            )
        config = EngramConfig.from_config(meta)
    if tokenizer is None:
        tokenizer = os.path.join(ckpt.directory, "tokenizer.json")
    engram_hash = EngramHash(config, CompressedVocab.from_tokenizer(tokenizer))
    names = engram_tables(ckpt, table_pattern)
    missing = [layer for layer in config.layer_ids if layer not in names]
    if missing:
        raise ConfigError(
            f"checkpoint {ckpt.path} has no table for Engram layer(s) {missing} (tensors "
            f"matching {table_pattern!r}: {sorted(names)}); give table_pattern= to name them"
        )
    shapes = {layer: (engram_hash.table_rows(layer), config.head_dim) for layer in config.layer_ids}
    for layer in config.layer_ids:
        t = ckpt.tensor(names[layer])
        if tuple(t.shape) != shapes[layer]:
            raise ConfigError(
                f"checkpoint {ckpt.path}: {names[layer]!r} is {list(t.shape)}; Engram layer "
                f"{layer} needs {list(shapes[layer])} (its heads' primes x head_dim): a "
                "config that does not match the checkpoint?"
            )
    if not cached:
        tables: dict[int, Any] = {}
        for layer in config.layer_ids:
            t = ckpt.tensor(names[layer])
            table = Fp8Table.quantize(t) if dtype == "fp8" else Bf16Table(t)
            tables[layer] = table.to(device)
        return EngramMemory(engram_hash, tables)
    where = (
        os.fspath(store)
        if store is not None
        else os.path.join(ckpt.directory, f"rowcache-engram-{dtype}")
    )
    table_names = [f"engram.{layer}" for layer in config.layer_ids]
    if os.path.exists(where):
        st = RowStore.open(where)
        have = {t.name: t for t in st.tables}
        for layer, name in zip(config.layer_ids, table_names):
            info = have.get(name)
            want = (*shapes[layer], dtype)
            if info is None or (info.rows, info.dim, info.dtype) != want:
                got = "missing" if info is None else f"[{info.rows}, {info.dim}] {info.dtype}"
                raise ConfigError(
                    f"store {where} does not hold {name} as [{want[0]}, {want[1]}] {dtype} "
                    f"({got}): pass another store= path, or remove it to rebuild"
                )
    else:
        sources = {
            name: ckpt.source(names[layer]) for layer, name in zip(config.layer_ids, table_names)
        }
        st = build_store(where, sources, dtype=dtype, progress=progress)
    total = sum(shapes[layer][0] for layer in config.layer_ids)
    n = slots if slots is not None else max(1, int(arena_fraction * total))
    cache = NgramRowCache(st, table_names, slots=n, device=device)
    return EngramMemory(
        engram_hash, {layer: CachedTable(cache, i) for i, layer in enumerate(config.layer_ids)}
    )
