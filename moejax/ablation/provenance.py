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
import shlex
import subprocess
import sys
from typing import Optional, Sequence

from moejax.ablation import freshness

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
  for name in ("ablate", "report", "compare", "train"):
    if script.endswith(f"experiments/{name}.py"):
      return shlex.join(["python", "-m", f"experiments.{name}", *argv[1:]])
  return "(called from Python: " + shlex.join([os.path.basename(argv[0]), *argv[1:]]) + ")"


def run_provenance(command: Optional[str] = None, plugins: Sequence[dict] = ()) -> dict:
  """What produced a result; ``plugins``: the plugin modules its arms use
  (:func:`moejax.config.plugins.used`: module, file, sha256), recorded next to
  the commit only when there are any."""
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
