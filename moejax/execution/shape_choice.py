"""Which grouped-matmul backend runs one call of the routed FFN, by its shape.

Legend: T tokens (or received rows), K slots per token, M = T * K token
copies, E FFN experts, M / E the balanced group size.

A :class:`ShapeRule` is ``backend``, except ``large_backend`` for calls
whose balanced group has at least ``large_rows`` rows. It is read from the
execution config (``large_group_backend`` / ``large_group_rows``), which
resolving ``auto`` fills in from the chosen backend's ``auto_large_groups``
(:func:`moejax.execution.executor.resolve_execution`). On CPU none does:
``whole_group``'s one matmul per expert is slower than ``blocked``'s tiled
loop at the layer suite's large groups; at the default model's small groups
it is the faster layer, but the step twin bench (``--step_twin_backends``)
is where that has to show before a CPU rule hands them over. On a GPU, ``auto``'s
``ragged_dot`` hands groups of 1024 rows or more to ``whole_group``, which
the device check measured several times faster there (docs/benchmarks.md).
Shapes are static under ``jit``, so the choice is made once per
traced shape; :func:`choose` reports each distinct decision once per process
(training, evaluation, decoding and each expert-parallel shard are
different shapes) and keeps them for :func:`decisions`.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Callable, Optional


@dataclasses.dataclass(frozen=True)
class ShapeRule:
  """``backend``, or ``large_backend`` where M / E >= ``large_rows`` (when set)."""

  backend: str
  large_backend: str = ""
  large_rows: int = 0

  @classmethod
  def from_execution(cls, ex, backend: Optional[str] = None) -> "ShapeRule":
    """The rule of an execution config (``backend``: its backend, resolved)."""
    return cls(backend or ex.backend, ex.large_group_backend, ex.large_group_rows)

  @property
  def switches(self) -> bool:
    """Whether some shape runs another backend than ``backend``."""
    return bool(self.large_backend) and self.large_rows > 0 and (
        self.large_backend != self.backend)

  def pick(self, rows: int, num_experts: int) -> str:
    """The backend for ``rows`` token copies over ``num_experts`` experts."""
    if self.switches and rows >= self.large_rows * max(num_experts, 1):
      return self.large_backend
    return self.backend

  def describe(self) -> str:
    if not self.switches:
      return f"{self.backend} at every shape"
    return (f"{self.large_backend} where token copies / experts >= {self.large_rows}, "
            f"else {self.backend}")


@dataclasses.dataclass(frozen=True)
class Decision:
  """One traced shape's choice: rows (T * K) over experts, d, f, and the backend."""

  rule: ShapeRule
  tokens: int
  slots: int
  num_experts: int
  d: int
  f: int
  backend: str

  @property
  def rows_per_expert(self) -> float:
    return self.tokens * self.slots / max(self.num_experts, 1)

  def line(self) -> str:
    rows = f"{self.rows_per_expert:.0f} rows per expert"
    if self.rule.switches:
      side = ">=" if self.backend == self.rule.large_backend else "<"
      rows += f" {side} {self.rule.large_rows}"
    return (f"execution: T={self.tokens} K={self.slots} E={self.num_experts} d={self.d} "
            f"f={self.f}: {rows} -> {self.backend} (rule: {self.rule.describe()})")


_LOCK = threading.Lock()
_SEEN: dict[Decision, None] = {}


def _print(line: str) -> None:
  print(line, file=sys.stdout, flush=True)


REPORT: list[Callable[[str], None]] = [_print]  # where a new decision's line goes


def choose(rule: ShapeRule, tokens: int, slots: int, num_experts: int, d: int,
           f: int) -> str:
  """The backend ``rule`` picks for this shape; the first time a rule that
  switches meets a shape, its line goes to ``REPORT[0]``."""
  backend = rule.pick(tokens * slots, num_experts)
  if rule.switches:
    decision = Decision(rule, tokens, slots, num_experts, d, f, backend)
    with _LOCK:
      new = decision not in _SEEN
      _SEEN[decision] = None
    if new:
      REPORT[0](decision.line())
  return backend


def decisions() -> tuple[Decision, ...]:
  """Every distinct decision of a switching rule made in this process, in order."""
  with _LOCK:
    return tuple(_SEEN)
