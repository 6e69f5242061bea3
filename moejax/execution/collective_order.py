"""The order of collectives in a compiled program, and where a runtime may issue them out of order.

Every device runs the same compiled program, so its collectives have one
schedule (the order of the entry computation's instructions in
``jax.jit(f).lower(...).compile().as_text()``). A runtime keeps that order
only if it issues each collective after the previous one. XLA:CPU's thunk
runtime does so for collectives at the top level of the program (each one
blocks its thread until all devices joined it, and the next one is
scheduled after it returned), but not for collectives *nested* in a
``conditional`` or ``while``: the conditional may return before its branch
reached its collective (a parallel kernel in the branch finishes later, on
the thread pool), and the next collective, tied to it only by that
scheduling order, may then start first on some devices and second on
others. Every collective of a ``shard_map`` program carries the same
channel id, so the devices then wait in different collectives (a deadlock:
XLA's "rendezvous ... Termination timeout") or, when both are all_to_all,
join one rendezvous with different operations (silently wrong rows, then a
hang). A data dependency orders them: a consumer of the conditional's
result waits for it to finish.

:func:`schedule` lists a program's collectives in order; :func:`hazards`
returns each nested collective followed by a collective that does not
depend on it (empty for a program every runtime runs in order).
"""

from __future__ import annotations

import dataclasses
import re

COLLECTIVES = ("all-reduce", "all-to-all", "all-gather", "collective-permute",
               "reduce-scatter", "ragged-all-to-all", "all-reduce-start", "all-gather-start",
               "collective-permute-start", "all-to-all-start")
CONTROL_FLOW = ("conditional", "while", "call")

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
_NAME = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the entry computation, in schedule order.

  name: the HLO instruction; opcode: its opcode (a collective, or the
  control-flow op holding ``nested`` ones); nested: the collective
  opcodes inside its called computations (empty for a top-level one).
  """

  name: str
  opcode: str
  nested: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Hazard:
  """``first`` holds nested collectives and ``then``, the next collective, does not depend on it."""

  first: Collective
  then: Collective


def _opcode(rhs: str) -> str:
  """The opcode of an instruction's right-hand side (after its possibly tuple-valued shape)."""
  i = 0
  if rhs.startswith("("):
    depth = 0
    for i, ch in enumerate(rhs):
      depth += (ch == "(") - (ch == ")")
      if depth == 0:
        break
    i += 1
  else:
    i = rhs.find(" ")
  m = re.match(r"\s*([\w\-]+)\(", rhs[i:])
  return m.group(1) if m else ""


def _computations(hlo: str) -> tuple[dict[str, list[tuple[str, str, str]]], str]:
  """({computation: [(instruction, opcode, operands and attributes)]}, the entry's name)."""
  comps: dict[str, list[tuple[str, str, str]]] = {}
  cur, entry = None, None
  for line in hlo.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      cur = header.group(2)
      comps[cur] = []
      entry = cur if header.group(1) else entry
    elif line.startswith("}"):
      cur = None
    elif cur is not None and (m := _INSTR.match(line)):
      rhs = m.group(2).split(", metadata=")[0]
      comps[cur].append((m.group(1), _opcode(rhs), rhs))
  if entry is None:
    raise ValueError("collective_order: no ENTRY computation in this HLO text; pass "
                     "jax.jit(f).lower(...).compile().as_text()")
  return comps, entry


def _nested(comps, name: str, seen: frozenset = frozenset()) -> tuple[str, ...]:
  """Collective opcodes in computation ``name`` and the computations it calls."""
  found: list[str] = []
  for _, opcode, rhs in comps.get(name, ()):
    if opcode in COLLECTIVES:
      found.append(opcode)
    for callee in dict.fromkeys(_NAME.findall(rhs)):
      if callee in comps and callee not in seen and callee != name:
        found.extend(_nested(comps, callee, seen | {name}))
  return tuple(found)


def _analyse(hlo: str):
  comps, entry = _computations(hlo)
  names = {n for n, _, _ in comps[entry]}
  deps = {n: {t for t in _NAME.findall(rhs) if t in names} for n, _, rhs in comps[entry]}
  order = []
  for name, opcode, rhs in comps[entry]:
    if opcode in COLLECTIVES:
      order.append(Collective(name, opcode))
    elif opcode in CONTROL_FLOW:
      called = dict.fromkeys(c for c in _NAME.findall(rhs) if c in comps and c not in names)
      nested = tuple(o for c in called for o in _nested(comps, c))
      if nested:
        order.append(Collective(name, opcode, nested))
  return order, deps


def _ancestors(deps: dict[str, set[str]], name: str) -> set[str]:
  """Every instruction ``name`` depends on (iterative: programs have thousands)."""
  seen, stack = set(), [name]
  while stack:
    for d in deps[stack.pop()]:
      if d not in seen:
        seen.add(d)
        stack.append(d)
  return seen


def schedule(hlo: str) -> tuple[Collective, ...]:
  """The entry computation's collectives (and control flow holding some), in schedule order."""
  return tuple(_analyse(hlo)[0])


def hazards(hlo: str) -> tuple[Hazard, ...]:
  """Each nested collective whose successor in the schedule has no data path from it."""
  order, deps = _analyse(hlo)
  return tuple(Hazard(a, b) for a, b in zip(order, order[1:])
               if a.nested and a.name not in _ancestors(deps, b.name))
