"""DeepSeek's Engram memory (docs/engram-spec.md): its configuration, compressed vocabulary,
hash, lookup and checkpoint. ``config`` owns :class:`EngramConfig` and the head primes,
``vocab`` :class:`CompressedVocab`, ``hash`` :class:`EngramHash`, :class:`EngramContext` and
the NumPy reference of the ids, ``memory`` :class:`EngramMemory`, ``table_format``
:class:`EngramTableFormat` (how a checkpoint stores its tables), ``checkpoint``
``load_engram_memory`` (a checkpoint's tables, DeepSeek-V4.1's as shipped, served)."""
