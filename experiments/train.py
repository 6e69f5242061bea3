r"""Trains one experiment: ``python -m experiments.train --config=configs/default.py --workdir=DIR``.

Overrides: ``--config.train.steps=2000 --config.model.moe.topology.num_experts=16``;
a key that does not exist is an error (the config files list every field),
and the values are validated before anything runs. A ``--workdir`` holding a
checkpoint of the same model resumes from it exactly; one holding another
model's run is refused, untouched.

Exit status: 0 done; 1 a config, data or workdir error (before any compute)
or a NaN/inf loss (the last good checkpoint is kept).
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (configs/*.py); override fields with "
    "--config.section.field=value.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: config.json, checkpoints, "
                               "metrics.jsonl, tensorboard/. Resumed when it holds a checkpoint.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # Orbax logs every checkpoint step at INFO; the progress lines are the output.
    logging.set_verbosity(logging.WARNING)
  # Imported after flag parsing so that --help and flag errors are instant.
  from moejax.config import ConfigError  # pylint: disable=g-import-not-at-top
  from moejax.data import DatasetUnavailableError  # pylint: disable=g-import-not-at-top
  from moejax.train import loop  # pylint: disable=g-import-not-at-top
  from moejax.train.checkpoint import WorkdirError  # pylint: disable=g-import-not-at-top
  from moejax.train.config import experiment_from_dict  # pylint: disable=g-import-not-at-top
  try:
    cfg = experiment_from_dict(_CONFIG.value)
    loop.train(cfg, _WORKDIR.value)
  except (ConfigError, DatasetUnavailableError, WorkdirError, loop.NonFiniteLossError) as e:
    print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
