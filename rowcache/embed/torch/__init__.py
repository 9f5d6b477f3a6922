"""The n-gram embedding for PyTorch: ``TorchNgramEmbedding`` and its static step.

``module`` (:class:`TorchNgramEmbedding`), ``static`` (:class:`TorchStaticStep`),
``packed`` (ragged forwards packed into one step), ``views`` (torch <-> cupy views and
streams). Importing this package does not import torch; its modules do.
"""
