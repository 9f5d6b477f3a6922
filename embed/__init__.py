"""The n-gram embedding layer: LongCat ids, tables, the fused embedding, the overlay.

``NgramDims`` and ``ngram_ids`` implement the hashing contract of
``docs/ngram-spec.md``; ``NgramContext`` the per-sequence incremental contract;
``Bf16Table``, ``Fp8Table`` and ``CachedTable`` the table variants (mixed freely);
``NgramEmbedding`` the fused layer; ``embed.overlay.TokenOverlay`` per-sequence adapters;
``load_ngram_embedding`` a LongCat-style ``.safetensors`` checkpoint;
``TorchNgramEmbedding`` the ``torch.nn.Module`` (loaded on first use: ``import embed``
never imports torch).
"""

from __future__ import annotations

from .batch import NgramBatch, hash_positions
from .checkpoint import Checkpoint, load_ngram_embedding, load_pretrained, table_sources
from .context import NgramBatchContext, NgramContext
from .dims import NgramDims
from .ids import ngram_ids, ngram_ids_loop_reference
from .layer import NgramEmbedding, StaticStep
from .overlay import OverlayAdapterInfo, TokenOverlay
from .tables import Bf16Table, CachedTable, Fp8Table

__all__ = [
    "Bf16Table",
    "CachedTable",
    "Checkpoint",
    "Fp8Table",
    "NgramBatch",
    "NgramBatchContext",
    "NgramContext",
    "NgramDims",
    "NgramEmbedding",
    "OverlayAdapterInfo",
    "StaticStep",
    "TokenOverlay",
    "TorchNgramEmbedding",
    "TorchStaticStep",
    "hash_positions",
    "load_ngram_embedding",
    "load_pretrained",
    "ngram_ids",
    "ngram_ids_loop_reference",
    "table_sources",
]


def __getattr__(name: str) -> object:
    # torch is heavy and optional (the `torch` extra): import it only when asked for
    if name == "TorchNgramEmbedding":
        from .torch_module import TorchNgramEmbedding

        return TorchNgramEmbedding
    if name == "TorchStaticStep":
        from .torch_static import TorchStaticStep

        return TorchStaticStep
    raise AttributeError(f"module 'embed' has no attribute {name!r}")
