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
from moejax.config.registry import DISPATCH_UNITS  # noqa: F401  (names a config may select)
DEFAULT_GMM_BACKEND = "blocked"

# Row-gather backends of permute / unpermute (moejax.execution.permute).
GATHER_BACKENDS = ("xla", "pallas_tpu", "pallas_gpu")

# What parallel.resolve_dispatch turns (dispatch, ragged_impl, platform) into.
TRANSPORT_NAMES = ("capacity", "ragged_native", "ragged_emulated")


class RegistryError(ValueError):
  """A name registered twice, or looked up but never registered."""


class Registry:
  """Classes by their ``name`` class attribute; registering a taken name raises."""

  def __init__(self, what: str):
    self.what = what
    self._classes: dict[str, type] = {}

  def register(self, cls: type) -> type:
    """Adds ``cls`` under ``cls.name`` (usable as a class decorator); returns ``cls``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
      raise RegistryError(f"{cls.__qualname__} has no string class attribute 'name'; a "
                          f"{self.what} registers under its name")
    if name in self._classes:
      old = self._classes[name]
      raise RegistryError(f"{self.what} {name!r} is already registered by "
                          f"{old.__module__}.{old.__qualname__}; {cls.__module__}."
                          f"{cls.__qualname__} needs another name")
    self._classes[name] = cls
    return cls

  def get(self, name: str) -> type:
    """The class registered as ``name``; RegistryError naming the registered ones otherwise."""
    try:
      return self._classes[name]
    except KeyError:
      raise RegistryError(f"unknown {self.what} {name!r}; registered: "
                          f"{sorted(self._classes)}") from None

  def names(self) -> tuple[str, ...]:
    return tuple(self._classes)

  def __contains__(self, name: str) -> bool:
    return name in self._classes


EXECUTORS = Registry("expert-parallel dispatch unit")
TRANSPORTS = Registry("expert-parallel transport")


def register_dispatch(cls: type) -> type:
  """Class decorator: an expert-parallel executor class, under its ``name`` (a dispatch unit)."""
  return EXECUTORS.register(cls)


def register_transport(cls: type) -> type:
  """Class decorator: a transport class, under its ``name`` (one of TRANSPORT_NAMES)."""
  return TRANSPORTS.register(cls)
