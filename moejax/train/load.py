"""A trained model back from its workdir: ``moejax.load(workdir)``.

::

    import moejax
    model, cfg = moejax.load("/tmp/moejax_default")      # newest checkpoint
    logits, aux = model(tokens, train=False)               # a moejax.model.Transformer
    model, cfg = moejax.load("/tmp/moejax_default", step=200)

The config is the run's ``config.json`` (an ExperimentConfig); the model is
built from it and merged with the checkpoint's params and router state (the
aux-loss-free bias), so it routes as it did in training. Nothing is written.

The checkpoint is verified against its ``checksums.json`` (the rule of
:mod:`moejax.train.integrity`, as a resumed run applies it): an array or the
data state that differs from what was saved is a
:class:`~moejax.train.checkpoint.WorkdirError` naming the checkpoint, the leaf
and the fix (load an earlier step, or move the damaged one aside); a
checkpoint without the file (an older moejax, a run killed before it was
written), or with arrays recorded unverified (sharded over the processes of
the run that saved them), loads, and one line on stderr says what was not
verified: once per run directory (an analysis loads every kept checkpoint),
by process 0 of a multi-process program.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import jax
from flax import nnx

from moejax import chatter
from moejax.config import ConfigError
from moejax.config import plugins as plugins_lib
from moejax.train import checkpoint as ckpt_lib
from moejax.train import damage, idea_restore, integrity
from moejax.train import step as step_lib
from moejax.train.config import ExperimentConfig, experiment_from_dict
from moejax.train.optim import make_optimizer


def run_config(workdir: str) -> ExperimentConfig:
  """The ExperimentConfig of the run in ``workdir`` (its config.json)."""
  path = os.path.join(workdir, ckpt_lib.CONFIG_FILE)
  if not os.path.exists(path):
    raise ckpt_lib.WorkdirError(f"{workdir} has no {ckpt_lib.CONFIG_FILE}: not a moejax run "
                                "directory. Fix: pass the --workdir of experiments.train (or a "
                                "suite run directory DIR/<arm>[/seed_<s>])")
  # A plugin idea the run used must be registered before its config is built.
  records = plugins_lib.load_record(workdir, say=lambda text: print(text, file=sys.stderr))
  with open(path, encoding="utf-8") as f:
    tree = json.load(f)
  try:
    return experiment_from_dict(tree)
  except ConfigError as e:
    if records or "is registered" not in e.problem:
      raise
    # A run made before its plugins were recorded: there is no config file to import them.
    raise ConfigError(e.field, e.value, f"{e.problem} here, and {workdir} records no "
                      f"{plugins_lib.PLUGINS_FILE}",
                      "import the module that registers it before moejax.load (or put "
                      "its folder on PYTHONPATH and import it)") from None


def model_at(cfg: ExperimentConfig, workdir: str, step: Optional[int] = None):
  """(nnx model, step) of ``cfg`` restored from ``workdir``'s checkpoint (the newest by default)."""
  tx = make_optimizer(cfg.train, cfg.model, cfg.finetune)
  graphdef, abstract = step_lib.abstract_state(cfg, tx)
  steps = ckpt_lib.checkpoint_steps(workdir)
  if not steps:
    raise ckpt_lib.WorkdirError(f"{workdir} has no checkpoint to load")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ckpt_lib.WorkdirError(f"{workdir} has no checkpoint at step {step}. Fix: pick one of "
                                f"{steps}")
  # Orbax's ~30 INFO notes per restore are not the caller's business (moejax.chatter).
  with chatter.quiet_library_logs():
    ckpt = ckpt_lib.Checkpointer(workdir, max(len(steps), 1), read_only=True)
    try:
      step_dir = ckpt.step_dir(step)
      problem = damage.data_state_problem(step_dir)
      if problem:
        raise _damaged(step_dir, step, steps, f"damaged: {problem}")
      try:
        tree, data_state = ckpt.restore(step, abstract.checkpoint_tree(),
                                        idea_restore.initial(cfg))
      except Exception as e:  # orbax / TensorStore: the part named, not their reprs
        raise _damaged(step_dir, step, steps, f"damaged: {damage.restore_error(e)}") from None
      _verify(step_dir, step, steps, ckpt.as_saved(tree), data_state)
    finally:
      ckpt.close()
  return nnx.merge(graphdef, tree["params"], tree["router_state"], tree["other"]), step


# Run directories already said to hold an unverified checkpoint in this process (one line each,
# not one per moejax.load: an analysis loads every kept step, a notebook reloads).
_SAID_UNVERIFIED: set[str] = set()


def _verify(step_dir: str, step: int, steps, tree, data_state: dict) -> None:
  """WorkdirError when the restored checkpoint differs from its checksums (module doc)."""
  verdict = integrity.verify_step(step_dir, tree, data_state)
  workdir = os.path.dirname(os.path.dirname(step_dir))
  if verdict.mismatches:
    raise _damaged(step_dir, step, steps, verdict.note)
  if not verdict.verified and workdir not in _SAID_UNVERIFIED and jax.process_index() == 0:
    _SAID_UNVERIFIED.add(workdir)
    print(f"note: {step_dir} loaded {verdict.note}", file=sys.stderr)


def _damaged(step_dir: str, step: int, steps, what: str) -> ckpt_lib.WorkdirError:
  """The error of a checkpoint that cannot be loaded as it is (``what``), with the fixes."""
  earlier = [s for s in steps if s < step]
  pick = (f"load an earlier checkpoint (step={earlier[-1]}; kept: {list(steps)})" if earlier
          else "retrain the run (no earlier checkpoint is kept)")
  aside = os.path.join(os.path.dirname(os.path.dirname(step_dir)), ckpt_lib.DAMAGED_DIR,
                       str(step))
  return ckpt_lib.WorkdirError(
      f"checkpoint {step} in {os.path.dirname(step_dir)} is {what}. Fix: {pick}, or move it "
      f"aside (mv {step_dir} {aside}) and resume the run, which trains from the previous "
      "checkpoint")


def load(workdir: str, step: Optional[int] = None):
  """(model, ExperimentConfig) of the run in ``workdir``; see the module docstring."""
  cfg = run_config(workdir)
  model, _ = model_at(cfg, workdir, step)
  return model, cfg
