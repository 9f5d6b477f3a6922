"""Reads of store rows: page-granular read plans and the engines that run them.

``reader`` (:class:`RowReader`: one sorted plan per call, one dispatch; it owns its shard
``files``, its ``plan``-ner and one engine chosen at construction, behind the ``engine``
interface), ``native`` (the ``_rcio`` C engines: io_uring or a pread pool, page
checksums), ``pyengine`` (the same in Python, and every failed read's message),
``kvikio_reader`` (the kvikio engine and ``KvikioRowReader``), ``checksum``.
"""
