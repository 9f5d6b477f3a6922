"""An Engram checkpoint's memory: its config, tokenizer and per-layer tables, served.

Owns finding each Engram layer's table in a Hugging Face-style checkpoint (a
``.safetensors`` file, a sharded one's index, or their directory, read by
``rowcache.embed.checkpoint.Checkpoint``; a tensor may be in any shard): DeepSeek-V4.1's two
tensors a layer (``layers.{L}.engram.embed.weight``, F8_E4M3 codes ``[rows, head_dim]``, and
``layers.{L}.engram.embed.scale``, F8_E8M0 ``[rows, head_dim / block]``, one UE8M0 byte a
block of values) or the reference module's one table of values
(``layers.{L}.engram.multi_head_embedding.embedding.weight``), each checked against the hash
(its rows are the sum of the layer's head primes) and the format the config states
(``EngramTableFormat``): :class:`EngramLayerTable`. And :func:`load_engram_memory`, the
:class:`~rowcache.embed.engram.memory.EngramMemory` of the checkpoint's ``config.json``
(``EngramConfig.from_config``) and ``tokenizer.json`` over resident tables or over a store
built from the checkpoint on first use (streamed; the checkpoint's own format verbatim by
default, re-quantized on request), then reused, behind one row cache shared by the layers.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from rowcache.embed.checkpoint import Checkpoint, resident_table
from rowcache.embed.engram.config import EngramConfig
from rowcache.embed.engram.hash import EngramHash
from rowcache.embed.engram.memory import EngramMemory
from rowcache.embed.engram.table_format import EngramTableFormat
from rowcache.embed.engram.vocab import CompressedVocab
from rowcache.embed.tables import CachedTable, Fp8BlockScaleTable
from rowcache.errors import ConfigError

V41_PATTERN = r"(?:.*\.)?layers\.(\d+)\.engram\.embed\.weight"
"""A layer's table as DeepSeek-V4.1 ships it (E4M3 codes; its scales are ``...embed.scale``)."""
TABLE_PATTERN = r"(?:.*\.)?layers\.(\d+)\.engram\.multi_head_embedding\.embedding\.weight"
"""A layer's table as the reference module names it (values; any prefix: ``model.`` ...)."""
PATTERNS = (V41_PATTERN, TABLE_PATTERN)
STORE_CODECS = ("bf16", "fp8", "fp8_block_e8m0")
"""The codecs a checkpoint's tables may be stored in (``dtype=``)."""

_VALUE_DTYPES = ("BF16", "F32", "F16")
_SCALE_DTYPES = ("F8_E8M0", "U8")  # UE8M0 bytes (U8: files written before F8_E8M0 existed)


@dataclass(frozen=True)
class EngramLayerTable:
    """Where a checkpoint holds one Engram layer's table, checked.

    ``weight``: the tensor of its rows (values, or E4M3 codes); ``scale``: for codes, the
    tensor of their UE8M0 block scales, else None; ``block_size``: the values a scale byte
    covers (None for values); ``rows``, ``dim``: the table's shape (the hash's).
    """

    layer: int
    weight: str
    scale: str | None
    rows: int
    dim: int
    block_size: int | None = None

    @property
    def codec(self) -> str:
        """The store codec that keeps the rows as shipped: ``"fp8_block_e8m0"`` for codes
        with block scales, ``"bf16"`` for values."""
        return "bf16" if self.scale is None else "fp8_block_e8m0"

    def source(self, ckpt: Checkpoint, dtype: str) -> Any:
        """The ``build_store`` source of the table for a store of codec ``dtype``: the two
        tensors streamed row-aligned and kept verbatim (``fp8_block_e8m0``), or their values
        decoded a chunk at a time (``bf16``, ``fp8``: re-quantized by the store's rule);
        values as they are."""
        from rowcache.store.sources import DecodedRows, Fp8BlockScaleSource

        if self.scale is None:
            return ckpt.source(self.weight)
        blocks = Fp8BlockScaleSource(
            ckpt.source(self.weight), ckpt.source(self.scale), self.block_size
        )
        return blocks if dtype == "fp8_block_e8m0" else DecodedRows(blocks)

    def resident(self, ckpt: Checkpoint, dtype: str, allow_nonfinite: bool = False) -> Any:
        """The table held in memory in codec ``dtype``: the two tensors memory-mapped
        (``Fp8BlockScaleTable``, as shipped), or the values (``Bf16Table``; ``fp8``:
        ``Fp8Table.quantize``), decoded whole for codes, by the store's rule
        (``rowcache.embed.checkpoint.resident_table``: the same rows as a store of them, a
        NaN or an Inf refused unless ``allow_nonfinite``)."""
        if self.scale is None:
            t = ckpt.tensor(self.weight)
            return resident_table(t, dtype, self.weight, allow_nonfinite=allow_nonfinite)
        table = Fp8BlockScaleTable(
            ckpt.tensor(self.weight), ckpt.tensor(self.scale), self.block_size
        )
        if dtype == "fp8_block_e8m0":
            return table
        values = table.gather(np.arange(self.rows, dtype=np.int64))
        return resident_table(values, dtype, self.weight, allow_nonfinite=allow_nonfinite)


def table_regex(pattern: Any) -> re.Pattern[str]:
    """``table_pattern`` compiled: a string, a regular expression with exactly one group
    (the layer id), else a one-line ``ConfigError`` naming the argument and what is wrong."""
    if not isinstance(pattern, str):
        raise ConfigError(
            f"table_pattern={pattern!r} is a {type(pattern).__name__}; give a regular "
            "expression string with one group, the layer id"
        )
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ConfigError(
            f"table_pattern={pattern!r} is not a regular expression ({e}); give one with one "
            f"group, the layer id (the defaults are {list(PATTERNS)!r})"
        ) from None
    if rx.groups != 1:
        raise ConfigError(
            f"table_pattern={pattern!r} has {rx.groups} groups; give exactly one, the layer id "
            "(make the others non-capturing, (?:...))"
        )
    return rx


def engram_tables(ckpt: Checkpoint, pattern: str | None = None) -> dict[int, str]:
    """``{layer_id: tensor name}`` of the tensors matching ``pattern`` (one group: the layer;
    None: DeepSeek-V4.1's and the reference module's names, :data:`PATTERNS`)."""
    rxs = [re.compile(p) for p in PATTERNS] if pattern is None else [table_regex(pattern)]
    found: dict[int, str] = {}
    for name in ckpt.files:
        for rx in rxs:
            m = rx.fullmatch(name)
            if m is None:
                continue
            if m.group(1) is None or not m.group(1).isdecimal():
                raise ConfigError(
                    f"table_pattern={pattern!r}: its group matched {m.group(1)!r} in tensor "
                    f"{name!r}, not a layer number; make the group match digits, (\\d+)"
                )
            layer = int(m.group(1))
            if layer in found:
                raise ConfigError(
                    f"checkpoint {ckpt.path}: two tensors match layer {layer}'s table "
                    f"({found[layer]!r}, {name!r}): give table_pattern= to choose"
                )
            found[layer] = name
    return dict(sorted(found.items()))


def engram_layer_tables(
    ckpt: Checkpoint,
    engram_hash: EngramHash,
    table_format: EngramTableFormat | None = None,
    pattern: str | None = None,
) -> dict[int, EngramLayerTable]:
    """Every Engram layer's table in ``ckpt``, checked against the hash (``[table_rows,
    head_dim]``) and ``table_format`` (the config's ``engram_dtype``, ``engram_block_size``,
    ``engram_scale_fmt``; a field it leaves out is taken from the tensors). Any mismatch is
    one ``ConfigError`` line naming the tensor, what it is and what the layer needs."""
    fmt = table_format if table_format is not None else EngramTableFormat()
    cfg = engram_hash.config
    names = engram_tables(ckpt, pattern)
    missing = [layer for layer in cfg.layer_ids if layer not in names]
    if missing:
        shown = pattern if pattern is not None else " or ".join(PATTERNS)
        raise ConfigError(
            f"checkpoint {ckpt.path} has no table for Engram layer(s) {missing} (tensors "
            f"matching {shown!r}: {sorted(names)}); give table_pattern= to name them"
        )
    return {
        layer: _layer_table(ckpt, engram_hash, fmt, layer, names[layer]) for layer in cfg.layer_ids
    }


def _layer_table(
    ckpt: Checkpoint, h: EngramHash, fmt: EngramTableFormat, layer: int, weight: str
) -> EngramLayerTable:
    where = f"checkpoint {ckpt.path}"
    rows, dim = h.table_rows(layer), h.config.head_dim
    st, shape = ckpt.tensor_spec(weight)
    if shape != (rows, dim):
        raise ConfigError(
            f"{where}: {weight!r} is {list(shape)}; Engram layer {layer} needs [{rows}, {dim}] "
            "(rows: the sum of its heads' primes, the hash's; values: head_dim): a config that "
            "does not match the checkpoint?"
        )
    if st in _VALUE_DTYPES:
        if fmt.block_scaled:
            raise ConfigError(
                f"{where}: {weight!r} is {st}, but the config's engram_dtype is 'fp8' (E4M3 "
                "codes, F8_E4M3, with block scales)"
            )
        return EngramLayerTable(layer, weight, None, rows, dim)
    if st != "F8_E4M3":
        raise ConfigError(
            f"{where}: {weight!r} is {st}; rowcache reads an Engram table as values "
            f"({', '.join(_VALUE_DTYPES)}) or as E4M3 codes (F8_E4M3) with UE8M0 block scales"
        )
    if fmt.dtype == "bf16":
        raise ConfigError(
            f"{where}: {weight!r} is F8_E4M3, but the config's engram_dtype is 'bf16' (values)"
        )
    scale = weight[: -len("weight")] + "scale"
    if scale not in ckpt:
        raise ConfigError(
            f"{where}: {weight!r} holds E4M3 codes but the checkpoint has no {scale!r} (their "
            f"block scales, F8_E8M0 [{rows}, {dim} / block])"
        )
    sst, sshape = ckpt.tensor_spec(scale)
    if sst not in _SCALE_DTYPES:
        raise ConfigError(
            f"{where}: {scale!r} is {sst}; rowcache reads block scales as ue8m0 (F8_E8M0, or "
            "U8 bytes)"
        )
    blocks = sshape[1] if len(sshape) == 2 else 0
    block = fmt.block_size
    if block is None and blocks and dim % blocks == 0:
        block = dim // blocks
    if (
        len(sshape) != 2
        or sshape[0] != rows
        or block is None
        or dim % block
        or blocks != dim // block
    ):
        need = (
            f"[{rows}, {dim // block}]"
            if block and dim % block == 0
            else f"[{rows}, {dim} / block]"
        )
        said = f" (engram_block_size {fmt.block_size})" if fmt.block_size is not None else ""
        raise ConfigError(
            f"{where}: {scale!r} is {list(sshape)}; the scales of {weight!r} need {need}{said}: "
            "one UE8M0 byte a block of each row's values"
        )
    return EngramLayerTable(layer, weight, scale, rows, dim, block)


def _tokenizer_name(tokenizer: Any) -> str:
    if isinstance(tokenizer, (str, os.PathLike)):
        return os.fspath(tokenizer)
    return type(tokenizer).__name__


def load_engram_memory(
    path: str | os.PathLike[str],
    tokenizer: Any = None,
    *,
    cached: bool = True,
    dtype: str | None = None,
    slots: int | None = None,
    arena_fraction: float = 0.25,
    device: str = "cpu",
    store: str | os.PathLike[str] | None = None,
    table_pattern: str | None = None,
    config: EngramConfig | None = None,
    progress: bool | None = None,
    allow_nonfinite: bool = False,
) -> EngramMemory:
    """The Engram memory of a checkpoint.

    Parameters
    ----------
    path : the checkpoint: a ``.safetensors`` file, an index ``.json``, or their directory.
        Its ``config.json`` (beside it) gives the hash (V4.1's ``engram_*`` names,
        ``EngramConfig.from_config``) and the tables' format (``engram_dtype``,
        ``engram_block_size``, ``engram_scale_fmt``: ``EngramTableFormat``).
    tokenizer : what ``CompressedVocab.from_tokenizer`` takes; default the checkpoint
        directory's ``tokenizer.json``. Its compressed size must be the config's
        ``engram_compressed_vocab_size`` where it states one.
    cached : True: the tables from a store on disk (``store``, default
        ``<checkpoint dir>/rowcache-engram-<dtype>``, built from the checkpoint when missing)
        behind one ``NgramRowCache`` of ``slots`` rows (default ``arena_fraction`` of all the
        layers' rows) shared by the layers; False: resident tables.
    dtype : how the rows are stored (or held, resident): None (the default) the checkpoint's
        own format, verbatim (``"fp8_block_e8m0"`` for V4.1's E4M3 codes and UE8M0 block
        scales, 264 bytes a row of 256; ``"bf16"`` for a table of values); ``"bf16"`` or
        ``"fp8"`` (rowcache's per-row scale) re-quantize: codes are decoded by the codec's
        rule first.
    device : ``"cpu"`` or ``"cuda"``.
    table_pattern : a regex with one group, the layer id, over the checkpoint's tensor names
        (a table of codes has its scales beside it, its name's last ``weight`` read
        ``scale``); default V4.1's and the reference module's names.
    config : the hash's parameters; default ``EngramConfig.from_config`` of config.json.
    allow_nonfinite : build the store even where rows decode to NaN (NaN codes, scale bytes
        0xFF); refused by default, naming the table, row and column. Resident tables of values
        (or of codes decoded to values) follow the same rule and give the same rows as a
        store of them (``rowcache.embed.checkpoint.resident_table``).

    Refused in one ``ConfigError`` line, naming the file or field, what it holds and what is
    allowed: a table whose shape is not the hash's (rows: the sum of the layer's primes), an
    ``engram_num_embeddings`` that is not the hash's, a tokenizer whose compressed size is
    not the config's, a format rowcache does not know (``engram_dtype``,
    ``engram_scale_fmt``, tensor dtypes), scales of the wrong shape, a store at ``store``
    holding other tables.
    """
    from rowcache.cache.row_cache import NgramRowCache
    from rowcache.store.builder import build_store
    from rowcache.store.handle import RowStore

    if dtype is not None and dtype not in STORE_CODECS:
        raise ConfigError(
            f"dtype={dtype!r} is not supported; allowed: None (the checkpoint's own format), "
            f"{', '.join(STORE_CODECS)}"
        )
    if not 0 < arena_fraction <= 1:
        raise ConfigError(f"arena_fraction={arena_fraction!r} must be in (0, 1]")
    if table_pattern is not None:
        table_regex(table_pattern)  # before the checkpoint is read
    ckpt = Checkpoint(path)
    meta = ckpt.config()
    cfg_file = os.path.join(ckpt.directory, "config.json")
    if config is None and meta is None:
        raise ConfigError(
            f"checkpoint {ckpt.path}: no config.json beside it; give config=EngramConfig(...)"
        )
    try:
        fmt = EngramTableFormat.from_config(meta) if meta is not None else EngramTableFormat()
        if config is None:
            config = EngramConfig.from_config(meta or {})
    except ConfigError as e:
        raise ConfigError(f"{cfg_file}: {e}") from None
    if tokenizer is None:
        tokenizer = os.path.join(ckpt.directory, "tokenizer.json")
    vocab = CompressedVocab.from_tokenizer(tokenizer)
    if config.compressed_vocab_size is not None and config.compressed_vocab_size != len(vocab):
        raise ConfigError(
            f"{cfg_file}: engram_compressed_vocab_size is {config.compressed_vocab_size:,}, but "
            f"the tokenizer {_tokenizer_name(tokenizer)} compresses to {len(vocab):,} ids: give "
            "the tokenizer the checkpoint was made with (tokenizer=)"
        )
    try:
        engram_hash = EngramHash(config, vocab)
    except ConfigError as e:
        raise ConfigError(f"{cfg_file}: {e}") from None
    tables = engram_layer_tables(ckpt, engram_hash, fmt, table_pattern)
    want = _store_codec(ckpt, tables, dtype)
    if not cached:
        return EngramMemory(
            engram_hash,
            {
                layer: t.resident(ckpt, want, allow_nonfinite).to(device)
                for layer, t in tables.items()
            },
        )
    where = (
        os.fspath(store)
        if store is not None
        else os.path.join(ckpt.directory, f"rowcache-engram-{want}")
    )
    table_names = {layer: f"engram.{layer}" for layer in tables}
    if os.path.exists(where):
        st = RowStore.open(where)
        try:
            _check_store(st, where, tables, table_names, want)
        except BaseException:
            st.close()
            raise
    else:
        sources = {table_names[layer]: t.source(ckpt, want) for layer, t in tables.items()}
        st = build_store(
            where, sources, dtype=want, progress=progress, allow_nonfinite=allow_nonfinite
        )
    try:
        total = sum(t.rows for t in tables.values())
        n = slots if slots is not None else max(1, int(arena_fraction * total))
        cache = NgramRowCache(st, list(table_names.values()), slots=n, device=device)
    except BaseException:
        st.close()
        raise
    return EngramMemory(
        engram_hash, {layer: CachedTable(cache, i) for i, layer in enumerate(tables)}
    )


def _store_codec(ckpt: Checkpoint, tables: dict[int, EngramLayerTable], dtype: str | None) -> str:
    """The codec the layers' rows are stored in: ``dtype``, or the checkpoint's own (one for
    every layer: a shared arena holds one codec and one record size)."""
    own = {t.codec for t in tables.values()}
    blocks = {t.block_size for t in tables.values() if t.block_size is not None}
    where = f"checkpoint {ckpt.path}"
    if dtype is None and len(own) > 1:
        kinds = {layer: t.codec for layer, t in tables.items()}
        raise ConfigError(
            f"{where}: the Engram layers' tables are in different formats ({kinds}); one "
            "arena holds one: pass dtype='bf16' or 'fp8' to store them all so"
        )
    want = dtype if dtype is not None else own.pop()
    if want == "fp8_block_e8m0" and any(t.scale is None for t in tables.values()):
        values = [t.weight for t in tables.values() if t.scale is None]
        raise ConfigError(
            f"{where}: dtype='fp8_block_e8m0' keeps block-scaled E4M3 codes as shipped, but "
            f"{values} hold values: pass dtype='bf16' or 'fp8'"
        )
    if want == "fp8_block_e8m0" and len(blocks) > 1:
        raise ConfigError(
            f"{where}: the Engram layers' scales cover blocks of {sorted(blocks)} values; one "
            "arena holds one record size: pass dtype='bf16' or 'fp8'"
        )
    return want


def _check_store(
    st: Any,
    where: str,
    tables: dict[int, EngramLayerTable],
    names: dict[int, str],
    dtype: str,
) -> None:
    """The store at ``where`` holds every layer's table as ``dtype`` (block sizes included)."""
    have = {t.name: t for t in st.tables}
    for layer, t in tables.items():
        info = have.get(names[layer])
        params = {"block_size": t.block_size} if dtype == "fp8_block_e8m0" else None
        ok = (
            info is not None
            and (info.rows, info.dim, info.dtype) == (t.rows, t.dim, dtype)
            and (params is None or info.params == params)
        )
        if not ok:
            got = (
                "missing"
                if info is None
                else f"[{info.rows}, {info.dim}] {info.dtype} {info.params or ''}".rstrip()
            )
            raise ConfigError(
                f"store {where} does not hold {names[layer]} as [{t.rows}, {t.dim}] {dtype}"
                f"{' ' + str(params) if params else ''} ({got}): pass another store= path, or "
                "remove it to rebuild"
            )


__all__ = [
    "PATTERNS",
    "STORE_CODECS",
    "TABLE_PATTERN",
    "V41_PATTERN",
    "EngramLayerTable",
    "engram_layer_tables",
    "engram_tables",
    "load_engram_memory",
]
