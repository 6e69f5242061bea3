"""The run's workdir: its config, history, orbax checkpoints, and the resume checks.

Layout of ``WORKDIR``::

    config.json         the ExperimentConfig the run's results describe
    history.jsonl       one JSON line per start / resume / extension / end of the run
    run.lock            while a run writes here (moejax.train.lock)
    checkpoints/<step>/ orbax: ``state`` (TrainState: params, optimizer state,
                        router state, step, PRNG key) and ``data`` (the train
                        iterator's JSON state and the unlogged metric rows)
    checkpoints/<step>/checksums.json  what the arrays and data state were when saved
                        (moejax.train.integrity), written once orbax committed the step
    damaged_checkpoints/<step>/  checkpoints that failed to restore, moved aside
    metrics.jsonl, tensorboard/   see moejax.train.metrics_log

A results directory must always describe what was trained.
:func:`check_workdir` runs before anything is computed or written and
decides what a config may do to an existing run:

- a change of a field in :data:`RESUME_FREE_FIELDS` (where the data lives,
  logging, evaluation and checkpoint intervals, the execution backend, the
  device layout: how a run is executed or observed, not what it computes)
  resumes and is reported;
- ``train.steps`` may grow with ``extend=True`` (``--extend``): the extra
  steps are trained and the extension is recorded in ``history.jsonl``;
- any other change (model, data stream, optimizer, seed, fewer steps) is a
  :class:`WorkdirError` naming the field, the stored and the requested
  value, and the fix; the workdir stays as it was.

Checkpoints are written atomically by orbax (a temporary directory renamed
when complete), so a run killed while saving resumes from the previous
complete one; :func:`restore_latest` falls back past damaged, non-finite or
checksum-mismatching checkpoints and says so.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
from typing import Any, Callable, Optional

import jax
import orbax.checkpoint as ocp

from moejax.config import plugins as plugins_lib
from moejax.config import to_dict
from moejax.train import damage, idea_restore, integrity, layout_restore, writable
from moejax.train.event_loops import draining_event_loops, start_draining, stop_draining
from moejax.train.config import ExperimentConfig, current_layout, diff, experiment_to_json

CONFIG_FILE = "config.json"
HISTORY_FILE = "history.jsonl"
CHECKPOINT_DIR = "checkpoints"
DAMAGED_DIR = "damaged_checkpoints"

# Config fields that are not part of what a run *is*: changing them on resume
# changes how the run is executed, logged or evaluated, never the parameters
# it computes. The one list; dotted prefixes of ExperimentConfig paths.
BACKEND_FIELD = "model.moe.execution.backend"          # see moejax.execution.gmm
BACKEND_INTERPRET_FIELD = "model.moe.execution.interpret"
EXECUTOR_FIELD = "model.moe.execution.executor"     # single-device executors: one function
BACKEND_ORIGIN_FIELD = "model.moe.execution.derived_from"  # "auto on cpu" (ExperimentConfig.for_platform)
# auto's shape rule (moejax.execution.shape_choice): which backend runs each shape.
BACKEND_RULE_FIELDS = ("model.moe.execution.large_group_backend",
                       "model.moe.execution.large_group_rows")
RESUME_FREE_FIELDS = (
    "data.data_dir", "data.download",                  # where the data lives, how it is fetched
    "train.log_every", "train.progress",               # logging
    "train.eval_every", "train.eval_batches",          # periodic evaluation (the final one reads the whole split)
    "train.checkpoint_every", "train.keep_checkpoints",
    "train.nan_at_step",                               # test hook: can only stop a run
    "train.peak_tflops", "train.profile_steps",        # observation: MFU's peak, a trace
    "train.wandb_project", "train.wandb_mode",         # logging: the optional W&B copy
    BACKEND_FIELD, BACKEND_INTERPRET_FIELD,            # execution backend: identical parameters
    EXECUTOR_FIELD,
    BACKEND_ORIGIN_FIELD, *BACKEND_RULE_FIELDS,
    "parallel",                                        # device layout: same state shapes and values
)
# The one field that may change with an explicit extension (it grows only).
STEPS_FIELD = "train.steps"


class WorkdirError(RuntimeError):
  """The workdir holds a run this config cannot continue."""


def field_value(cfg: Any, dotted: str) -> Any:
  """The value at ``dotted`` (``model.moe.execution.backend``) of a config, None past a None section."""
  for part in dotted.split("."):
    if cfg is None:
      return None
    cfg = getattr(cfg, part)
  return cfg


def _path(change: str) -> str:
  return change.split(":", 1)[0]


def _within(path: str, fields) -> bool:
  return any(path == f or path.startswith(f + ".") for f in fields)


def with_defaults(saved: dict, requested: dict, _default=None) -> dict:
  """``saved`` with every key it lacks taken from the default ExperimentConfig.

  A stored config.json written before a field existed (``model.norm_eps``,
  ``data.loss_domains``, the ``finetune`` section) stands for that field's
  default; without this, every field added to moejax would read as a change
  and refuse to resume older runs. Only keys absent from ``saved`` are
  filled, and only where ``requested`` has them too.
  """
  if not isinstance(saved, dict) or not isinstance(requested, dict):
    return saved
  if _default is None:  # the top level: fields that moved since are read at their new place
    _default = json.loads(experiment_to_json(ExperimentConfig()))
    saved = current_layout(saved)
  out = dict(saved)
  for key, value in requested.items():
    fallback = _default.get(key) if isinstance(_default, dict) else None
    if key not in out:
      if isinstance(_default, dict) and key in _default:
        out[key] = fallback
    elif isinstance(out[key], dict):
      out[key] = with_defaults(out[key], value, fallback if isinstance(fallback, dict) else {})
  return out


def identity_changes(saved: dict, requested: dict) -> list[str]:
  """The ``path: stored -> requested`` changes outside :data:`RESUME_FREE_FIELDS`."""
  return [c for c in diff(saved, requested) if not _within(_path(c), RESUME_FREE_FIELDS)]


def free_changes(saved: dict, requested: dict) -> list[str]:
  """The changes inside :data:`RESUME_FREE_FIELDS` (reported on resume)."""
  return [c for c in diff(saved, requested) if _within(_path(c), RESUME_FREE_FIELDS)]


def checkpoint_steps(workdir: str) -> list[int]:
  """Steps of the complete checkpoints in ``workdir``, ascending (orbax's temporaries excluded)."""
  root = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(root):
    return []
  return sorted(int(n) for n in os.listdir(root) if n.isdigit()
                and os.path.isdir(os.path.join(root, n)))


@dataclasses.dataclass(frozen=True)
class ResumePlan:
  """What :func:`check_workdir` found.

  Attributes:
    step: the newest checkpoint step (None: a new run).
    steps: every complete checkpoint step, ascending.
    changes: the resume-free changes, ``path: stored -> requested``.
    extend_from: the stored ``train.steps`` when the run is extended, else None.
    finished: the newest checkpoint is at the stored final step and nothing
      is to be trained (no extension).
    saved: the stored config dict (None: no config.json).
  """

  step: Optional[int]
  steps: tuple = ()
  changes: tuple = ()
  extend_from: Optional[int] = None
  finished: bool = False
  saved: Optional[dict] = None


def _stored_steps(saved: dict) -> Optional[int]:
  return saved.get("train", {}).get("steps")


def check_writable(path: str, what: str) -> None:
  """WorkdirError unless ``path`` is, or can be created as, a writable directory (tried:
  :mod:`moejax.train.writable`); the fix names a path that can be written."""
  problem = writable.problem(path)
  if problem:
    example = writable.writable_example(path)
    raise WorkdirError(f"{what}={path} cannot be created or written: {problem}. Fix: pass a "
                       "path in a writable directory"
                       + (f", e.g. {what}={example}" if example else ""))


def check_workdir(workdir: str, cfg: ExperimentConfig, extend: bool = False) -> ResumePlan:
  """The :class:`ResumePlan` of running ``cfg`` in ``workdir``; reads only.

  Raises WorkdirError (see the module docstring) when ``cfg`` would
  misdescribe the run already there.
  """
  check_writable(workdir, "--workdir")
  path = os.path.join(workdir, CONFIG_FILE)
  steps = checkpoint_steps(workdir)
  if not os.path.exists(path):
    if steps:
      raise WorkdirError(
          f"{workdir} holds checkpoints (steps {steps}) but no {CONFIG_FILE}, so it cannot be "
          "checked against this config. Fix: use a new --workdir, or restore the "
          f"{CONFIG_FILE} of that run")
    return ResumePlan(step=None)
  try:
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise WorkdirError(f"{path} cannot be read ({type(e).__name__}: {e}). Fix: restore it, "
                       "or use a new --workdir") from e
  new = json.loads(experiment_to_json(cfg))
  saved = with_defaults(saved, new)
  if not steps:
    # Stopped before its first checkpoint: nothing it trained survives, so any
    # config may start over here (its metric rows are dropped).
    return ResumePlan(step=None, saved=saved, changes=tuple(diff(saved, new)))
  fatal = identity_changes(saved, new)
  stored, requested = _stored_steps(saved), cfg.train.steps
  extend_from = None
  if any(_path(c) == STEPS_FIELD for c in fatal) and isinstance(stored, int):
    if not extend:
      raise WorkdirError(
          f"{workdir} holds a run of {STEPS_FIELD}={stored} (checkpoint at step {steps[-1]}); "
          f"{STEPS_FIELD}={requested} would relabel its results. Fix: pass --extend to train "
          f"it on to step {requested} (recorded in {HISTORY_FILE}), or use a new --workdir"
          if requested > stored else
          f"{workdir} holds a run of {STEPS_FIELD}={stored} (checkpoint at step {steps[-1]}); "
          f"{STEPS_FIELD}={requested} would relabel its results. Fix: use a new --workdir for a "
          f"shorter run (a run's steps can only grow, with --extend)")
    if requested < stored:
      raise WorkdirError(
          f"{workdir}: --extend cannot shorten a run ({STEPS_FIELD} stored {stored}, requested "
          f"{requested}). Fix: use a new --workdir for a shorter run")
    extend_from = stored
    fatal = [c for c in fatal if _path(c) != STEPS_FIELD]
  if fatal:
    lines = []
    for c in fatal:
      where, _, values = c.partition(": ")
      old, _, wanted = values.partition(" -> ")
      lines.append(f"{where}: stored {old}, requested {wanted}")
    raise WorkdirError(
        f"{workdir} holds a run that this config would misdescribe (its results stay as they "
        f"are):\n  " + "\n  ".join(lines)
        + f"\nFix: use a new --workdir for the changed config, or run with the stored values "
        f"({path}); nothing was changed in {workdir}")
  return ResumePlan(step=steps[-1], steps=tuple(steps), changes=tuple(free_changes(saved, new)),
                    extend_from=extend_from, finished=steps[-1] >= requested, saved=saved)


def write_config(workdir: str, cfg: ExperimentConfig) -> None:
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, CONFIG_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(experiment_to_json(cfg) + "\n")
  os.replace(tmp, path)
  plugins_lib.write_record(workdir, to_dict(cfg))  # a plugin router's module, when one is used


def append_history(workdir: str, event: str, **fields) -> None:
  """One line of ``WORKDIR/history.jsonl``: the event, when, where, and ``fields``."""
  row = {"event": event, "time": datetime.datetime.now().isoformat(timespec="seconds"),
         "host": socket.gethostname(), "pid": os.getpid(), **fields}
  with open(os.path.join(workdir, HISTORY_FILE), "a", encoding="utf-8") as f:
    f.write(json.dumps(row) + "\n")


def read_history(workdir: str) -> list[dict]:
  path = os.path.join(workdir, HISTORY_FILE)
  if not os.path.exists(path):
    return []
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except ValueError:
        continue  # a torn last line
  return out


def _shapes(tree: Any) -> dict[str, tuple]:
  """{'params/blocks/0/...': shape} (:func:`moejax.train.integrity.leaf_paths`' names)."""
  return {path: tuple(getattr(v, "shape", ())) for path, v in integrity.leaf_paths(tree)}


def _placed(abstract_state: Any) -> Any:
  """``abstract_state`` with a single-device sharding on every leaf that has none."""
  here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

  def place(leaf):
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=here)
    return leaf
  return jax.tree.map(place, abstract_state)


class Checkpointer:
  """Orbax CheckpointManager over ``WORKDIR/checkpoints``: a TrainState plus the data state.

  Each save's checksums (:mod:`moejax.train.integrity`) are computed from the
  state handed to orbax, held until orbax has committed the step, and then
  written into its directory by process 0 (at the next save, ``poll`` or
  ``wait``, never while orbax's save or pruning thread runs). ``resumed``:
  the checkpoint this run started from (the NaN guard's message reads it).
  """

  def __init__(self, workdir: str, keep: int, read_only: bool = False,
               resumed: Optional["Restored"] = None):
    self.resumed = resumed
    self.grafted: set[str] = set()  # idea-state paths the last restore added (idea_restore)
    self.joined: dict = {}  # w_gate_up paths the last restore joined (layout_restore)
    self._pending: dict[int, dict] = {}  # step -> checksum record, until orbax commits it
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                           read_only=read_only,
                                           cleanup_tmp_directories=not read_only)
    # Handlers named up front so that metadata can be read before any restore.
    handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}
    self.manager = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR)),
                                         options=options, item_handlers=handlers)
    start_draining()  # orbax's save and restore loops, until close (moejax.train.event_loops)
    self._draining = True

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def check_shapes(self, step: int, abstract_state: Any) -> None:
    """WorkdirError when the checkpoint's arrays do not have the abstract state's shapes."""
    with draining_event_loops():  # damaged metadata: its reads end here too
      meta = self.manager.item_metadata(step)["state"]
    want, have = _shapes(abstract_state), _shapes(meta)
    new_ideas = idea_restore.absent(want, have)  # restored from their initial values
    joined = layout_restore.converted_paths(layout_restore.legacy_pairs(want, have))
    bad = sorted((k for k in set(want) | set(have)
                  if want.get(k) != have.get(k) and k not in new_ideas | joined),
                 key=lambda k: (not k.startswith("params"), k))  # params first: the clearest
    if bad:
      lines = [f"{k}: checkpoint {have.get(k, '<absent>')} vs model {want.get(k, '<absent>')}"
               for k in bad[:10]]
      raise WorkdirError(
          f"checkpoint {step} in {self.manager.directory} does not fit this model "
          f"({len(bad)} mismatched arrays):\n  " + "\n  ".join(lines)
          + "\nFix: use a new --workdir, or the config the checkpoint was written with")

  def step_dir(self, step: int) -> str:
    return os.path.join(str(self.manager.directory), str(step))

  def save(self, step: int, state: Any, data_state: dict) -> None:
    self.wait()  # orbax's save waits for the previous one too; then its checksums are written
    content = integrity.record(state, data_state) if jax.process_index() == 0 else None
    if self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                       data=ocp.args.JsonSave(data_state))):
      if content is not None:
        self._pending[step] = content

  def poll(self) -> None:
    """Writes the checksums of the saves orbax has committed since; never waits."""
    if self._pending and not self.manager.is_saving_in_progress():
      self._flush()

  def _flush(self) -> None:
    for step, content in sorted(self._pending.items()):
      if os.path.isdir(self.step_dir(step)):  # else pruned by max_to_keep already
        integrity.write(self.step_dir(step), content)
    self._pending = {}

  def restore(self, step: int, abstract_state: Any, fill=None) -> tuple[Any, dict]:
    """(state tree, data state) at ``step``, placed by ``abstract_state``'s shardings.

    A leaf without a sharding goes to this process's first device: orbax
    refuses to guess one for a checkpoint written on other devices (another
    process count or mesh), and the leaf's saved sharding names devices that
    may not exist here. Idea state the checkpoint predates comes from ``fill``
    (:func:`moejax.train.idea_restore.initial`); separate expert 'w_gate' /
    'w_up' arrays are joined (:mod:`moejax.train.layout_restore`).
    """
    with draining_event_loops():  # a damaged checkpoint's reads end here (moejax.train.event_loops)
      want, have = _shapes(abstract_state), _shapes(self.manager.item_metadata(step)["state"])
      new_ideas, joined = idea_restore.absent(want, have), layout_restore.legacy_pairs(want, have)
      target = layout_restore.legacy_target(idea_restore.without(abstract_state, new_ideas),
                                            joined)
      out = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(_placed(target)), data=ocp.args.JsonRestore()))
    state = layout_restore.join(out["state"], abstract_state, joined, f"checkpoint {step}",
                                once=self.step_dir(step))
    state = idea_restore.graft(state, abstract_state, new_ideas, fill, f"checkpoint {step}",
                               once=self.step_dir(step))
    self.grafted, self.joined = new_ideas, joined  # what its checksums do not describe as is
    return state, dict(out["data"])

  def as_saved(self, tree: Any) -> Any:
    """The last restored ``tree`` as the checkpoint stores it (what its checksums describe)."""
    return layout_restore.as_saved(idea_restore.without(tree, self.grafted), self.joined)

  def wait(self) -> None:
    self.manager.wait_until_finished()
    self._flush()

  def close(self) -> None:
    try:
      if self._pending:
        self.wait()
      self.manager.close()
    finally:
      if self._draining:
        self._draining = False
        stop_draining()

  # A context manager, so that a one-off reader (a test, a tool) cannot leave orbax's
  # manager and its threads open until interpreter exit.
  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


@dataclasses.dataclass(frozen=True)
class Restored:
  """A restored checkpoint: its step, the state tree, the data state, and what was skipped.

  ``skipped``: ``(step, why)`` of the newer checkpoints that could not be used
  (damaged files, non-finite values, checksum mismatches), newest first.
  ``verified``: its arrays and data state matched its checksums;
  ``integrity``: the one line saying so (:class:`moejax.train.integrity.Verdict`).
  """

  step: int
  tree: Any
  data_state: dict
  skipped: tuple = ()
  verified: bool = False
  integrity: str = ""


def restore_latest(workdir: str, steps, abstract_state: Any,
                   cfg: Optional[ExperimentConfig] = None) -> Restored:
  """The newest of ``steps`` that restores, is finite and matches its checksums; reads only.

  A checkpoint whose metadata or arrays cannot be read (a truncated file,
  a disk error), whose values are not finite, or whose arrays or data state
  differ from its ``checksums.json`` is skipped, newest first (one without
  the file is accepted, unverified: :mod:`moejax.train.integrity`);
  the caller moves the skipped ones aside (:func:`move_aside`) before it
  writes. Idea state a checkpoint predates starts from ``cfg``'s initial
  values (:mod:`moejax.train.idea_restore`). Raises WorkdirError
  when the checkpoint arrays have other shapes
  than the model (another model), or when no checkpoint can be used.
  """
  from moejax.train import guard  # pylint: disable=g-import-not-at-top
  ckpt = Checkpointer(workdir, max(len(steps), 1), read_only=True)
  fill = idea_restore.initial(cfg) if cfg is not None else None
  skipped = []
  try:
    for step in sorted(steps, reverse=True):
      try:
        ckpt.check_shapes(step, abstract_state)
      except WorkdirError:
        raise
      except Exception as e:  # orbax / JSON / tensorstore: all mean "damaged"
        skipped.append((step, f"damaged, {damage.metadata_error(e)}"))
        continue
      data_problem = damage.data_state_problem(ckpt.step_dir(step))
      if data_problem:  # named as what it is, before orbax reads it as one of the items
        skipped.append((step, f"damaged, {data_problem}"))
        continue
      try:
        tree, data_state = ckpt.restore(step, abstract_state, fill)
      except Exception as e:
        skipped.append((step, f"damaged, {damage.restore_error(e)}"))
        continue
      bad = guard.nonfinite_leaves(tree)
      if bad:
        skipped.append((step, f"not finite ({guard.describe(bad)})"))
        continue
      verdict = integrity.verify_step(ckpt.step_dir(step), ckpt.as_saved(tree), data_state)
      if verdict.mismatches:
        skipped.append((step, verdict.note))
        continue
      return Restored(step, tree, data_state, tuple(skipped), verdict.verified, verdict.note)
  finally:
    ckpt.close()
  lines = "\n  ".join(f"step {s}: {why}" for s, why in skipped)
  raise WorkdirError(
      f"no checkpoint in {os.path.join(workdir, CHECKPOINT_DIR)} can be resumed:\n  {lines}\n"
      f"Fix: use a new --workdir (or delete {os.path.join(workdir, CHECKPOINT_DIR)} to "
      "train this run again from step 0)")


def move_aside(workdir: str, steps) -> list[str]:
  """Moves ``checkpoints/<step>`` to ``damaged_checkpoints/<step>``; returns the new paths.

  Out of orbax's directory, so that the resumed run can write those steps again.
  """
  out = []
  for step in steps:
    src = os.path.join(workdir, CHECKPOINT_DIR, str(step))
    if not os.path.isdir(src):
      continue
    dst = os.path.join(workdir, DAMAGED_DIR, str(step))
    n = 1
    while os.path.exists(dst):
      dst = os.path.join(workdir, DAMAGED_DIR, f"{step}.{n}")
      n += 1
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.replace(src, dst)
    out.append(dst)
  return out
