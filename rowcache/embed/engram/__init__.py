"""DeepSeek's Engram memory (docs/engram-spec.md): its configuration, compressed vocabulary
and hash. ``config`` owns :class:`EngramConfig` and the head primes, ``vocab``
:class:`CompressedVocab`, ``hash`` :class:`EngramHash`, :class:`EngramContext` and the
NumPy reference of the ids."""
