"""What the CLI tests share: a tiny LongCat-style model config."""

from __future__ import annotations

# a tiny LongCat-style model config (``config.json`` keys) shared by the CLI tests
TINY_CONFIG = {
    "vocab_size": 300,
    "hidden_size": 8,
    "emb_neighbor_num": 3,
    "emb_split_num": 2,
    "ngram_vocab_size_ratio": 3,
    "eos_token_id": 2,
}
