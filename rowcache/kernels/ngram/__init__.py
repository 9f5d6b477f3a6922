"""Kernels of the n-gram embedding: hashed ids, hash + gather, the stacked tables.

``hash`` (``ngram_hash``, ``hash_gather`` and their references), ``rows`` (hash + gather
of tokens laid out as rows), ``stacked`` (:class:`StackedTables` and its gather). CUDA
source: ``ngram.cu`` beside them.
"""
