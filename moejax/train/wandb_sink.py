"""An optional Weights & Biases writer beside TensorBoard (``train.wandb_project``).

It receives exactly what TensorBoard receives from
:class:`moejax.train.metrics_log.MetricsWriter`: ``<split>/<name>`` scalars
at each logged step and the per-layer expert loads as histograms, so a
metric has one name in ``metrics.jsonl`` (``name`` in a ``split`` row),
TensorBoard and W&B. The run's resolved config goes to ``wandb.config``.

``train.wandb_mode='offline'`` (the default) writes the run under
``WORKDIR/wandb`` and sends nothing (``wandb sync WORKDIR/wandb/offline-run-*``
uploads it later, e.g. from a login node); ``online`` streams it. The W&B run
id is kept in ``WORKDIR/wandb_run_id``, so a resumed run appends to the same
W&B run. W&B keeps the first value it got for a step: the steps a killed
run logged after its last checkpoint are not replaced when the resumed run
logs them again (``metrics.jsonl`` and TensorBoard do replace them).

wandb is an extra (``pip install -e ".[wandb]"``); naming a project without
it is one error line before training starts.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Mapping, Optional

import numpy as np

from moejax.config import ConfigError

RUN_ID_FILE = "wandb_run_id"
MODES = ("offline", "online")


def _import_wandb(project: str):
  try:
    import wandb  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError("train.wandb_project", project, "needs wandb, which is not installed",
                      "pip install -e \".[wandb]\", or leave train.wandb_project empty") from e
  return wandb


def run_id(workdir: str) -> str:
  """The W&B run id of this workdir: read back on resume, else a new one written down."""
  path = os.path.join(workdir, RUN_ID_FILE)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return f.read().strip()
  rid = uuid.uuid4().hex[:12]
  with open(path, "w", encoding="utf-8") as f:
    f.write(rid + "\n")
  return rid


class WandbSink:
  """``add_scalars`` / ``add_histograms`` / ``close``, as the TensorBoard writer has."""

  def __init__(self, workdir: str, project: str, mode: str, config: Mapping[str, Any],
               name: Optional[str] = None):
    self._wandb = _import_wandb(project)
    self._run = self._wandb.init(
        project=project, dir=workdir, mode=mode, id=run_id(workdir), resume="allow",
        name=name or os.path.basename(os.path.normpath(workdir)), config=dict(config),
        settings=self._wandb.Settings(console="off", silent=True))

  def add_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    self._run.log(dict(scalars), step=step)

  def add_histograms(self, step: int, values: Mapping[str, np.ndarray]) -> None:
    self._run.log({tag: self._wandb.Histogram(np.asarray(v)) for tag, v in values.items()},
                  step=step)

  def close(self) -> None:
    self._run.finish()


def sink_for(train_cfg, workdir: str, config: Mapping[str, Any]) -> Optional[WandbSink]:
  """The W&B sink a run's ``train`` config asks for, or None."""
  if not train_cfg.wandb_project:
    return None
  return WandbSink(workdir, train_cfg.wandb_project, train_cfg.wandb_mode, config)
