"""The store: shard files of fixed-stride rows and their LMDB index.

``format`` (record and page arithmetic, the meta record), ``index`` (reading and checking
the LMDB index before LMDB maps it), ``handle`` (:class:`RowStore`, a read-only view),
``builder`` (``build_store``), ``pages`` (rows into pages), ``sources`` (arrays, ``.npy``,
``.safetensors``), ``replace`` (the atomic switch).

The public names are ``rowcache.RowStore``, ``rowcache.TableInfo``, ``rowcache.build_store``.
Nothing is imported here: the store and its reader (``rowcache.io``) import each other's
modules, and an eager import in this file would close that circle.
"""
