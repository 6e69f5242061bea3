"""The execution plane: how tokens physically reach experts.

Entry points:

* :func:`moejax.execution.grouped_ffn.routed_ffn`: the FFN of token copies
  grouped by expert, ``y[t] = sum_k w[t, k] FFN_{ids[t, k]}(x[t])``, with an
  optional width mask and the grouped-matmul backend chosen by name; the
  layer (:func:`~moejax.execution.grouped_ffn.routed_experts`, the same for
  a :class:`~moejax.routing.types.RoutingResult`) and the expert-parallel
  path both call it.
* :func:`moejax.execution.gmm.gmm` / :func:`~moejax.execution.gmm.tgmm`: the
  grouped matmul and its weight-gradient form; backends ``ragged_dot``
  (reference), ``blocked`` (portable XLA, default), ``pallas_tpu``,
  ``pallas_gpu``, ``whole_group`` (one matmul per expert over capacity
  buckets; named, or picked per call shape by a shape rule,
  :mod:`moejax.execution.shape_choice`).
* :mod:`moejax.execution.permute`: dropless sort-by-expert layout, [E, C]
  capacity buffers with the slot-major drop rule, permute / unpermute with
  gather-only custom VJPs.
* :mod:`moejax.execution.registry`: the backend names and the registries
  of expert-parallel executor and transport classes, importable without
  JAX (config validation).
* :mod:`moejax.execution.dispatch`: the expert-parallel executors, one
  class per dispatch unit, each holding a :mod:`~moejax.execution.transport`
  object; :func:`moejax.execution.parallel.prepare` picks them.

See docs/execution.md for the contracts and the benchmark suites (their
tables: docs/benchmarks.md).
"""

# Nothing is imported eagerly: ``moejax.execution.registry`` must stay
# importable without JAX. Submodules ``gmm`` and ``permute`` share their
# names with their main functions, so use the modules:
# ``from moejax.execution import gmm; gmm.gmm(...)``.
import importlib
import pkgutil

_LAZY = {
    "BACKENDS": ("moejax.execution.registry", "GMM_BACKENDS"),
    "DEFAULT_BACKEND": ("moejax.execution.registry", "DEFAULT_GMM_BACKEND"),
    "GmmError": ("moejax.execution.gmm", "GmmError"),
    "routed_experts": ("moejax.execution.grouped_ffn", "routed_experts"),
    "routed_ffn": ("moejax.execution.grouped_ffn", "routed_ffn"),
}

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "GmmError", "routed_experts", "routed_ffn"]


# Every module of this directory, read from it (a hand-kept list went stale).
_SUBMODULES = frozenset(m.name for m in pkgutil.iter_modules(__path__))


def __getattr__(name):
  if name in _LAZY:
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
  if name in _SUBMODULES:  # ``import moejax.execution as ex; ex.gmm`` works too
    return importlib.import_module(f"moejax.execution.{name}")
  raise AttributeError(f"module 'moejax.execution' has no attribute {name!r}")
