"""Names of the execution plane's backends: the one list, importable without JAX.

Configs validate their ``backend`` fields against these tuples (no JAX import
needed to check a config); :mod:`moejax.execution.gmm` and
:mod:`moejax.execution.permute` dispatch on them and test that every name
has an implementation.
"""

from __future__ import annotations

# Grouped-matmul backends (moejax.execution.gmm), the reference first.
GMM_BACKENDS = ("ragged_dot", "blocked", "pallas_tpu", "pallas_gpu")
DEFAULT_GMM_BACKEND = "blocked"

# Row-gather backends of permute / unpermute (moejax.execution.permute).
GATHER_BACKENDS = ("xla", "pallas_tpu", "pallas_gpu")
