"""The n-gram embedding layer: LongCat ids, tables, the embedding step, the overlay.

``NgramDims`` and ``ngram_ids`` implement the hashing contract of
``docs/ngram-spec.md``; ``NgramContext`` the per-sequence incremental contract;
``Bf16Table``, ``Fp8Table`` and ``CachedTable`` the table variants (mixed freely);
``NgramEmbedding`` the layer (its step one pipeline: ``rowcache.embed.step``);
``rowcache.embed.overlay.overlay.TokenOverlay`` per-sequence adapters;
``load_ngram_embedding`` a LongCat-style ``.safetensors`` checkpoint;
``EngramConfig``, ``CompressedVocab``, ``EngramHash`` and ``EngramContext`` DeepSeek's
Engram hash (``docs/engram-spec.md``), ``EngramMemory`` its lookup through the same tables
(``TorchEngramMemory`` its module);
``Qwen4NgramConfig`` and ``Qwen4NgramHash`` Qwen3.8-Flash-Next's (``qwen4_exp``) n-gram
hash (``docs/qwen4-spec.md``), on the native kernel Engram's hash runs, ``Qwen4NgramMemory``
its lookup, ``build_qwen4_store`` / ``load_qwen4_memory`` its checkpoint's table in a store
(``TorchQwen4NgramEmbedding`` the drop-in of transformers' module);
``TorchNgramEmbedding`` the ``torch.nn.Module``; ``ShardedNgramEmbedding`` (and
``ShardPlacement``, ``TorchShardedNgramEmbedding``) the tables spread over the ranks of a
``torch.distributed`` group (all loaded on first use: ``import rowcache.embed`` never
imports torch).
"""

from __future__ import annotations

from rowcache.embed.checkpoint import (
    Checkpoint,
    load_ngram_embedding,
    load_pretrained,
    table_sources,
)
from rowcache.embed.engram.checkpoint import load_engram_memory
from rowcache.embed.engram.config import EngramConfig
from rowcache.embed.engram.hash import EngramContext, EngramHash
from rowcache.embed.engram.memory import EngramMemory, EngramPrefetch
from rowcache.embed.engram.vocab import CompressedVocab
from rowcache.embed.layer import NgramEmbedding, StaticStep
from rowcache.embed.ngram.batch import NgramBatch, hash_positions
from rowcache.embed.ngram.context import NgramBatchContext, NgramContext
from rowcache.embed.ngram.dims import NgramDims
from rowcache.embed.ngram.ids import ngram_ids, ngram_ids_loop_reference
from rowcache.embed.overlay.overlay import OverlayAdapterInfo, TokenOverlay
from rowcache.embed.qwen4.checkpoint import build_qwen4_store, load_qwen4_memory
from rowcache.embed.qwen4.config import Qwen4NgramConfig
from rowcache.embed.qwen4.hash import Qwen4NgramHash
from rowcache.embed.qwen4.memory import Qwen4NgramMemory
from rowcache.embed.tables import (
    Bf16Table,
    CachedTable,
    Fp8BlockScaleTable,
    Fp8Table,
    Fp8TableScaleTable,
)

__all__ = [
    "Bf16Table",
    "CachedTable",
    "Checkpoint",
    "CompressedVocab",
    "EngramConfig",
    "EngramContext",
    "EngramHash",
    "EngramMemory",
    "EngramPrefetch",
    "Fp8BlockScaleTable",
    "Fp8Table",
    "Fp8TableScaleTable",
    "NgramBatch",
    "NgramBatchContext",
    "NgramContext",
    "NgramDims",
    "NgramEmbedding",
    "OverlayAdapterInfo",
    "Qwen4NgramConfig",
    "Qwen4NgramHash",
    "Qwen4NgramMemory",
    "RankFailedError",
    "ShardPlacement",
    "ShardedNgramEmbedding",
    "StaticStep",
    "TokenOverlay",
    "TorchEngramMemory",
    "TorchNgramEmbedding",
    "TorchQwen4NgramEmbedding",
    "TorchShardedNgramEmbedding",
    "TorchStaticStep",
    "build_qwen4_store",
    "hash_positions",
    "load_engram_memory",
    "load_ngram_embedding",
    "load_pretrained",
    "load_qwen4_memory",
    "ngram_ids",
    "ngram_ids_loop_reference",
    "table_sources",
]


def __getattr__(name: str) -> object:
    # torch is heavy and optional (the `torch` extra): import it only when asked for
    if name == "TorchNgramEmbedding":
        from rowcache.embed.torch.module import TorchNgramEmbedding

        return TorchNgramEmbedding
    if name == "TorchQwen4NgramEmbedding":
        from rowcache.embed.torch.qwen4 import TorchQwen4NgramEmbedding

        return TorchQwen4NgramEmbedding
    if name == "TorchEngramMemory":
        from rowcache.embed.torch.engram import TorchEngramMemory

        return TorchEngramMemory
    if name == "RankFailedError":  # (rowcache.errors: importable without torch)
        from rowcache.errors import RankFailedError

        return RankFailedError
    if name in ("ShardedNgramEmbedding", "ShardPlacement"):  # torch.distributed
        from rowcache.embed import sharded

        return getattr(sharded, name)
    if name == "TorchShardedNgramEmbedding":
        from rowcache.embed.torch.sharded import TorchShardedNgramEmbedding

        return TorchShardedNgramEmbedding
    if name == "TorchStaticStep":
        from rowcache.embed.torch.static import TorchStaticStep

        return TorchStaticStep
    raise AttributeError(f"module 'rowcache.embed' has no attribute {name!r}")
