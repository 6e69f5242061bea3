r"""Runs an equal-budget ablation suite.

    python -m experiments.ablate --config=configs/ablations/quick.py --workdir=/tmp/quick

Prints every arm's budget (total params, active params/token, FLOPs/token,
training tokens, optimizer), refuses to run (exit 1, nothing written or
trained) when the arms differ beyond the suite's tolerance on what it holds
fixed, then trains every arm and seed in ``DIR/<arm>[/seed_<s>]`` and writes
``DIR/summary.md``, ``summary.csv`` and ``plots/``. After training it prints
the budget of what ran: each router's declared slots beside the FFN experts
per token it realised, the arms compared on that realised compute
(moejax.ablation.realised); a run whose router used more experts than it
declares at most fails at its end (exit 1, one line). Rerunning the same command
after a kill resumes: finished arms are skipped, a half-trained arm resumes
from its checkpoint. SIGTERM / SIGINT stop the run in training after its
step with a checkpoint (exit status 143 / 130, moejax.train.preempt); the
same command resumes that run from it.

Overrides reach the suite tree: ``--config.base.train.steps=50`` (every arm),
``--config.seeds='(0,1)'``, ``--config.scale=m`` (the scale ladder,
moejax.ablation.scale: every arm wider, deeper, longer by the rung's
factors). A changed config that would relabel results already in ``DIR``
(e.g. more steps on a finished suite) is refused before anything is
written; ``--extend`` trains the extra steps instead. A ``DIR`` in use by
another ``experiments.ablate`` is refused (``DIR/run.lock``). Compiled
programs are cached in ``DIR/compile_cache`` (JAX's persistent cache;
``JAX_COMPILATION_CACHE_DIR`` overrides), so the seeds of an arm and a
resumed suite do not compile again.

``--budget_only`` prints and checks the budget and exits; ``--ladder``
prints the baseline arm's size and compute at every rung of the scale
ladder and exits; ``--dry_run`` also checks every run's directory and says
what would happen to it (new, resumed, finished), writing nothing;
``--print_config`` prints the suite with its resolved base experiment
(every field) and each arm's changes to it, as JSON.

Seeds in parallel: run each seed as its own process and directory
(``--config.seeds='(1,)' --config.reproduction=False --workdir=DIR_1``),
then ``--import_runs=DIR_0,DIR_1,DIR_2 --workdir=DIR`` with the full suite
copies their finished runs into ``DIR/<arm>/seed_<s>`` (moejax.ablation.merge)
and writes the summary without training them again.

Several processes (``--coordinator_address=HOST:PORT --num_processes=N
--process_id=I``, or a SLURM / Open MPI / TPU-pod launch; see
experiments/distributed.py and docs/parallel.md): every process runs every
arm in the same order, each arm's training spread over all their devices;
process 0 holds the suite's lock and writes every file of the suite
(moejax.ablation.runner), and decides which runs are finished for all.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags
from ml_collections import config_flags

from experiments import cli
from experiments import common_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Suite file (configs/ablations/*.py).", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "Suite results directory.")
_BUDGET_ONLY = flags.DEFINE_bool("budget_only", False, "Print and check the budget table, "
                                 "then exit without training.")
_DRY_RUN = common_flags.dry_run()
_LADDER = flags.DEFINE_bool("ladder", False, "Print the suite's baseline arm at every rung of "
                            "the scale ladder (--config.scale=s|m|l) as a Markdown table, "
                            "then exit.")
_PRINT_CONFIG = common_flags.print_config()
_EXTEND = common_flags.extend()
_IMPORT_RUNS = flags.DEFINE_list("import_runs", [], "Suite directories (e.g. one per seed, "
                                 "run as separate processes) whose finished runs of this suite "
                                 "are copied into --workdir first (moejax.ablation.merge).")
_TAKE_OVER = common_flags.take_over_lock()
_PLAN = flags.DEFINE_bool("plan", False, "Print, for every arm and metric the suite gives an "
                          "effect size (suite.effects), the seeds that resolve it with 80% "
                          "power, planned from the committed summary's spread "
                          "(results/NAME[@scale].json, or --pilot), and the training time; "
                          "then exit without training.")
_PILOT = flags.DEFINE_string("pilot", None, "With --plan: the summary JSON to take each arm's "
                             "spread from (default: results/NAME[@scale].json).")
flags.mark_flags_as_required(["config"])


def resolved_suite(tree, suite) -> dict:
  """The suite as JSON: its fields, the resolved base experiment, each arm's changes."""
  # pylint: disable=g-import-not-at-top
  from moejax.ablation.suite import base_experiment
  from moejax.config import to_dict
  from moejax.train.config import diff
  base = to_dict(base_experiment(tree).for_platform())  # what runs: 'auto' resolved
  arms = {}
  for arm in suite.arms:
    changes = diff(base, to_dict(arm.experiment.for_platform()))
    arms[arm.name] = {c.split(":", 1)[0]: c.split(": ", 1)[1].split(" -> ", 1)[1]
                      for c in changes}
  return {"name": suite.name, "description": suite.description, "fixed": dict(suite.fixed),
          "seeds": list(suite.seeds), "analysis": dict(suite.analysis), "scale": suite.scale,
          "base": base,
          "arms (changes to base: field -> value)": arms}


def _plan(suite) -> None:
  import os  # pylint: disable=g-import-not-at-top
  from moejax.ablation import power  # pylint: disable=g-import-not-at-top
  if not suite.effects:
    cli.fail(f"suite {suite.name} states no effect size (suite.effects), so there is nothing to "
             "plan. Fix: add effects={'val_loss': {'size': X, 'source': '...'}} to its "
             "get_config()")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  path = _PILOT.value or os.path.join(root, "results", power.pilot_id(suite) + ".json")
  if not os.path.exists(path):
    cli.fail(f"--pilot={path}: no pilot summary. Fix: run the suite with a few seeds, then "
             "python -m experiments.report ID=DIR --results_dir results (or pass --pilot)")
  with open(path, encoding="utf-8") as f:
    pilot = json.load(f)
  rows, seconds = power.plan(suite, pilot)
  print(f"{suite.name} at {suite.scale}: effect sizes and their sources")
  for metric, spec in suite.effects.items():
    print(f"  {metric}: {spec['size']:.3g} ({spec['source']})")
  print(f"pilot: {path}")
  print(power.plan_table(suite, rows, seconds))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  tree = cli.config_tree(_CONFIG)
  # pylint: disable=g-import-not-at-top
  from moejax.ablation import merge, provenance, runner, suite as suite_lib
  from moejax.ablation.budget import BudgetError
  from moejax.config import ConfigError
  from moejax.data import DatasetUnavailableError
  from moejax.train import guard
  from moejax.train.processes import LeadFailed
  from moejax.train.preempt import Preempted
  from moejax.train.checkpoint import WorkdirError
  try:
    suite = suite_lib.suite_from_dict(tree)
    if _LADDER.value:
      print(runner.ladder_table(tree))
      return
    if _PRINT_CONFIG.value:
      print(json.dumps(resolved_suite(tree, suite), indent=2, default=list))
      return
    if _PLAN.value:
      return _plan(suite)
    if not _BUDGET_ONLY.value:
      cli.check_writable("--workdir", _WORKDIR.value)  # before the budget table
    if _BUDGET_ONLY.value:
      runner.check_suite(suite)
      return
    if _DRY_RUN.value:
      runner.check_suite(suite)
      if _WORKDIR.value:
        imports = dict(merge.plan_imports(suite, _WORKDIR.value, _IMPORT_RUNS.value)
                       if _IMPORT_RUNS.value else ())
        plan = runner.plan_suite(suite, _WORKDIR.value, _EXTEND.value, _TAKE_OVER.value)
        for rel, what in plan:
          print(f"  {rel}: " + (f"finished in {imports[rel]} (would be imported)"
                                if rel in imports else what))
        for line in provenance.plugin_changes(_WORKDIR.value, dict(plan)):
          print(f"  {line}")
      print("dry run: the suite is valid; nothing was written")
      return
    if not _WORKDIR.value:
      cli.fail("--workdir is required unless --budget_only, --dry_run or --print_config")
    cli.compilation_cache(_WORKDIR.value)  # written from the first compile: after the checks
    imports = ((lambda: merge.import_runs(suite, _WORKDIR.value, _IMPORT_RUNS.value))
               if _IMPORT_RUNS.value else None)
    runner.run_suite(suite, _WORKDIR.value, extend=_EXTEND.value, before_plan=imports,
                     take_over_lock=_TAKE_OVER.value)
  except Preempted as e:  # SIGTERM / SIGINT: checkpoint written, lock released
    cli.preempted(e)
  except LeadFailed as e:  # process 0's refusal, on another process: the same error line
    cli.fail(e.line)
  except (ConfigError, BudgetError, DatasetUnavailableError, WorkdirError,
          guard.NonFiniteError) as e:
    cli.fail(f"{type(e).__name__}: {e}")
  except OSError as e:  # an unwritable path found late (disk full, permissions)
    cli.fail(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
  cli.run(main, experiment_at="base", distributed=True)
