"""Names of the execution plane's backends and dispatch strategies, importable without JAX.

The grouped-matmul names (and the module of each) are the config registry's
(:mod:`moejax.config.registry`, the one list configs validate against);
:mod:`moejax.execution.gmm` and :mod:`moejax.execution.permute` dispatch on
these and a test checks that every name has an implementation.

The expert-parallel strategies are classes that register themselves here
by their ``name`` attribute (the decorators below are applied in the JAX
modules that define them, :mod:`moejax.execution.dispatch` and
:mod:`moejax.execution.transport`): :data:`EXECUTORS`, one executor class
per ``ParallelConfig.dispatch_unit``, and :data:`TRANSPORTS`, one transport
class per resolved ``ParallelConfig.dispatch`` / ``ragged_impl``.
:func:`moejax.execution.parallel.prepare` looks both up once per layer.
This module holds the tables, not the classes, so it imports nothing.
"""

from __future__ import annotations

from moejax.config.registry import GMM_BACKENDS  # noqa: F401  (ragged_dot, the reference, first)
from moejax.config import registry as config_registry
from moejax.config.registry import Registry, RegistryError  # noqa: F401  (re-exported)

DEFAULT_GMM_BACKEND = "blocked"

# Row-gather backends of permute / unpermute (moejax.execution.permute).
GATHER_BACKENDS = ("xla", "pallas_tpu", "pallas_gpu")

# What parallel.resolve_dispatch turns (dispatch, ragged_impl, platform) into.
TRANSPORT_NAMES = ("capacity", "ragged_native", "ragged_emulated")


# One registry type for every idea (moejax.config.registry.Registry); the two
# of the execution plane live there too, so ParallelConfig can check a name.
EXECUTORS = config_registry.EXECUTORS
TRANSPORTS = config_registry.TRANSPORTS


def register_executor(cls: type) -> type:
  """Class decorator: a single-device executor class (``expert_parallel = False``), under
  its ``name``; configs choose it with ``moe.execution.executor``. The class builds
  itself with ``for_layer(cfg, execution, backend)`` (:mod:`moejax.execution.executor`)."""
  if getattr(cls, "expert_parallel", None) is not False:
    raise RegistryError(f"{cls.__name__}: a single-device executor sets "
                        "expert_parallel = False. Fix: add that class attribute, or "
                        "register an expert-parallel one with register_dispatch")
  return EXECUTORS.register(cls)


def register_dispatch(cls: type) -> type:
  """Class decorator: an expert-parallel executor class, under its ``name`` (a dispatch unit)."""
  return EXECUTORS.register(cls)


def register_transport(cls: type) -> type:
  """Class decorator: a transport class, under its ``name`` (one of TRANSPORT_NAMES)."""
  return TRANSPORTS.register(cls)
