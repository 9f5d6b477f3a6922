"""NgramDims: LongCat sizes, table order, config parsing, validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rowcache.embed.ngram.dims import NgramDims
from rowcache.errors import ConfigError

V3_SPEC = [
    5975561,
    5081756,
    4188123,
    3294662,
    2401373,
    1508256,
    615311,
    9946169,
    9053570,
    8161143,
    7268888,
    6376805,
]


def test_dims_longcat_sizes():
    d = NgramDims.longcat_flash_lite()
    assert (d.num_tables, d.table_dim, d.base_rows) == (12, 256, 10_223_616)
    assert [d.table_rows(i) for i in range(12)] == list(range(10_223_617, 10_223_640, 2))
    assert sum(d.table_rows(i) for i in range(12)) == 122_683_536
    assert d.table_offset(11) == 11 * d.base_rows + 121
    assert d.table_offset(5) == sum(d.table_rows(i) for i in range(5))
    assert list(d.all_table_rows) == [d.table_rows(i) for i in range(12)]


def test_dims_table_order_and_index():
    d = NgramDims.longcat_flash_lite()
    assert [d.table_order(i) for i in range(12)] == [2] * 4 + [3] * 4 + [4] * 4
    assert d.table_index(3, 1) == 5
    assert all(d.table_index(d.table_order(i), i % 4) == i for i in range(12))
    with pytest.raises(ConfigError, match="order"):
        d.table_index(5, 0)
    with pytest.raises(ConfigError, match="table index 12"):
        d.table_rows(12)


def test_dims_multipliers_match_spec():
    d = NgramDims.longcat_flash_lite()
    m = d.multipliers
    assert m.dtype == np.int64 and m.shape == (12, 4)
    assert (m[:, 0] == 1).all() and (m[:, 1] == 131072).all()
    for i in range(12):
        rows = d.table_rows(i)
        assert pow(131072, 2, rows) == 4_192_624 - 3_360 * i
        assert pow(131072, 3, rows) == V3_SPEC[i]
        order = d.table_order(i)
        assert m[i, 2] == (4_192_624 - 3_360 * i if order >= 3 else 0)
        assert m[i, 3] == (V3_SPEC[i] if order >= 4 else 0)
    assert not m.flags.writeable


def test_dims_from_config_roundtrip_and_noninteger_ratio():
    cfg = {
        "vocab_size": 163840,
        "hidden_size": 4 * 4 * 64,
        "emb_neighbor_num": 5,
        "emb_split_num": 4,
        "ngram_vocab_size_ratio": 100.567,
        "eos_token_id": [7],
        "unrelated": 1,
    }
    d = NgramDims.from_config(cfg)
    assert d.num_tables == 16 and d.table_dim == 64 and d.eos_token_id == 7
    assert d.base_rows == int(100.567 * 163840)
    assert NgramDims.from_config(d.to_config()) == d
    assert NgramDims.from_config(NgramDims.longcat_flash_lite().to_config()) == (
        NgramDims.longcat_flash_lite()
    )


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"hidden_size": 3070}, "not divisible"),
        ({"max_ngram": 1}, "max_ngram"),
        ({"splits": 0}, "splits"),
        ({"vocab_size": 1}, "vocab_size"),
        ({"ratio": 0.0}, "ratio"),
        ({"ratio": float("nan")}, "ratio"),
        ({"eos_token_id": 131072}, "eos_token_id"),
        ({"hidden_size": 3072.0}, "hidden_size"),
        ({"vocab_size": 1 << 40}, "overflows"),
    ],
)
def test_dims_invalid_raise_config_error(kw, match):
    base = dataclasses.asdict(NgramDims.longcat_flash_lite())
    with pytest.raises(ConfigError, match=match):
        NgramDims(**(base | kw))


def test_dims_from_config_missing_key():
    with pytest.raises(ConfigError, match="emb_split_num"):
        NgramDims.from_config(
            {
                "vocab_size": 10,
                "hidden_size": 6,
                "emb_neighbor_num": 2,
                "ngram_vocab_size_ratio": 2,
                "eos_token_id": 1,
            }
        )
