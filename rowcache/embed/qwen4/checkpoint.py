"""Qwen3.8-Flash-Next's n-gram table from its checkpoint as it ships, into a store, served.

Owns finding the table's tensors in a ``qwen4_exp`` checkpoint (one ``.safetensors`` file, or
an index and its shards, read by ``rowcache.embed.checkpoint.Checkpoint``): the
``split_ngram_parts`` parts ``...ple.ple_embedding.ngram_embedding.shard_{k}.weight`` (or one
unsharded ``...ngram_embedding.weight``) of the decoder layer in ``ple_layer_ids``, under
``model.`` or the multimodal release's ``model.language_model.``; checking them against the
hash (rows, width, parts); streaming them in row order into one store table (BF16 rows, or
the FP8 release's E4M3 codes with the table's one ``weight_scale``, both verbatim); and
:func:`load_qwen4_memory`, the :class:`Qwen4NgramMemory` over that store behind a row cache.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from rowcache.embed.checkpoint import Checkpoint
from rowcache.embed.hub import resolve_checkpoint
from rowcache.embed.qwen4.config import Qwen4NgramConfig
from rowcache.embed.qwen4.hash import Qwen4NgramHash
from rowcache.embed.qwen4.memory import Qwen4NgramMemory
from rowcache.embed.user_cache import check_store_writable, default_store
from rowcache.errors import ConfigError

log = logging.getLogger(__name__)

TABLE_NAME = "qwen4.ngram"
"""The store's name of the n-gram table."""
_PART_RE = re.compile(
    r"(model\.(?:language_model\.)?)?layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\."
    r"(?:shard_(\d+)\.)?weight"
)
_CODECS = {"BF16": "bf16", "F8_E4M3": "fp8_table_scale"}


@dataclass(frozen=True)
class Qwen4TableTensors:
    """Where a checkpoint holds one n-gram table.

    ``parts``: tensor names in row order (one, unsharded, or ``split_ngram_parts``);
    ``scale``: the FP8 release's ``...ngram_embedding.weight_scale`` (None for BF16 rows);
    ``dtype``: the store codec of the rows (``"bf16"`` or ``"fp8_table_scale"``);
    ``rows``, ``dim``: the joined table's shape.
    """

    parts: tuple[str, ...]
    scale: str | None
    dtype: str
    rows: int
    dim: int

    def source(self, ckpt: Checkpoint) -> Any:
        """The ``build_store`` source of the table: the parts joined in row order."""
        from rowcache.store.sources import ConcatRows, Fp8TableScaleSource

        rows = ConcatRows([ckpt.source(name) for name in self.parts])
        if self.scale is None:
            return rows
        return Fp8TableScaleSource(rows, ckpt.source(self.scale))


def _hash(config: Qwen4NgramConfig, layer: int | None) -> tuple[Qwen4NgramHash, int]:
    """The hash of decoder layer ``layer`` (1-based, in ``ple_layer_ids``; default the first)."""
    layers = config.ple_layer_ids
    if layer is None:
        layer = layers[0]
    if layer not in layers:
        raise ConfigError(
            f"layer={layer!r}: the config's n-gram tables are at ple_layer_ids {list(layers)} "
            "(1-based decoder layers)"
        )
    return Qwen4NgramHash(config, layers.index(layer)), layer


def qwen4_table_tensors(
    ckpt: Checkpoint, config: Qwen4NgramConfig, layer: int | None = None
) -> Qwen4TableTensors:
    """The tensors of the n-gram table of ``layer`` (1-based; default ``ple_layer_ids[0]``),
    checked against the hash: every part present, one dtype and shape, rows summing to the
    hash's ``table_rows()`` and ``head_dim`` wide. Any mismatch is one ``ConfigError`` line."""
    h, layer = _hash(config, layer)
    index = layer - 1
    shards: dict[str, dict[int, str]] = {}
    whole: dict[str, str] = {}
    for name in ckpt.files:
        m = _PART_RE.fullmatch(name)
        if m is None or int(m.group(2)) != index:
            continue
        prefix = m.group(1) or ""
        if m.group(3) is None:
            whole[prefix] = name
        else:
            shards.setdefault(prefix, {})[int(m.group(3))] = name
    prefixes = sorted(set(shards) | set(whole))
    where = f"checkpoint {ckpt.path}"
    if not prefixes:
        raise ConfigError(
            f"{where} has no n-gram table of decoder layer {index} (looked for "
            f"'model.layers.{index}.ple.ple_embedding.ngram_embedding.shard_{{k}}.weight' or "
            "'.weight', also under 'model.language_model.'): not a qwen4_exp checkpoint, or "
            "a config whose ple_layer_ids does not match it"
        )
    if len(prefixes) > 1 or (shards and whole):
        raise ConfigError(
            f"{where} holds the n-gram table of layer {index} more than once "
            f"(prefixes {prefixes}, sharded and whole: {bool(shards) and bool(whole)})"
        )
    prefix = prefixes[0]
    if whole:
        parts: tuple[str, ...] = (whole[prefix],)
    else:
        found = shards[prefix]
        n = config.split_ngram_parts
        missing = [k for k in range(n) if k not in found]
        extra = sorted(k for k in found if k >= n)
        if missing or extra:
            shown = missing[:8] + (["..."] if len(missing) > 8 else [])
            raise ConfigError(
                f"{where}: the n-gram table of layer {index} has {len(found)} shard tensors; "
                f"split_ngram_parts={n} needs shard_0 .. shard_{n - 1}"
                + (f" (missing {shown})" if missing else f" (unexpected shards {extra[:8]})")
            )
        parts = tuple(found[k] for k in range(n))
    # each part's header entry: dtype and shape, without reading any rows (one header a file)
    from rowcache.store.sources import safetensors_header

    headers: dict[str, dict[str, Any]] = {}
    first = None
    total = 0
    kind = None
    for name in parts:
        file = ckpt.source(name)[0]
        if file not in headers:
            headers[file] = safetensors_header(file)
        spec = headers[file][name]
        st, shape = str(spec["dtype"]), [int(d) for d in spec["shape"]]
        if st not in _CODECS:
            raise ConfigError(
                f"{where}: {name!r} is {st}; the n-gram table's rows are BF16 or F8_E4M3"
            )
        if len(shape) != 2:
            raise ConfigError(f"{where}: {name!r} has shape {shape}; a part is 2-D")
        if first is None:
            first, kind = (st, shape[0], shape[1]), st
        elif (st, shape[0], shape[1]) != first:
            raise ConfigError(
                f"{where}: {name!r} is {st}{shape}, {parts[0]!r} "
                f"{first[0]}{list(first[1:])}: the table's parts need one dtype and shape"
            )
        total += shape[0]
    assert first is not None and kind is not None
    want = (h.table_rows(), config.head_dim)
    if (total, first[2]) != want:
        raise ConfigError(
            f"{where}: the n-gram table of layer {index} is [{total}, {first[2]}] "
            f"({len(parts)} part(s)); the config's hash needs {list(want)} (its heads' primes "
            "padded, x ple_embed_dim / heads): a config that does not match the checkpoint?"
        )
    scale = None
    if kind == "F8_E4M3":
        base = parts[0].rsplit(".ngram_embedding.", 1)[0] + ".ngram_embedding."
        scale = base + "weight_scale"
        if scale not in ckpt:
            raise ConfigError(
                f"{where}: the n-gram table's rows are F8_E4M3 but it has no {scale!r} "
                "(the FP8 release's one BF16 scale of the table)"
            )
    return Qwen4TableTensors(parts, scale, _CODECS[kind], total, first[2])


def _load_config(ckpt: Checkpoint, config: Qwen4NgramConfig | None) -> Qwen4NgramConfig:
    if config is not None:
        if not isinstance(config, Qwen4NgramConfig):
            raise ConfigError(f"config must be a Qwen4NgramConfig, got {type(config).__name__}")
        return config
    meta = ckpt.config()
    if meta is None:
        raise ConfigError(
            f"checkpoint {ckpt.path}: no config.json beside it; give config=Qwen4NgramConfig(...)"
        )
    return Qwen4NgramConfig.from_config(meta)


def build_qwen4_store(
    checkpoint: str | os.PathLike[str] | Checkpoint,
    store: str | os.PathLike[str],
    *,
    config: Qwen4NgramConfig | None = None,
    layer: int | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
) -> Any:
    """Build a store of the checkpoint's n-gram table (one table, ``TABLE_NAME``); returns
    the opened ``RowStore``.

    Parameters
    ----------
    checkpoint : a ``.safetensors`` file, a ``model.safetensors.index.json``, or their
        directory (``config.json`` beside it, unless ``config`` is given).
    store : the store directory to create.
    config : the hash's parameters (default ``Qwen4NgramConfig.from_config`` of config.json).
    layer : the 1-based decoder layer of the table (default ``ple_layer_ids[0]``).

    The parts are streamed in row order (``ConcatRows``), never joined in memory; BF16 rows
    are stored verbatim (``bf16``), F8_E4M3 codes verbatim with the table's BF16
    ``weight_scale`` (``fp8_table_scale``: about one byte a value).
    """
    from rowcache.store.builder import build_store

    ckpt = open_qwen4_checkpoint(checkpoint)
    cfg = _load_config(ckpt, config)
    tensors = qwen4_table_tensors(ckpt, cfg, layer)
    return build_store(
        store,
        {TABLE_NAME: tensors.source(ckpt)},
        dtype=tensors.dtype,
        overwrite=overwrite,
        progress=progress,
    )


def open_qwen4_store(
    store: str | os.PathLike[str],
    ngram_hash: Qwen4NgramHash,
    engine: str = "auto",
) -> Any:
    """The store at ``store``, checked to hold the n-gram table ``ngram_hash`` reads
    (``[table_rows(), head_dim]``, bf16 or fp8_table_scale); one ``ConfigError`` line if not.
    ``engine``: its reader's (``RowStore.open``)."""
    from rowcache.store.handle import RowStore

    st = RowStore.open(store, engine=engine)
    have = {t.name: t for t in st.tables}
    info = have.get(TABLE_NAME)
    want = (ngram_hash.table_rows(), ngram_hash.config.head_dim)
    if info is None or (info.rows, info.dim) != want or info.dtype not in _CODECS.values():
        got = "missing" if info is None else f"[{info.rows}, {info.dim}] {info.dtype}"
        raise ConfigError(
            f"store {os.fspath(store)} does not hold {TABLE_NAME!r} as [{want[0]}, {want[1]}] "
            f"bf16 or fp8_table_scale ({got}; it holds {sorted(have)}): pass another store= "
            "path, or remove this one to rebuild it from the checkpoint"
        )
    return st


def arena_slots(rows: int, record: int, slots: Any = None, arena: Any = None) -> int:
    """Arena rows of a table of ``rows`` rows of ``record`` bytes: ``slots`` (rows), or
    ``arena`` (bytes, ``"2GiB"``, or a fraction in (0, 1] of the table's rows); default a
    quarter of the rows. At most ``rows``, at least 1."""
    from rowcache.units import parse_bytes

    if slots is not None and arena is not None:
        raise ConfigError(f"give slots= or arena=, not both (slots={slots!r}, arena={arena!r})")
    if slots is not None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ConfigError(f"slots={slots!r}: give an int >= 1 (arena rows)")
        return min(slots, rows)
    if arena is None:
        arena = 0.25
    if isinstance(arena, float):
        if not 0 < arena <= 1:
            raise ConfigError(
                f"arena={arena!r}: a float is a fraction of the table's rows, in (0, 1]"
            )
        return max(1, min(rows, int(arena * rows)))
    n = parse_bytes(arena, "arena") // record
    if n < 1:
        raise ConfigError(
            f"arena={arena!r}: holds no row (a row is {record} bytes); give more bytes or slots="
        )
    return min(int(n), rows)


def qwen4_tensor(name: str) -> bool:
    """Whether the loader reads tensor ``name``: a part of an n-gram table or its scale (what
    a Hugging Face download of the checkpoint must hold for the store)."""
    return ".ngram_embedding." in name


def open_qwen4_checkpoint(checkpoint: str | os.PathLike[str] | Checkpoint) -> Checkpoint:
    """``checkpoint`` as a ``Checkpoint``: a local file or directory, or a Hugging Face repo id
    resolved to its local snapshot (``rowcache.embed.hub``: only the shards holding the n-gram
    table are downloaded; offline, the Hugging Face cache)."""
    if isinstance(checkpoint, Checkpoint):
        return checkpoint
    return Checkpoint(resolve_checkpoint(checkpoint, qwen4_tensor))


def default_qwen4_store(ckpt: Checkpoint, config: Qwen4NgramConfig, layer: int) -> str:
    """Where :func:`load_qwen4_memory` keeps the store of ``layer``'s table when ``store=`` is
    not given: the user's cache directory (``rowcache.embed.user_cache``), keyed by the
    checkpoint (its real path, and the size and time of the files holding the table), as
    ``.../rowcache-qwen4-layer<L>``; never inside the checkpoint, which may be read-only."""
    tensors = qwen4_table_tensors(ckpt, config, layer)
    names = [*tensors.parts, *([tensors.scale] if tensors.scale else [])]
    files = [ckpt.source(n)[0] for n in names]
    return default_store(ckpt.directory, files, f"rowcache-qwen4-layer{layer}")


def load_qwen4_memory(
    checkpoint: str | os.PathLike[str] | Checkpoint,
    *,
    store: str | os.PathLike[str] | None = None,
    slots: int | None = None,
    arena: int | str | float | None = None,
    device: str = "cpu",
    config: Qwen4NgramConfig | None = None,
    layer: int | None = None,
    progress: bool | None = None,
    engine: str = "auto",
) -> Qwen4NgramMemory:
    """The n-gram memory of a checkpoint, its table from a store behind a row cache.

    Parameters
    ----------
    checkpoint : a ``.safetensors`` file, an index ``.json``, or their directory; or a Hugging
        Face repo id, resolved to its snapshot in the Hugging Face cache (fetched where
        missing, only the shards of the n-gram table; offline, the cache alone).
    store : the store directory (default: in the user's cache directory, keyed by the
        checkpoint, :func:`default_qwen4_store`; never inside the checkpoint): built from the
        checkpoint when it does not exist (streamed, :func:`build_qwen4_store`), else opened
        and checked against the config. A place a store cannot be built is a ``ConfigError``
        naming ``store=``.
    slots, arena : the arena's rows, or its size (bytes, ``"4GiB"``, or a fraction of the
        table's rows); default a quarter of the rows (:func:`arena_slots`).
    device : ``"cpu"`` or ``"cuda"``, the arena's.
    config, layer : as :func:`build_qwen4_store`.
    engine : the store reader's engine (``RowStore.open``): ``"auto"`` (io_uring), or
        ``"uring+threads"`` for a disk where threads of ``pread`` read long batches faster
        than one thread's ring. On the H100 VM's virtio disk the threads engine served the
        judge's decode ×32 1.21x and prefill 1.36x faster than io_uring, and uring+threads
        1.04x and 1.11x the threads engine (docs/qwen4.md, "The read engine"); on the dev
        VM io_uring was as fast or faster. Measure a disk with ``bench.qwen4 --engine``.
    """
    from rowcache.cache.row_cache import NgramRowCache
    from rowcache.embed.tables import CachedTable
    from rowcache.format.layout import record_bytes
    from rowcache.io.reader import ENGINES
    from rowcache.store.handle import RowStore

    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r} is not supported; allowed: 'cpu', 'cuda'")
    if engine not in ENGINES:  # (before a build that may take an hour)
        raise ConfigError(f"engine={engine!r} is not supported; allowed: {', '.join(ENGINES)}")
    ckpt = open_qwen4_checkpoint(checkpoint)
    cfg = _load_config(ckpt, config)
    h, layer = _hash(cfg, layer)
    where = default_qwen4_store(ckpt, cfg, layer) if store is None else os.fspath(store)
    if os.path.exists(where):
        log.info("using the store at %s for layer %d's n-gram table", where, layer)
        st = open_qwen4_store(where, h, engine)
    else:
        # only the (small) checks run before the build: the size is known from the config
        arena_slots(h.table_rows(), record_bytes(cfg.head_dim, "bf16"), slots, arena)
        check_store_writable(where, default=store is None)
        log.info(
            "building the store of layer %d's n-gram table of %s at %s", layer, ckpt.path, where
        )
        st = build_qwen4_store(ckpt, where, config=cfg, layer=layer, progress=progress)
        if engine != "auto":  # the built store's reader is the default one
            st.close()
            st = RowStore.open(where, engine=engine)
    info = next(t for t in st.tables if t.name == TABLE_NAME)
    n = arena_slots(info.rows, int(info.record_bytes), slots, arena)
    cache = NgramRowCache(st, TABLE_NAME, slots=n, device=device)
    return Qwen4NgramMemory(h, CachedTable(cache))


__all__ = [
    "TABLE_NAME",
    "Qwen4TableTensors",
    "arena_slots",
    "build_qwen4_store",
    "default_qwen4_store",
    "load_qwen4_memory",
    "open_qwen4_checkpoint",
    "open_qwen4_store",
    "qwen4_table_tensors",
]
