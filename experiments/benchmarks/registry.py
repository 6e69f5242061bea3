"""The benchmark suites by name: ``python -m experiments.bench --suite=NAME`` runs one.

A suite is one module of this package that defines its own flags and registers a
:class:`Suite` at import; :func:`load_all` imports every module in :data:`MODULES`,
so that the bench binary knows all suites and all their flags before it parses argv.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

# The suite modules, in the order ``--suite``'s help lists them.
MODULES = ("layer", "gmm", "ep", "serving", "step", "scaling", "profile", "peak", "train",
           "tests", "interop")


@dataclasses.dataclass(frozen=True)
class Suite:
  """One benchmark: ``run()`` measures and returns a JSON-able dict (its flags already
  parsed; it records its own conditions, since some suites set JAX up before it
  starts); ``show(result)`` prints its table. ``outputs``: the suite's own flags that
  name something it writes, each ``(flag, 'file' | 'dir')``, checked before it runs."""
  name: str
  summary: str
  run: Callable[[], dict]
  show: Callable[[dict], None]
  outputs: tuple[tuple[str, str], ...] = ()


_SUITES: dict[str, Suite] = {}


def register(suite: Suite) -> Suite:
  if suite.name in _SUITES and _SUITES[suite.name] is not suite:
    raise ValueError(f"error: benchmark suite {suite.name!r} is registered twice. Fix: give "
                     "the new suite another name")
  _SUITES[suite.name] = suite
  return suite


def load_all() -> dict[str, Suite]:
  """Imports every suite module (defining its flags); returns {name: Suite} in the order
  of :data:`MODULES` (each module's ``SUITE``), whatever imported one of them first."""
  modules = [importlib.import_module(f"experiments.benchmarks.{m}") for m in MODULES]
  return {m.SUITE.name: m.SUITE for m in modules}


def get(name: str) -> Suite:
  if name not in _SUITES:
    raise KeyError(f"error: --suite={name!r} is not a benchmark suite. Fix: use one of "
                   f"{sorted(_SUITES)}")
  return _SUITES[name]
