"""Finished runs of a suite from other suite directories: seeds run as separate processes.

A suite's runs are independent, so its seeds can train in parallel, one
process each: ``--config.seeds='(1,)' --config.reproduction=False
--workdir=DIR_1`` and so on (a suite directory is locked while it runs, so
the processes need their own). ``experiments.ablate --import_runs=DIR_0,DIR_1``
then copies each finished run into the full suite's layout, ``DIR/<arm>/seed_<s>``,
and the full suite finds every run finished and writes only its summary.

A run is taken only when its ``result.json`` is of the same experiment as the
run it stands for (:func:`moejax.ablation.runner.is_finished`: arm, seed,
model, data, optimizer, steps), read in a one-seed directory (``DIR_s/<arm>``)
or a many-seed one (``DIR_s/<arm>/seed_<s>``). Runs are copied, never moved,
so the source directories stay as they were; a run already finished in the
target is left alone, and a target run that holds unfinished training is
refused rather than overwritten. Each copied ``result.json`` keeps its own
provenance (the command with its seed override), so the summary lists every
command that trained the suite.

Suites with source runs (fine-tuning, ``moejax.ablation.sources``) are not
supported: their runs name the source run's path inside their own directory.
"""

from __future__ import annotations

import os
import shutil
from typing import Sequence

from moejax.ablation.runner import is_finished
from moejax.ablation.sources import seeded
from moejax.ablation.suite import Suite, run_dir
from moejax.train import lock as lock_lib
from moejax.train.checkpoint import WorkdirError


def plan_imports(suite: Suite, workdir: str, sources: Sequence[str]) -> list[tuple[str, str]]:
  """``(run, source directory)`` for every run of ``suite`` to copy into ``workdir``; reads only.

  Raises WorkdirError (naming the run or directory) when a source is missing or
  in use, when the suite has source runs, or when a run to import would
  replace anything (unfinished training, another experiment) in ``workdir``.
  """
  if suite.source is not None:
    raise WorkdirError(
        f"--import_runs: suite {suite.name} fine-tunes from source runs, whose paths are part "
        "of each run's config, so its runs cannot move between suite directories. Fix: run "
        "its seeds in one --workdir")
  for src in sources:
    if not os.path.isdir(src):
      raise WorkdirError(f"--import_runs: {src} is not a directory. Fix: name the --workdir of "
                         "a finished suite run")
    if os.path.abspath(src) == os.path.abspath(workdir):
      raise WorkdirError(f"--import_runs: {src} is the --workdir itself. Fix: name the other "
                         "suite directories")
    lock_lib.check_unlocked(src)
  lock_lib.check_unlocked(workdir)
  out = []
  for arm, seed, rel in suite.runs():
    exp = seeded(arm.experiment, seed)
    target = os.path.join(workdir, rel)
    if is_finished(target, exp):
      continue
    # DIR_s/<arm> (a one-seed suite) or DIR_s/<arm>/seed_<s> (any larger seed list).
    layouts = (run_dir(arm.name, seed, 1), run_dir(arm.name, seed, 2))
    found = next((os.path.join(src, lay) for src in sources for lay in layouts
                  if is_finished(os.path.join(src, lay), exp)), None)
    if found is None:
      continue
    if os.path.exists(target) and os.listdir(target):
      raise WorkdirError(
          f"--import_runs: run {rel} of suite {suite.name} already has files in {target} "
          f"(unfinished training, or another experiment's run); importing {found} would "
          "overwrite them. Fix: let the suite finish that run, or move it aside")
    out.append((rel, found))
  return out


def import_runs(suite: Suite, workdir: str, sources: Sequence[str], say=print) -> int:
  """Copies the runs of :func:`plan_imports` into ``workdir``; returns how many."""
  plan = plan_imports(suite, workdir, sources)
  for rel, src in plan:
    target = os.path.join(workdir, rel)
    if os.path.exists(target):
      os.rmdir(target)  # empty: plan_imports refuses a run directory with anything in it
    shutil.copytree(src, target)
    say(f"imported {rel} from {src}")
  return len(plan)

