"""Loading a LongCat n-gram embedding from its Hugging Face ``.safetensors`` checkpoint.

Owns the checkpoint's tensor names (base word table, the T n-gram tables, the T
projections), finding them in a single file or a sharded checkpoint
(``model.safetensors.index.json``), and building an :class:`NgramEmbedding` whose
tables are resident (BF16 or FP8, memory-mapped on the CPU) or, for chosen tables,
served by row caches over a store built from the same checkpoint
(:func:`load_pretrained`: the store is built once, streaming, and reused; which tables
to cache and their arena slots come from the caller or a ``rowcache tune`` report).
Tensors are read with ``rowcache.store.sources`` (memory maps, never a whole file at once).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from rowcache.embed.hub import resolve_checkpoint
from rowcache.embed.layer import NgramEmbedding
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.tables import Bf16Table, CachedTable, Fp8Table
from rowcache.embed.tune_report import SHARED, tune_slots
from rowcache.embed.user_cache import check_store_writable, default_store
from rowcache.errors import ConfigError, FormatError, RowCacheError
from rowcache.format.layout import record_bytes
from rowcache.kernels.reference import BF16
from rowcache.store.sources import (
    read_json_object,
    safetensors_header,
    safetensors_index,
    safetensors_tensor,
)

log = logging.getLogger(__name__)
_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
WORD_NAMES = ("model.embed_tokens.weight", "model.ngram_embeddings.word_embeddings.weight")
TABLE_NAME = "model.ngram_embeddings.embedders.{i}.weight"
PROJ_NAME = "model.ngram_embeddings.post_projs.{i}.weight"
INDEX_NAME = "model.safetensors.index.json"
_TABLE_RE = re.compile(r"model\.ngram_embeddings\.embedders\.(\d+)\.weight")


def ngram_tensor(name: str) -> bool:
    """Whether the loaders read tensor ``name``: the base word table, the n-gram tables and
    their projections (what a Hugging Face download of the checkpoint must hold)."""
    return name in WORD_NAMES or name.startswith("model.ngram_embeddings.")


def open_checkpoint(path: str | os.PathLike[str] | Checkpoint) -> Checkpoint:
    """``path`` as a :class:`Checkpoint`: a local file or directory, or a Hugging Face repo id
    resolved to its local snapshot (``rowcache.embed.hub``: only the shards holding the
    n-gram tensors are downloaded; offline, the Hugging Face cache)."""
    if isinstance(path, Checkpoint):
        return path
    return Checkpoint(resolve_checkpoint(path, ngram_tensor))


class Checkpoint:
    """Tensor name -> file of a ``.safetensors`` checkpoint (one file or a sharded one).

    Parameters
    ----------
    path : a ``.safetensors`` file; a sharded checkpoint's ``model.safetensors.index.json``
        (any ``*.json`` file is read as such an index); or a directory holding that index or,
        without one, ``*.safetensors`` files (every header is read). ``config.json`` is read
        from the same directory.

    An index's ``weight_map`` is followed as it is: a shard is opened (its header checked,
    the tensor looked for) only when one of its tensors is asked for, so shards a caller
    does not need (for the n-gram tables: every shard without one) are skipped and need
    not even be present.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = os.fspath(path)
        self.path = path
        self.index: str | None = None
        self.files: dict[str, str] = {}
        self._headers: dict[str, dict[str, Any]] = {}
        if os.path.isdir(path):
            self.directory = path
            index = os.path.join(path, INDEX_NAME)
            if os.path.lexists(index):
                self._follow(index)
            else:
                shards = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
                if not shards:
                    raise ConfigError(
                        f"checkpoint directory {path} has no {INDEX_NAME} and no .safetensors "
                        "files: give the directory of a Hugging Face download, or one of its files"
                    )
                for fn in shards:  # one header read per shard file
                    self._add_file(os.path.join(path, fn))
        elif os.path.lexists(path):  # a file; safetensors_* refuse what is not a regular one
            self.directory = os.path.dirname(os.path.abspath(path))
            if path.endswith(".json"):
                self._follow(path)
            else:
                self._add_file(path)
        else:
            raise ConfigError(
                f"checkpoint {path!r} is neither a file nor a directory (it does not exist): "
                f"give a .safetensors file, a sharded checkpoint's {INDEX_NAME}, or its directory"
            )

    def _follow(self, index: str) -> None:
        self.index = index
        self.files = safetensors_index(index)

    def _header(self, file: str) -> dict[str, Any]:
        if file not in self._headers:
            self._headers[file] = safetensors_header(file)
        return self._headers[file]

    def _add_file(self, file: str) -> None:
        for name in self._header(file):
            if name.startswith("__"):
                continue
            if name in self.files:
                raise FormatError(
                    f"checkpoint {self.path}: tensor {name!r} is in both {self.files[name]} and "
                    f"{file}; give the {INDEX_NAME} that says which to use"
                )
            self.files[name] = file

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shard_files(self) -> list[str]:
        """Every file of the checkpoint, in the order their tensors are named."""
        return list(dict.fromkeys(self.files.values()))

    def ngram_tables(self) -> dict[int, str]:
        """``{table index: file}`` of the n-gram tables (``TABLE_NAME``) the checkpoint names."""
        found = {}
        for name, file in self.files.items():
            m = _TABLE_RE.fullmatch(name)
            if m:
                found[int(m.group(1))] = file
        return dict(sorted(found.items()))

    def source(self, name: str) -> tuple[str, str]:
        """``(file, tensor)``: a ``rowcache.build_store`` source for tensor ``name``.

        The file is checked: it exists, its header is sound and holds ``name``."""
        if name not in self.files:
            near = [k for k in self.files if "ngram" in k or "embed" in k][:6]
            raise ConfigError(
                f"checkpoint {self.path} has no tensor {name!r} ({len(self.files)} tensors"
                + (f"; similar: {near})" if near else ")")
            )
        file = self.files[name]
        if self.index is not None:
            if not os.path.lexists(file):
                raise ConfigError(
                    f"checkpoint {self.index} puts {name!r} in {file}, which does not exist: "
                    "download that shard beside the index"
                )
            if name not in self._header(file):
                raise FormatError(
                    f"checkpoint {self.index} puts {name!r} in {file}, whose header has no "
                    "such tensor: the index and its shards disagree (download them again)"
                )
        return file, name

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` memory-mapped read-only (BF16, F32, F16; F8_E4M3, F8_E8M0, U8)."""
        return safetensors_tensor(*self.source(name))

    def tensor_spec(self, name: str) -> tuple[str, tuple[int, ...]]:
        """``(dtype, shape)`` of tensor ``name`` as its file's header states it (``"F8_E4M3"``,
        ``(rows, dim)``): the header is read once a file and checked; no rows are read."""
        file, _ = self.source(name)
        spec = self._header(file)[name]
        return str(spec["dtype"]), tuple(int(d) for d in spec["shape"])

    def config(self) -> dict[str, Any] | None:
        """``config.json`` beside the checkpoint, or None."""
        cfg = os.path.join(self.directory, "config.json")
        if not os.path.lexists(cfg):
            return None
        return read_json_object(cfg, "config.json")

    def word_name(self) -> str:
        """The base word table's name: ``model.embed_tokens.weight`` or the mlx-style rename."""
        for name in WORD_NAMES:
            if name in self.files:
                return name
        raise ConfigError(
            f"checkpoint {self.path} has no base word table (looked for {', '.join(WORD_NAMES)})"
        )

    def dims(self, dims: NgramDims | None = None) -> NgramDims:
        """``dims``, or the ones of ``config.json``; ConfigError when neither exists."""
        if dims is not None:
            return dims
        cfg = self.config()
        if cfg is None:
            raise ConfigError(
                f"no config.json beside checkpoint {self.path}: pass dims=NgramDims(...) "
                "(NgramDims.longcat_flash_lite() for LongCat-Flash-Lite)"
            )
        return NgramDims.from_config(cfg)


def table_sources(
    path: str | os.PathLike[str] | Checkpoint,
    dims: NgramDims | None = None,
    tables: Any = None,
) -> dict[str, tuple[str, str]]:
    """``rowcache.build_store`` sources of the checkpoint's n-gram tables.

    Returns ``{str(i): (file, tensor name)}`` for the tables ``tables`` (indices;
    default all), so ``build_store(dir, table_sources(ckpt))`` stores them under the
    names ``"0" .. "T-1"`` that :func:`load_ngram_embedding` expects.
    """
    ckpt = open_checkpoint(path)
    dims = ckpt.dims(dims)
    chosen = range(dims.num_tables) if tables is None else [int(i) for i in tables]
    return {str(i): ckpt.source(TABLE_NAME.format(i=i)) for i in chosen}


_SCAN_BYTES = 32 << 20  # a non-finite scan's block: a few MB of rows at a time, never a copy


def resident_table(
    array: Any, dtype: str, name: str, *, allow_nonfinite: bool = False
) -> Bf16Table | Fp8Table:
    """A checkpoint tensor as a resident table, by the rule ``rowcache.build_store`` follows,
    so that a table served resident and the same table served from a store (``cached``)
    give the same rows bit for bit, and the same tensors are refused either way.

    The rule: a BF16, F32 or F16 tensor (F16 is widened to float32 exactly); ``"bf16"``
    keeps BF16 as it is (memory-mapped) and rounds the others to nearest even; ``"fp8"``
    quantizes the source values themselves (BF16 or float32, never a BF16 rounding of
    float32). A NaN or an Inf is a ``ConfigError`` naming ``name``, the row and the column,
    unless ``allow_nonfinite`` (then stored and served as the store does). The scan reads
    the tensor once, a block of rows at a time.

    Parameters
    ----------
    array : bfloat16, float32 or float16 ``[rows, dim]``, numpy (a memory map is fine).
    dtype : ``"bf16"`` or ``"fp8"``.
    name : the tensor's name, for the errors.
    """
    from rowcache.store.pages import check_finite

    if getattr(array, "dtype", None) not in (BF16, _F32, _F16) or getattr(array, "ndim", 0) != 2:
        raise ConfigError(
            f"checkpoint tensor {name} is {getattr(array, 'dtype', type(array).__name__)}"
            f"{list(getattr(array, 'shape', []))}; an n-gram table must be BF16, F32 or F16 "
            "[rows, dim]"
        )
    if not allow_nonfinite:
        step = max(1, _SCAN_BYTES // max(1, array.shape[1] * array.itemsize))
        for start in range(0, array.shape[0], step):
            check_finite(np.asarray(array[start : start + step]), name, start)
    values = array.astype(np.float32) if array.dtype == _F16 else array
    if dtype == "fp8":
        return Fp8Table.quantize(values)
    return Bf16Table(values)


def _check_shape(name: str, arr: Any, shape: tuple[int, ...]) -> None:
    if tuple(arr.shape) != shape:
        raise ConfigError(
            f"checkpoint tensor {name} has shape {list(arr.shape)}, expected {list(shape)}"
        )


def load_ngram_embedding(
    path: str | os.PathLike[str] | Checkpoint,
    *,
    dims: NgramDims | None = None,
    table_dtype: str = "bf16",
    device: str = "cpu",
    caches: Mapping[int, Any] | None = None,
    defer_reads: bool = False,
    allow_nonfinite: bool = False,
) -> NgramEmbedding:
    """An :class:`NgramEmbedding` from a LongCat-style checkpoint.

    Parameters
    ----------
    path : checkpoint file or directory (see :class:`Checkpoint`).
    dims : NgramDims, optional
        Default: from ``config.json`` beside the checkpoint.
    table_dtype : ``"bf16"`` (resident as stored; memory-mapped on the CPU) or
        ``"fp8"`` (quantized on load with ``Fp8Table.quantize``, from the tensor's values),
        by the builder's rule (:func:`resident_table`: BF16, F32 or F16 tensors).
    device : ``"cpu"`` or ``"cuda"``: where resident tables, the word table and the
        projections live.
    caches : ``{table index: NgramRowCache or CachedTable}``, optional
        Tables served by a row cache instead (e.g. built with
        ``rowcache.build_store(dir, table_sources(path))``); their store rows must
        have the checkpoint's shape. Their tensors are not read from the checkpoint.
    defer_reads : bool
        ``NgramEmbedding(defer_reads=...)``: a GPU step whose cached rows must be read
        does not wait for them; :meth:`NgramEmbedding.settle` commits it.
    allow_nonfinite : bool
        Serve resident tables that hold a NaN or an Inf (default: a ``ConfigError`` naming
        the tensor, row and column, as ``rowcache.build_store`` refuses them).

    Returns
    -------
    NgramEmbedding
    """
    if table_dtype not in ("bf16", "fp8"):
        raise ConfigError(f"table_dtype={table_dtype!r} is not supported; allowed: 'bf16', 'fp8'")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r} is not supported; allowed: 'cpu', 'cuda'")
    ckpt = open_checkpoint(path)
    dims = ckpt.dims(dims)
    T, d, D = dims.num_tables, dims.table_dim, dims.hidden_size
    caches = dict(caches or {})
    bad = [i for i in caches if not (isinstance(i, int) and 0 <= i < T)]
    if bad:
        raise ConfigError(f"caches keys must be table indices in [0, {T}), got {bad}")

    word_name = ckpt.word_name()
    word = ckpt.tensor(word_name)
    _check_shape(word_name, word, (dims.vocab_size, D))
    word_table = Bf16Table(np.asarray(word)).to(device)

    tables: list[Any] = []
    for i in range(T):
        if i in caches:
            c = caches[i]
            tables.append(c if isinstance(c, CachedTable) else CachedTable(c))
            continue
        name = TABLE_NAME.format(i=i)
        arr = ckpt.tensor(name)
        _check_shape(name, arr, (dims.table_rows(i), d))
        table = resident_table(arr, table_dtype, name, allow_nonfinite=allow_nonfinite)
        tables.append(table.to(device))

    projs = []
    for i in range(T):
        name = PROJ_NAME.format(i=i)
        w = ckpt.tensor(name)
        _check_shape(name, w, (D, d))
        projs.append(np.asarray(w))
    return NgramEmbedding(dims, word_table, tables, projs, defer_reads=defer_reads)


def _cached_indices(cached: Any, T: int) -> list[int]:
    if cached is None:
        return []
    if isinstance(cached, str):
        if cached == "all":
            return list(range(T))
        raise ConfigError(f"cached={cached!r}: give 'all', None, or table indices in [0, {T})")
    try:
        out = sorted({int(i) for i in cached})
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"cached={cached!r}: give 'all', None, or table indices in [0, {T})"
        ) from e
    bad = [i for i in out if not 0 <= i < T]
    if bad:
        raise ConfigError(f"cached has table indices {bad} outside [0, {T}) (num_tables={T})")
    return out


def _open_or_build(
    ckpt: Checkpoint,
    dims: NgramDims,
    store: str,
    tables: list[int],
    dtype: str,
    progress: bool,
    allow_nonfinite: bool,
    default: bool,
) -> Any:
    """The store at ``store`` holding ``tables`` as ``dtype``: opened, or built first
    (where it can be written: else a ``ConfigError`` naming ``store=``)."""
    from rowcache.store.builder import build_store
    from rowcache.store.handle import RowStore

    if not os.path.exists(store):
        sources = table_sources(ckpt, dims, tables)
        check_store_writable(store, default=default)
        log.info("building the store of tables %s of %s at %s", tables, ckpt.path, store)
        return build_store(
            store, sources, dtype=dtype, progress=progress, allow_nonfinite=allow_nonfinite
        )
    log.info("using the store at %s for tables %s of %s", store, tables, ckpt.path)
    st = RowStore.open(store)
    have = {t.name: t for t in st.tables}
    for i in tables:
        t = have.get(str(i))
        want = (dims.table_rows(i), dims.table_dim, dtype)
        if t is None or (t.rows, t.dim, t.dtype) != want:
            got = "missing" if t is None else f"[{t.rows}, {t.dim}] {t.dtype}"
            raise ConfigError(
                f"store {store} does not hold table {i} as [{want[0]}, {want[1]}] {dtype} "
                f"({got}; it holds {sorted(have)}): pass another store= path, or remove "
                "this one to rebuild it from the checkpoint"
            )
    return st


def default_ngram_store(ckpt: Checkpoint, tables: list[int], dtype: str, num_tables: int) -> str:
    """Where :func:`load_pretrained` keeps the store of ``tables`` when ``store=`` is not given.

    Never inside the checkpoint, which may be read-only or shared (a model directory, another
    user's Hugging Face cache): in the user's cache directory (``rowcache.embed.user_cache``:
    ``$ROWCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/rowcache``, else ``~/.cache/rowcache``),
    in a folder keyed by the checkpoint (its real path, and the size and time of the files
    holding its tables: a checkpoint rewritten in place gets a new folder, never stale rows).
    There a store of every table is ``rowcache-<dtype>``, one of some ``rowcache-<dtype>-tables
    -<i>-<j>...``; the smallest store already there holding every table asked for is used.
    A store an earlier rowcache built beside the checkpoint (``<checkpoint>/rowcache-<dtype>``)
    is still used where it holds them."""
    want = set(tables)
    beside = os.path.join(ckpt.directory, f"rowcache-{dtype}")
    if os.path.isdir(beside) and want <= _store_tables(beside):
        return beside
    files = [ckpt.files.get(TABLE_NAME.format(i=i), ckpt.path) for i in range(num_tables)]
    folder = os.path.dirname(default_store(ckpt.directory, files, "rowcache"))
    have = []
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        held = _tables_of_name(name, dtype, num_tables)
        if held is not None and want <= held and os.path.isdir(os.path.join(folder, name)):
            have.append((len(held), name))
    if have:
        return os.path.join(folder, min(have)[1])
    name = f"rowcache-{dtype}"
    if want != set(range(num_tables)):
        name += "-tables-" + "-".join(str(i) for i in sorted(want))
    return os.path.join(folder, name)


def _tables_of_name(name: str, dtype: str, num_tables: int) -> set[int] | None:
    """The tables a default store's name says it holds (None: not such a name)."""
    base = f"rowcache-{dtype}"
    if name == base:
        return set(range(num_tables))
    rest = name.removeprefix(base + "-tables-")
    if rest == name or not all(part.isdecimal() for part in rest.split("-")):
        return None
    return {int(part) for part in rest.split("-")}


def _store_tables(path: str) -> set[int]:
    """The n-gram tables (by index) the store at ``path`` holds; none where it does not open."""
    from rowcache.store.handle import RowStore

    try:
        with RowStore.open(path) as st:
            return {int(t.name) for t in st.tables if t.name.isdecimal()}
    except (OSError, RowCacheError):
        return set()


def load_pretrained(
    path: str | os.PathLike[str] | Checkpoint,
    *,
    cached: Any = None,
    store: str | os.PathLike[str] | None = None,
    arena_bytes: int | str | None = None,
    tune: Any = None,
    dtype: str = "bf16",
    device: str = "cpu",
    dims: NgramDims | None = None,
    progress: bool = False,
    defer_reads: bool = False,
    allow_nonfinite: bool = False,
) -> NgramEmbedding:
    """An :class:`NgramEmbedding` from a checkpoint, some tables behind row caches.

    Parameters
    ----------
    path : checkpoint file or directory (``model.safetensors.index.json`` + shards,
        ``config.json``), or a Hugging Face repo id (``"meituan-longcat/LongCat-Flash-Lite"``):
        its snapshot in the Hugging Face cache, fetched where missing (only the shards
        holding the n-gram tensors), the cache alone offline (``rowcache.embed.hub``).
    cached : None (every table resident), ``"all"``, or table indices
        The n-gram tables served by a row cache. Default with ``tune``: the report's tables.
    store : directory of the row store of the cached tables. Built from the checkpoint
        (streaming, :func:`rowcache.build_store`) when it does not exist, opened and
        checked (rows, dim, dtype of each cached table) when it does. Default: in the
        user's cache directory, keyed by the checkpoint (:func:`default_ngram_store`), never
        inside the checkpoint; a place a store cannot be built is a ``ConfigError`` naming
        ``store=``.
    arena_bytes : int or str (``"20GiB"``)
        Arena budget for all cached tables, split in proportion to their rows.
    tune : ``rowcache tune --json`` output (path, dict or ``TuneReport``)
        Slots per table instead of ``arena_bytes``; a ``"shared"`` entry makes one
        arena (one LRU) over every cached table. A report made for tables of another
        shape than this checkpoint's is refused, naming both (``tune_report.tune_slots``).
    dtype : ``"bf16"`` or ``"fp8"``: the store's rows and the resident tables.
    device : ``"cpu"`` or ``"cuda"``: the arenas, the resident tables, the projections.
    dims : NgramDims, optional (default from ``config.json``).
    progress : show the build's progress bar.
    defer_reads : bool
        ``NgramEmbedding(defer_reads=...)`` (cached tables on the GPU): a step whose rows
        must be read returns before the read ends; ``settle()`` commits it.
    allow_nonfinite : bool
        Tables holding a NaN or an Inf: refused (``ConfigError`` naming the tensor, row and
        column) by default, resident or cached alike; True serves them as they are, both
        ways (the store is built with ``allow_nonfinite=True``). F16 tables are taken both
        ways too (:func:`resident_table`), so a table gives the same rows either way.

    Returns
    -------
    NgramEmbedding
    """
    from rowcache.cache.row_cache import NgramRowCache
    from rowcache.units import parse_bytes

    if dtype not in ("bf16", "fp8"):
        raise ConfigError(f"dtype={dtype!r} is not supported; allowed: 'bf16', 'fp8'")
    ckpt = open_checkpoint(path)
    dims = ckpt.dims(dims)
    T = dims.num_tables
    shape = {str(i): dims.table_rows(i) for i in range(T)}  # what a tune report must fit
    slots_of = tune_slots(tune, table_rows=shape) if tune is not None else None
    if cached is None and slots_of is not None:
        cached = "all" if SHARED in slots_of else [int(k) for k in slots_of if k.isdigit()]
    chosen = _cached_indices(cached, T)
    if not chosen:
        if arena_bytes is not None or store is not None:
            raise ConfigError("arena_bytes/store given but no table is cached: pass cached=...")
        return load_ngram_embedding(
            ckpt, dims=dims, table_dtype=dtype, device=device, allow_nonfinite=allow_nonfinite
        )
    if (arena_bytes is None) == (slots_of is None):
        raise ConfigError(
            "cached tables need an arena size: give arena_bytes=... or tune=<rowcache tune "
            "--json report>, not both"
        )
    default = store is None
    store = default_ngram_store(ckpt, chosen, dtype, T) if store is None else os.fspath(store)
    rows = {i: dims.table_rows(i) for i in chosen}
    shared = slots_of is not None and SHARED in slots_of
    if shared:
        slots = {-1: min(int(slots_of[SHARED]), sum(rows.values()))}  # type: ignore[index]
    elif slots_of is not None:
        missing = [i for i in chosen if str(i) not in slots_of]
        if missing:
            raise ConfigError(
                f"the tune report has no slots for cached tables {missing} "
                f"(it has {sorted(slots_of)})"
            )
        slots = {i: min(int(slots_of[str(i)]), rows[i]) for i in chosen}
    else:
        budget = parse_bytes(arena_bytes, "arena_bytes")  # type: ignore[arg-type]
        rec = record_bytes(dims.table_dim, dtype)
        total = sum(rows.values())
        slots = {i: min(budget * rows[i] // total // rec, rows[i]) for i in chosen}
    small = sorted(i for i, s in slots.items() if s < 1)
    if small:
        raise ConfigError(
            f"arena too small: tables {small} would get no slot; raise arena_bytes "
            f"(rows are {record_bytes(dims.table_dim, dtype)} B) or the tune report's rows"
        )
    st = _open_or_build(ckpt, dims, store, chosen, dtype, progress, allow_nonfinite, default)
    if shared:
        one = NgramRowCache(st, [str(i) for i in chosen], slots=slots[-1], device=device)
        caches: dict[int, Any] = {i: CachedTable(one, part) for part, i in enumerate(chosen)}
    else:
        caches = {i: NgramRowCache(st, str(i), slots=slots[i], device=device) for i in chosen}
    return load_ngram_embedding(
        ckpt,
        dims=dims,
        table_dtype=dtype,
        device=device,
        caches=caches,
        defer_reads=defer_reads,
        allow_nonfinite=allow_nonfinite,
    )


__all__ = [
    "PROJ_NAME",
    "SHARED",
    "TABLE_NAME",
    "WORD_NAMES",
    "Checkpoint",
    "default_ngram_store",
    "load_ngram_embedding",
    "load_pretrained",
    "ngram_tensor",
    "open_checkpoint",
    "resident_table",
    "table_sources",
    "tune_slots",
]
