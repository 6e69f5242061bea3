"""NNX building blocks of the transformer in :mod:`moejax.model`."""
