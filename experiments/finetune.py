r"""Fine-tunes a trained run or a Hugging Face MoE, or upcycles a dense one: ``python -m
experiments.finetune --source=DIR --workdir=FT``.

The model is the source's: a moejax run directory (its config.json and
newest checkpoint, or ``--config.finetune.source_step``) or a Hugging Face
checkpoint directory (config.json + safetensors of a Mixtral). The config
file (default ``configs/finetune.py``) gives the data mixture, the
optimisation and the fine-tuning options::

    --config.finetune.freeze='("router",)'          # router frozen (bias too)
    --config.finetune.freeze='("experts",)'         # experts frozen
    --config.finetune.freeze='("all",)' --config.finetune.lora='("attention", "dense")' \
        --config.finetune.lora_rank=8                # generic LoRA: experts untouched
    --config.finetune.freeze='("all",)' --config.finetune.lora='("experts",)' \
        --config.finetune.lora_rank=8                # per-expert LoRA
    --config.finetune.controller=frozen              # bias held while the router trains
    --config.data.loss_domains='("comment", "docstring")'   # the data mixture

Upcycling (``--config=configs/upcycle.py``, or ``--source_format=upcycle``):
the source is a dense moejax run or a Hugging Face Mistral / Llama, the
model its own with the config file's ``model.moe`` in the layers of
``model.moe_layout``, every expert starting from its layer's dense FFN
(``--config.finetune.upcycle.split / noise / drop / renormalize /
router_init``, docs/finetune.md)::

    python -m experiments.finetune --config=configs/upcycle.py \
        --source=/tmp/moejax_dense --workdir=/tmp/upcycled

Before training it prints the run's accounting (trainable parameters,
optimizer-state bytes, an activation-memory estimate) and which domains its
loss covers (``data.loss_domains``: configs/finetune.py scores comments and
docstrings only); after training, every domain's validation loss.
``--accounting`` first prints the accounting of every standard option side
by side, then fine-tunes; without ``--workdir`` it stops after the table
and writes nothing. Rerunning the same command resumes (the source is read only when the
run starts); the workdir is an ordinary run directory (``moejax.load``,
``experiments.generate``, ``experiments.export_hf``). ``--print_config`` and
``--dry_run`` as in ``experiments.train``.

Exit status: 0 done; 1 a config, source, data or workdir error (one
``error:`` line, before anything is written) or a NaN/inf; 143 / 130 stopped by
SIGTERM / SIGINT with a checkpoint of its last step (the same command resumes).
"""

from __future__ import annotations

import os
import sys

from absl import app, flags
from ml_collections import config_flags

from experiments import cli
from experiments import common_flags

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "configs", "finetune.py")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Fine-tuning config file (data, train, finetune sections; the model is "
    "the source's; default configs/finetune.py); override fields with "
    "--config.section.field=value.", lock_config=True)
_SOURCE = flags.DEFINE_string("source", None, "The run directory (moejax) or Hugging Face "
                              "checkpoint directory to fine-tune.")
_FORMAT = flags.DEFINE_enum("source_format", "auto", ["auto", "moejax", "hf", "upcycle"],
                            "auto: the config file's finetune.source_format when it is "
                            "'upcycle' (configs/upcycle.py); else a directory with checkpoints/ "
                            "is a moejax run, one whose config.json has a model_type is a "
                            "Hugging Face model. upcycle: a dense moejax run or Hugging Face "
                            "Mistral / Llama made the config's MoE (moejax.finetune.upcycle).")
_WORKDIR = flags.DEFINE_string("workdir", None, "The fine-tuning run's directory.")
_ACCOUNTING = flags.DEFINE_bool("accounting", False, "First print the accounting of every "
                                "standard option (full, router / experts frozen, LoRA on "
                                "attention+dense, LoRA on experts) and of this run side by side, "
                                "then fine-tune in --workdir; without --workdir, stop after the "
                                "table (nothing is written).")
_PRINT_CONFIG = common_flags.print_config()
_DRY_RUN = common_flags.dry_run()
_TAKE_OVER = common_flags.take_over_lock()
flags.mark_flags_as_required(["source"])


def source_format(path: str, given: str, tree=None) -> str:
  """``given``, or for ``auto`` the config's upcycling or what the directory holds (see the
  flag)."""
  if given != "auto":
    return given
  tree = tree.to_dict() if hasattr(tree, "to_dict") else dict(tree or {})
  if dict(tree.get("finetune") or {}).get("source_format") == "upcycle":
    return "upcycle"
  from moejax.finetune.source import detect_format  # pylint: disable=g-import-not-at-top
  return detect_format(path)


def build(tree, source: str, fmt: str):
  """The ExperimentConfig: the config file's sections, the source's model (upcycling: the
  source's, with the config's ``model.moe`` layers)."""
  # pylint: disable=g-import-not-at-top
  from moejax.config import ConfigError, to_dict
  from moejax.finetune import source as source_lib
  from moejax.train.config import experiment_from_dict
  tree = tree.to_dict() if hasattr(tree, "to_dict") else dict(tree)
  if tree.get("model") and fmt != "upcycle":
    raise ConfigError("model", "...", f"a fine-tuning run's model is its source's "
                      f"(source_format={fmt!r})", "drop the model section, or upcycle a dense "
                      "source (--source_format=upcycle, configs/upcycle.py)")
  tree["model"] = to_dict(source_lib.source_model(source, fmt, tree))
  tree.setdefault("finetune", {})
  tree["finetune"]["source"], tree["finetune"]["source_format"] = source, fmt
  return experiment_from_dict(tree)


def print_accounting(cfg, out=sys.stdout) -> None:
  # pylint: disable=g-import-not-at-top
  from moejax.finetune import accounting, files
  from moejax.train import step as step_lib
  from moejax.train.optim import make_optimizer
  rows = {}
  for name, option in files.option_configs(cfg).items():
    tx = make_optimizer(option.train, option.model, option.finetune)
    _, abstract = step_lib.abstract_state(option, tx)
    rows[name] = accounting.accounting(option, abstract.params, tx)
  print(f"accounting of fine-tuning options at {cfg.data.batch_size} x {cfg.data.seq_len} "
        f"tokens per step (LoRA rank {cfg.finetune.lora_rank or 8}):", file=out)
  print(accounting.table(rows), file=out)


def dry_run(cfg, workdir, out=sys.stdout, take_over_lock: bool = False) -> None:
  """The read-only checks of a fine-tuning run, its source and accounting; writes nothing."""
  # pylint: disable=g-import-not-at-top
  from moejax.finetune import source as source_lib
  from moejax.train import checkpoint as ckpt_lib
  from moejax.train import lock as lock_lib
  from moejax.train import loop
  loop.check_runnable(cfg)
  loop.device_layout(cfg)
  if workdir:
    lock_lib.check_unlocked(workdir, take_over_lock)
    plan = ckpt_lib.check_workdir(workdir, cfg)
    if plan.step is None:
      print(f"source: {source_lib.open_source(cfg).describe()}", file=out)
      print(f"workdir {workdir}: new run", file=out)
    else:
      print(f"workdir {workdir}: resumes from checkpoint {plan.step} (the source is not read "
            "again)", file=out)
  print_accounting(cfg, out)
  print("dry run: the config is valid; nothing was written", file=out)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.quiet_logs()
  tree = cli.config_tree(_CONFIG)
  # pylint: disable=g-import-not-at-top
  from moejax.config import ConfigError
  from moejax.data import DatasetUnavailableError
  from moejax.train import guard
  from moejax.train.preempt import Preempted
  from moejax.train.audit import AuditError
  from moejax.train.checkpoint import WorkdirError
  from moejax.train.config import experiment_to_json
  source = _SOURCE.value
  if not _PRINT_CONFIG.value:
    cli.check_writable("--workdir", _WORKDIR.value)  # before the source is read
  try:
    cfg = build(tree, source, source_format(source, _FORMAT.value, tree)).for_platform()
    if _PRINT_CONFIG.value:
      print(experiment_to_json(cfg))
      return
    if _DRY_RUN.value:
      dry_run(cfg, _WORKDIR.value, take_over_lock=_TAKE_OVER.value)
      return
    if _ACCOUNTING.value:
      print_accounting(cfg)
      if not _WORKDIR.value:
        print("accounting only: nothing was trained or written (add --workdir=DIR to "
              "fine-tune after the table)")
        return
    if not _WORKDIR.value:
      cli.fail("--workdir is required (unless --print_config, --accounting or --dry_run)")
    from moejax.finetune.scope import domain_summary
    from moejax.finetune.start import finetune_start
    from moejax.train import loop
    loop.train(cfg, _WORKDIR.value, start=finetune_start, take_over_lock=_TAKE_OVER.value)
    print(domain_summary(cfg, _WORKDIR.value))
  except Preempted as e:  # SIGTERM / SIGINT: checkpoint written, lock released
    cli.preempted(e)
  except (ConfigError, AuditError, DatasetUnavailableError, WorkdirError,
          guard.NonFiniteError) as e:
    cli.fail(f"{type(e).__name__}: {e}")
  except OSError as e:
    cli.fail(f"{type(e).__name__}: {e}")


def with_default_config(argv: list[str]) -> list[str]:
  """``argv`` with ``--config=configs/finetune.py`` when no config file is given.

  (A flag default would be parsed, with the command line's overrides, when
  the flag is defined: a misspelt override would then be a traceback.)
  """
  if any(a == "--config" or a.startswith("--config=") for a in argv[1:]):
    return argv
  return [argv[0], f"--config={_DEFAULT_CONFIG}", *argv[1:]]


if __name__ == "__main__":
  sys.argv = with_default_config(sys.argv)
  cli.run(main, distributed=True)
