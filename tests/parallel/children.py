"""Several check groups in one child process: the child's loop and the parent's reading.

A child process on 8 simulated CPU devices pays JAX's start and the compiles
its groups share (the single-device oracles of the same configs) once, so a
test module runs its groups in one child. Each group still passes or fails
on its own: the child runs every group, prints its lines then ``OK <group>``,
or the traceback then ``FAILED <group>``, and exits 1 if any failed; the
parent hands each test its group's section.

The child side (:func:`run_groups`) imports nothing but the standard library,
so the child scripts can call it before configuring JAX.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import traceback
from typing import Callable, Iterable, Mapping

_MARK = re.compile(r"^(OK|FAILED) (\S+)$")


def run_groups(groups: Mapping[str, Callable[[], None]], names: Iterable[str]) -> int:
  """Child side: runs ``groups[name]()`` for every name; the exit status (1 if any failed)."""
  failed = False
  for name in names:
    try:
      groups[name]()
    except Exception:  # pylint: disable=broad-except  (reported below, the next group runs)
      traceback.print_exc(file=sys.stdout)
      print("FAILED", name, flush=True)
      failed = True
    else:
      print("OK", name, flush=True)
  return 1 if failed else 0


def sections(stdout: str) -> dict[str, str]:
  """{group: its lines, ending in its ``OK``/``FAILED`` line} of a child's output."""
  out, lines = {}, []
  for line in stdout.splitlines():
    lines.append(line)
    m = _MARK.match(line)
    if m:
      out[m.group(2)] = "\n".join(lines)
      lines = []
  return out


def selected(request, param: str) -> list[str]:
  """The ``param`` values of the requesting module's tests that this test run selected.

  (``-m``, ``-k`` and node ids deselect before fixtures run, so a module fixture asks its
  child for exactly the groups whose tests will read it.)
  """
  module = request.node.path  # the module of a module-scoped fixture
  out = []
  for item in request.session.items:
    callspec = getattr(item, "callspec", None)
    if item.path == module and callspec is not None and param in callspec.params:
      if callspec.params[param] not in out:
        out.append(callspec.params[param])
  return out


def run_child(script, *groups: str, devices: int = 8, timeout: int = 1200) -> dict[str, str]:
  """Parent side: ``script`` with ``groups`` on ``devices`` CPU devices; {group: section}.

  A group the child never reached (it crashed, or timed out) maps to the
  child's output and the end of its stderr.
  """
  # XLA_FLAGS (tests/fast_compile.py) and the run's compilation cache (tests/conftest.py) are
  # inherited: compile time dominates these tiny programs.
  env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(script), *groups], env=env, capture_output=True,
                        text=True, timeout=timeout, cwd=os.path.dirname(os.path.dirname(
                            os.path.dirname(os.path.abspath(str(script))))))
  found = sections(proc.stdout)
  lost = (f"exit status {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\n"
          f"stderr:\n{proc.stderr[-6000:]}")
  return {g: found.get(g, lost) for g in groups}
