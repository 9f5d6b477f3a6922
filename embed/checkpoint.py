"""Loading a LongCat n-gram embedding from its Hugging Face ``.safetensors`` checkpoint.

Owns the checkpoint's tensor names (base word table, the T n-gram tables, the T
projections), finding them in a single file or a sharded checkpoint
(``model.safetensors.index.json``), and building an :class:`NgramEmbedding` whose
tables are resident (BF16 or FP8, memory-mapped on the CPU) or, for chosen tables,
served by row caches over a store built from the same checkpoint. Tensors are read
with ``rowcache.sources`` (memory maps, never a whole file in memory at once).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from rowcache.errors import ConfigError, FormatError
from rowcache.sources import safetensors_header, safetensors_tensor

from .dims import NgramDims
from .layer import NgramEmbedding
from .tables import Bf16Table, CachedTable, Fp8Table

WORD_NAMES = ("model.embed_tokens.weight", "model.ngram_embeddings.word_embeddings.weight")
TABLE_NAME = "model.ngram_embeddings.embedders.{i}.weight"
PROJ_NAME = "model.ngram_embeddings.post_projs.{i}.weight"
INDEX_NAME = "model.safetensors.index.json"


class Checkpoint:
    """Tensor name -> file of a ``.safetensors`` checkpoint (one file or a sharded directory).

    Parameters
    ----------
    path : a ``.safetensors`` file, or a directory holding ``model.safetensors.index.json``
        or ``*.safetensors`` files (and optionally ``config.json``).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = os.fspath(path)
        self.path = path
        self.files: dict[str, str] = {}
        if os.path.isfile(path):
            self.directory = os.path.dirname(os.path.abspath(path))
            self._add_file(path)
        elif os.path.isdir(path):
            self.directory = path
            index = os.path.join(path, INDEX_NAME)
            if os.path.isfile(index):
                try:
                    with open(index, encoding="utf-8") as f:
                        weight_map = json.load(f)["weight_map"]
                except (OSError, ValueError, KeyError) as e:
                    raise FormatError(f"{index}: not a readable safetensors index ({e})") from e
                self.files = {name: os.path.join(path, fn) for name, fn in weight_map.items()}
            else:
                shards = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
                if not shards:
                    raise ConfigError(
                        f"checkpoint directory {path} has no {INDEX_NAME} and no .safetensors files"
                    )
                for fn in shards:  # one header read per shard file
                    self._add_file(os.path.join(path, fn))
        else:
            raise ConfigError(f"checkpoint {path!r} is neither a .safetensors file nor a directory")

    def _add_file(self, file: str) -> None:
        for name in safetensors_header(file):
            if not name.startswith("__"):
                self.files[name] = file

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def source(self, name: str) -> tuple[str, str]:
        """``(file, tensor)``: a ``rowcache.build_store`` source for tensor ``name``."""
        if name not in self.files:
            near = [k for k in self.files if "ngram" in k or "embed" in k][:6]
            raise ConfigError(
                f"checkpoint {self.path} has no tensor {name!r} ({len(self.files)} tensors"
                + (f"; similar: {near})" if near else ")")
            )
        return self.files[name], name

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` memory-mapped read-only (BF16, F32 or F16)."""
        return safetensors_tensor(*self.source(name))

    def config(self) -> dict[str, Any] | None:
        """``config.json`` beside the checkpoint, or None."""
        cfg = os.path.join(self.directory, "config.json")
        if not os.path.isfile(cfg):
            return None
        with open(cfg, encoding="utf-8") as f:
            return dict(json.load(f))

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
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint(path)
    dims = ckpt.dims(dims)
    chosen = range(dims.num_tables) if tables is None else [int(i) for i in tables]
    return {str(i): ckpt.source(TABLE_NAME.format(i=i)) for i in chosen}


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
) -> NgramEmbedding:
    """An :class:`NgramEmbedding` from a LongCat-style checkpoint.

    Parameters
    ----------
    path : checkpoint file or directory (see :class:`Checkpoint`).
    dims : NgramDims, optional
        Default: from ``config.json`` beside the checkpoint.
    table_dtype : ``"bf16"`` (resident as stored; memory-mapped on the CPU) or
        ``"fp8"`` (quantized on load with ``Fp8Table.quantize``; on the GPU for
        ``device="cuda"``).
    device : ``"cpu"`` or ``"cuda"``: where resident tables, the word table and the
        projections live.
    caches : ``{table index: NgramRowCache or CachedTable}``, optional
        Tables served by a row cache instead (e.g. built with
        ``rowcache.build_store(dir, table_sources(path))``); their store rows must
        have the checkpoint's shape. Their tensors are not read from the checkpoint.

    Returns
    -------
    NgramEmbedding
    """
    if table_dtype not in ("bf16", "fp8"):
        raise ConfigError(f"table_dtype={table_dtype!r} is not supported; allowed: 'bf16', 'fp8'")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r} is not supported; allowed: 'cpu', 'cuda'")
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint(path)
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
        resident = Bf16Table(np.asarray(arr)).to(device)
        tables.append(Fp8Table.quantize(resident.array) if table_dtype == "fp8" else resident)

    projs = []
    for i in range(T):
        name = PROJ_NAME.format(i=i)
        w = ckpt.tensor(name)
        _check_shape(name, w, (D, d))
        projs.append(np.asarray(w))
    return NgramEmbedding(dims, word_table, tables, projs)


__all__ = [
    "PROJ_NAME",
    "TABLE_NAME",
    "WORD_NAMES",
    "Checkpoint",
    "load_ngram_embedding",
    "table_sources",
]
