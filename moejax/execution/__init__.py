"""The execution plane: how tokens physically reach experts.

Entry points:

* :func:`moejax.execution.experts.routed_experts`: the layer's routed-expert
  output for a :class:`~moejax.routing.types.RoutingResult`, dropless, with
  the grouped-matmul backend chosen by name.
* :func:`moejax.execution.gmm.gmm` / :func:`~moejax.execution.gmm.tgmm`: the
  grouped matmul and its weight-gradient form; backends ``ragged_dot``
  (reference), ``blocked`` (portable XLA, default), ``pallas_tpu``,
  ``pallas_gpu``.
* :mod:`moejax.execution.permute`: dropless sort-by-expert layout, [E, C]
  capacity buffers with the slot-major drop rule, permute / unpermute with
  gather-only custom VJPs.

See docs/execution.md for the contracts and the measured benchmark.
"""

# Submodules ``gmm`` and ``permute`` share their names with their main
# functions, so the package exports the modules, not the functions:
# ``from moejax.execution import gmm; gmm.gmm(...)``.
from moejax.execution import gmm, permute
from moejax.execution.experts import routed_experts
from moejax.execution.gmm import BACKENDS, DEFAULT_BACKEND, GmmError

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "GmmError", "gmm", "permute",
           "routed_experts"]
