r"""Trains one experiment: ``python -m experiments.train --config=configs/default.py --workdir=DIR``.

Overrides: ``--config.train.steps=2000 --config.model.moe.topology.num_experts=16``;
a key that does not exist is an error (the config files list every field),
and the values are validated before anything runs. A ``--workdir`` holding a
checkpoint of the same run resumes from it exactly; one holding a run this
config would misdescribe (another model, data stream, optimizer or seed) is
refused, untouched. ``--extend`` with a larger ``--config.train.steps``
trains a finished run on (recorded in ``DIR/history.jsonl``). A workdir in
use by another run (``DIR/run.lock``) is refused; a lock left on another host
is taken over once its heartbeat is 10 minutes old, or at once with
``--take_over_lock`` (moejax.train.lock).

``--print_config`` prints the resolved config (every field, defaults
included) as JSON and exits; ``--dry_run`` validates everything, prints the
parameter / budget table and what would happen in ``--workdir``, and writes
nothing.

Exit status: 0 done; 1 a config, data or workdir error (before any compute;
one ``error:`` line) or a NaN/inf loss, gradient or state (the last good
checkpoint is kept); 143 / 130 stopped by SIGTERM / SIGINT after the step in
progress, with its checkpoint written (moejax.train.preempt): the same
command resumes from it.
"""

from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

from experiments import cli
from experiments import common_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (configs/*.py); override fields with "
    "--config.section.field=value.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: config.json, checkpoints, "
                               "metrics.jsonl, tensorboard/, history.jsonl. Resumed when it "
                               "holds a checkpoint.")
_EXTEND = common_flags.extend()
_PRINT_CONFIG = common_flags.print_config()
_DRY_RUN = common_flags.dry_run()
_TAKE_OVER = common_flags.take_over_lock()
flags.mark_flags_as_required(["config"])


def dry_run(cfg, workdir, extend: bool, out=sys.stdout, take_over_lock: bool = False) -> None:
  """Every read-only check of a run, and its budget; writes nothing."""
  # pylint: disable=g-import-not-at-top
  from moejax.ablation import budget as budget_lib
  from moejax.train import checkpoint as ckpt_lib
  from moejax.train import lock as lock_lib
  from moejax.train import loop
  say = lambda text: print(text, file=out, flush=True)
  loop.check_runnable(cfg)
  loop.device_layout(cfg)
  b = budget_lib.arm_budget(cfg)
  say("budget (total / active params, forward FLOPs per token, training tokens, optimizer):")
  say(budget_lib.table({"run": b}))
  say(f"data: {cfg.data.name}, {cfg.data.batch_size} x {cfg.data.seq_len} tokens per step; "
      f"{describe_data(cfg.data)}")
  if workdir:
    lock_lib.check_unlocked(workdir, take_over_lock)
    plan = ckpt_lib.check_workdir(workdir, cfg, extend=extend)
    say(f"workdir {workdir}: {describe_plan(plan, cfg)}")
  say("dry run: the config is valid; nothing was written")


def describe_data(data_cfg) -> str:
  """Whether the dataset is prepared, without preparing it (read-only)."""
  from moejax import data as data_lib  # pylint: disable=g-import-not-at-top
  data_dir = data_lib.resolve_data_dir(data_cfg.data_dir)
  if data_cfg.name not in data_lib.BUILTIN_DATASETS:
    return f"TFDS dataset read from {data_dir}"
  try:
    builder = data_lib.builtin_builder(data_cfg.name, data_dir, data_cfg.builder_config(),
                                       prepare=False)
    ready = builder.is_prepared()
  except Exception:  # pylint: disable=broad-except
    ready = False
  return (f"prepared in {data_dir}" if ready
          else f"not prepared yet: the run prepares it in {data_dir} (seconds, no download)")


def describe_plan(plan, cfg) -> str:
  if plan.step is None:
    return "new run" if plan.saved is None else "no checkpoint yet: starts the run again"
  if plan.finished:
    return f"finished at step {plan.step}: nothing to train"
  what = f"resumes from checkpoint {plan.step} to step {cfg.train.steps}"
  if plan.extend_from is not None:
    what += f" (extended from train.steps={plan.extend_from})"
  if plan.changes:
    what += "; changed: " + "; ".join(plan.changes)
  return what


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  tree = cli.config_tree(_CONFIG)
  # Imported after flag parsing so that --help and flag errors are instant.
  # pylint: disable=g-import-not-at-top
  from moejax.config import ConfigError
  from moejax.data import DatasetUnavailableError
  from moejax.train import guard
  from moejax.train.preempt import Preempted
  from moejax.train import write_failure
  from moejax.train.audit import AuditError
  from moejax.train.checkpoint import WorkdirError
  from moejax.train.config import experiment_from_dict, experiment_to_json
  try:
    # 'auto' backend resolved for this platform here, after the launch set JAX up.
    cfg = experiment_from_dict(tree).for_platform()
    if _PRINT_CONFIG.value:
      print(experiment_to_json(cfg))
      return
    cli.check_writable("--workdir", _WORKDIR.value)  # before the dry run's table, the data
    if _DRY_RUN.value:
      dry_run(cfg, _WORKDIR.value, _EXTEND.value, take_over_lock=_TAKE_OVER.value)
      return
    if not _WORKDIR.value:
      cli.fail("--workdir is required (unless --print_config or --dry_run)")
    from moejax.finetune.start import finetune_start
    from moejax.train import loop
    loop.train(cfg, _WORKDIR.value, extend=_EXTEND.value, start=finetune_start,
               take_over_lock=_TAKE_OVER.value)
  except Preempted as e:  # SIGTERM / SIGINT: checkpoint written, lock released
    cli.preempted(e)
  except (ConfigError, AuditError, DatasetUnavailableError, WorkdirError,
          guard.NonFiniteError) as e:
    cli.fail(f"{type(e).__name__}: {e}")
  except OSError as e:  # an unwritable path found late (disk full, permissions)
    failed = write_failure.late(e, _WORKDIR.value) if _WORKDIR.value else None
    cli.fail(f"{type(failed or e).__name__}: {failed or e}")


if __name__ == "__main__":
  cli.run(main, experiment_at="", distributed=True)
