"""The step of ``NgramEmbedding`` as one pipeline: ids -> resolve -> gather -> overlay ->
project and sum.

``stages`` (the fixed stages, one implementation per device), ``cached_groups`` (the
cached tables grouped by cache: resolve, prefetch, the one order policy), ``inputs``
(the per-call input adapters: host tokens, device tokens, rows in place), ``runners``
(the CPU and the eager GPU runner, ``plan(shape) -> Step``), ``graph`` (``StaticStep``
and the runner that replays it), ``staging`` and ``device`` (the buffers).
"""
