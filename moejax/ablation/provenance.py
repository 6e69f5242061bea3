"""Where a result came from: command, commit, date, machine, versions.

Every ablation run records :func:`run_provenance` in its ``result.json``;
the suite summary and ``experiments.report`` collect them, so each section of
RESULTS.md states what produced its numbers. The machine is described by
its kind (OS, architecture, CPU count, JAX devices), never by its host name.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
from typing import Mapping, Optional, Sequence

from moejax.ablation import freshness
from moejax.config import plugins as plugins_lib

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_commit(root: str = _ROOT) -> Optional[str]:
  """HEAD of the checkout moejax runs from, ``+dirty`` when tracked files are modified;
  None outside a git checkout (an installed package)."""
  def git(*args):
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                          timeout=10, check=True).stdout.strip()
  try:
    head = git("rev-parse", "--short=12", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "moejax", "experiments",
                "configs")
  except (OSError, subprocess.SubprocessError):
    return None
  return head + ("+dirty" if dirty else "")


def machine() -> str:
  import jax  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"{jax.device_count()} x {devices[0].device_kind} ({devices[0].platform})")


def command_line(argv: Optional[Sequence[str]] = None) -> str:
  """The command that is running: ``python -m experiments.<x> ...`` for our binaries."""
  argv = list(sys.argv if argv is None else argv)
  if not argv:
    return "(unknown)"
  script = argv[0].replace(os.sep, "/")
  binary = re.search(r"(?:^|/)experiments/(\w+)\.py$", script)
  if binary:
    return shlex.join(["python", "-m", f"experiments.{binary.group(1)}", *argv[1:]])
  return "(called from Python: " + shlex.join([os.path.basename(argv[0]), *argv[1:]]) + ")"


def run_provenance(command: Optional[str] = None, plugins: Sequence[dict] = ()) -> dict:
  """What produced a result; ``plugins``: the plugin modules it uses
  (:func:`moejax.config.plugins.used`: module, file, sha256 and the ideas of
  it the config names), recorded next to the commit only when there are any."""
  import jax  # pylint: disable=g-import-not-at-top
  out = {"command": command or command_line(), "commit": git_commit(),
         "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
         "machine": machine(), "jax_version": jax.__version__,
         "python_version": platform.python_version(),
         # The fingerprint of the code that computes numbers: RESULTS.md flags a block
         # whose code has changed since (moejax.ablation.freshness).
         "code": freshness.current()}
  if plugins:
    out["plugins"] = list(plugins)
  return out


def plugin_changes(workdir: str, plan: Mapping[str, str]) -> list[str]:
  """One line per run of ``plan`` (``{run: what happens}``, :func:`runner.plan_suite`) made
  with a plugin module whose file has changed since.

  Such a run is reused as it is (finished), or resumed on the current version:
  like a run made at an older commit (RESULTS.md's freshness flags), its
  numbers stand for the version that made them, and the suite says so rather
  than delete a finished run. The line names the fix that retrains it.
  """
  out = []
  for rel, what in plan.items():
    if what.startswith("new"):
      continue
    path = os.path.join(workdir, rel)
    lines = plugins_lib.changes(plugins_lib.read_record(path))
    if not lines:
      continue
    how = ("reused as it is: its numbers come from the old version" if what.startswith("finished")
           else f"{what} on the current version: its earlier steps used the old one")
    out.append(f"! {rel}: {'; '.join(lines)}; {how}. Fix: move {path} aside to retrain it with "
               "the current version")
  return out
