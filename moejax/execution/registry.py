"""Names of the execution plane's backends, importable without JAX.

The grouped-matmul names (and the module of each) are the config registry's
(:mod:`moejax.config.registry`, the one list configs validate against);
:mod:`moejax.execution.gmm` and :mod:`moejax.execution.permute` dispatch on
these and a test checks that every name has an implementation.
"""

from __future__ import annotations

from moejax.config.registry import GMM_BACKENDS  # noqa: F401  (ragged_dot, the reference, first)
DEFAULT_GMM_BACKEND = "blocked"

# Row-gather backends of permute / unpermute (moejax.execution.permute).
GATHER_BACKENDS = ("xla", "pallas_tpu", "pallas_gpu")
