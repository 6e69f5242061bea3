r"""Runs an equal-budget ablation suite.

    python -m experiments.ablate --config=configs/ablations/quick.py --workdir=/tmp/quick

Prints every arm's budget (total params, active params/token, FLOPs/token,
training tokens, optimizer), refuses to run (exit 1, nothing written or
trained) when the arms differ beyond the suite's tolerance on what it holds
fixed, then trains every arm and seed in ``DIR/<arm>[/seed_<s>]`` and writes
``DIR/summary.md``, ``summary.csv`` and ``plots/``. Rerunning the same command
after a kill resumes: finished arms are skipped, a half-trained arm resumes
from its checkpoint.

Overrides reach the suite tree: ``--config.base.train.steps=50`` (every arm),
``--config.seeds='(0,1)'``. ``--budget_only`` prints and checks the budget and
exits.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Suite file (configs/ablations/*.py).", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "Suite results directory.")
_BUDGET_ONLY = flags.DEFINE_bool("budget_only", False, "Print and check the budget table, "
                                 "then exit without training.")
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.ERROR)  # orbax warns on every read-only restore
  from moejax.ablation import runner, suite as suite_lib  # pylint: disable=g-import-not-at-top
  from moejax.ablation.budget import BudgetError  # pylint: disable=g-import-not-at-top
  from moejax.config import ConfigError  # pylint: disable=g-import-not-at-top
  from moejax.data import DatasetUnavailableError  # pylint: disable=g-import-not-at-top
  from moejax.train import loop  # pylint: disable=g-import-not-at-top
  from moejax.train.checkpoint import WorkdirError  # pylint: disable=g-import-not-at-top
  try:
    suite = suite_lib.suite_from_dict(_CONFIG.value)
    if _BUDGET_ONLY.value:
      runner.check_suite(suite)
      return
    if not _WORKDIR.value:
      raise app.UsageError("--workdir is required unless --budget_only")
    runner.run_suite(suite, _WORKDIR.value)
  except (ConfigError, BudgetError, DatasetUnavailableError, WorkdirError,
          loop.NonFiniteLossError) as e:
    print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
