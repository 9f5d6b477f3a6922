"""LongCat's n-gram ids: dimensions, the hash of a context, per-sequence contexts, batches.

``dims`` (:class:`NgramDims`), ``ids`` (``ngram_ids``, token checks), ``context``
(:class:`NgramContext`, :class:`NgramBatchContext`), ``batch`` (:class:`NgramBatch`:
a packed step's tokens and positions). The contract is ``docs/ngram-spec.md``.
"""
