"""Qwen3.8-Flash-Next's (``qwen4_exp``) hashed n-gram table (docs/qwen4-spec.md): ``config``
owns :class:`Qwen4NgramConfig` (the ``text_config`` fields the ids depend on), ``hash``
:class:`Qwen4NgramHash` (global table rows of every position, on the native kernel shared
with Engram's) and :func:`hash_reference`, the NumPy statement of the ids, ``memory``
:class:`Qwen4NgramMemory` (a step's rows from the resident or cached table, over the step's
``StepRows``)."""
