"""The run's workdir: its config, its orbax checkpoints, and the resume checks.

Layout of ``WORKDIR``::

    config.json         the ExperimentConfig of the run (written once, at its start)
    checkpoints/<step>/ orbax: ``state`` (TrainState: params, optimizer state,
                        router state, step, PRNG key) and ``data`` (the train
                        iterator's JSON state)
    metrics.jsonl, tensorboard/   see moejax.train.metrics_log

:func:`check_workdir` runs before anything is computed or written: a workdir
that holds another model's run (different model or data config, or
checkpoint shapes that do not match) is a :class:`WorkdirError` naming the
differences, and the workdir stays as it was. Checkpoints are written
atomically by orbax (a temporary directory renamed when complete), so a run
killed while saving resumes from the previous complete one.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from moejax.train.config import ExperimentConfig, diff, experiment_to_json

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
# Fields that may change between a run and its resumption: where the data
# lives, and how it is fetched, do not change what the run computes.
_RELOCATABLE = ("data.data_dir", "data.download")


class WorkdirError(RuntimeError):
  """The workdir holds a run this config cannot continue."""


def checkpoint_steps(workdir: str) -> list[int]:
  """Steps of the complete checkpoints in ``workdir``, ascending (orbax's temporaries excluded)."""
  root = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(root):
    return []
  return sorted(int(n) for n in os.listdir(root) if n.isdigit()
                and os.path.isdir(os.path.join(root, n)))


def check_workdir(workdir: str, cfg: ExperimentConfig) -> tuple[Optional[int], list[str]]:
  """(latest checkpoint step or None, train/parallel config changes) of a compatible workdir.

  Raises WorkdirError when the saved run's model or data differ from ``cfg``.
  Reads only.
  """
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f"--workdir={workdir} is a file. Fix: pass a directory")
  path = os.path.join(workdir, CONFIG_FILE)
  steps = checkpoint_steps(workdir)
  if not os.path.exists(path):
    if steps:
      raise WorkdirError(
          f"{workdir} holds checkpoints (steps {steps}) but no {CONFIG_FILE}, so it cannot be "
          "checked against this config. Fix: use a new --workdir, or restore the "
          f"{CONFIG_FILE} of that run")
    return None, []
  with open(path, encoding="utf-8") as f:
    saved = json.load(f)
  new = json.loads(experiment_to_json(cfg))
  changes = [c for c in diff(saved, new)
             if not c.startswith(_RELOCATABLE)]
  fatal = [c for c in changes if c.startswith(("model.", "data."))]
  if fatal:
    raise WorkdirError(
        f"{workdir} holds a run of a different model or data stream; it cannot be resumed "
        f"with this config:\n  " + "\n  ".join(f"{c} (saved -> requested)" for c in fatal)
        + f"\nFix: use a new --workdir, or the saved config ({path}); nothing was changed in "
        f"{workdir}")
  # The device layout (``parallel``, absent from older config.json files) does
  # not change the state's shapes or values, so it may change on resume too.
  return (steps[-1] if steps else None), [c for c in changes
                                          if c.startswith(("train.", "parallel"))]


def write_config(workdir: str, cfg: ExperimentConfig) -> None:
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, CONFIG_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(experiment_to_json(cfg) + "\n")
  os.replace(tmp, path)


def _key_name(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _shapes(tree: Any) -> dict[str, tuple]:
  """{'params/blocks/0/...': shape}; dict keys, attributes and indices all as strings."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {"/".join(_key_name(k) for k in p): tuple(getattr(v, "shape", ())) for p, v in flat}


class Checkpointer:
  """Orbax CheckpointManager over ``WORKDIR/checkpoints``: a TrainState plus the data state."""

  def __init__(self, workdir: str, keep: int, read_only: bool = False):
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                           read_only=read_only,
                                           cleanup_tmp_directories=not read_only)
    # Handlers named up front so that metadata can be read before any restore.
    handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}
    self.manager = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR)),
                                         options=options, item_handlers=handlers)

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def check_shapes(self, step: int, abstract_state: Any) -> None:
    """WorkdirError when the checkpoint's arrays do not have the abstract state's shapes."""
    meta = self.manager.item_metadata(step)["state"]
    want, have = _shapes(abstract_state), _shapes(meta)
    bad = sorted((k for k in set(want) | set(have) if want.get(k) != have.get(k)),
                 key=lambda k: (not k.startswith("params"), k))  # params first: the clearest
    if bad:
      lines = [f"{k}: checkpoint {have.get(k, '<absent>')} vs model {want.get(k, '<absent>')}"
               for k in bad[:10]]
      raise WorkdirError(
          f"checkpoint {step} in {self.manager.directory} does not fit this model "
          f"({len(bad)} mismatched arrays):\n  " + "\n  ".join(lines)
          + "\nFix: use a new --workdir, or the config the checkpoint was written with")

  def save(self, step: int, state: Any, data_state: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    data=ocp.args.JsonSave(data_state)))

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return out["state"], dict(out["data"])

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
