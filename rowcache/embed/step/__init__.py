"""The steps of ``NgramEmbedding``: ids, cached rows resolved, gathers, GEMM, scaled sum.

``composed`` (CPU and composed GPU), ``fused`` (one hash + gather launch), ``graph``
(CUDA graph replay, ``StaticStep``), ``rows`` (tokens held as rows), ``device`` (a GPU
step's buffers), ``staging`` (staging buffers and GEMM parts), ``cached_groups`` (the
cached tables grouped by cache).
"""
