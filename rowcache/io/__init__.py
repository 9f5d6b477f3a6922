"""Reads of store rows: page-granular read plans and the engines that run them.

``plan`` (rows to whole-page extents), ``reader`` (:class:`RowReader`: one sorted plan per
call, one dispatch), ``native`` (the ``_rcio`` C engine: io_uring or a pread pool, page
checksums), ``pyengine`` (the same in Python), ``kvikio_reader`` (reads through kvikio).
"""
