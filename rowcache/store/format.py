"""The store's layout under its earlier import path: ``rowcache.format.layout`` is its home.

The layout moved beneath both the store and its readers (``rowcache.io``), so the readers
need not import the store; this module keeps ``rowcache.store.format`` working for code
written against it. The package itself imports ``rowcache.format.layout``.
"""

from __future__ import annotations

from rowcache.format.layout import (
    CRC_PREFIX,
    DTYPES,
    DTYPES_V2,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_FILE,
    INDEX_NAME,
    MARKER_NAME,
    META_KEY,
    PAGE,
    READ_VERSIONS,
    SHARD_PREFIX,
    Dtype,
    ShardRecord,
    TableInfo,
    check_file_name,
    crc_key,
    decode_records,
    encode_records,
    meta_to_bytes,
    page_packing,
    parse_meta,
    record_bytes,
    shard_file_name,
    shard_key,
)
from rowcache.io.checksum import page_crcs

__all__ = [
    "CRC_PREFIX",
    "DTYPES",
    "DTYPES_V2",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "INDEX_NAME",
    "MARKER_NAME",
    "META_KEY",
    "PAGE",
    "READ_VERSIONS",
    "SHARD_PREFIX",
    "Dtype",
    "ShardRecord",
    "TableInfo",
    "check_file_name",
    "crc_key",
    "decode_records",
    "encode_records",
    "meta_to_bytes",
    "page_crcs",
    "page_packing",
    "parse_meta",
    "record_bytes",
    "shard_file_name",
    "shard_key",
]
