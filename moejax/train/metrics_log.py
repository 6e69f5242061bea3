"""Metrics out of a run: a JSONL file for notebooks, TensorBoard events, a progress line.

``WORKDIR/metrics.jsonl`` has one JSON object per line:
``{"step": 100, "split": "train", "loss": ..., ...}`` (``split`` is
``train`` or ``eval``). TensorBoard events (written with tensorboardX, which
needs no TensorFlow) go to ``WORKDIR/tensorboard`` as ``<split>/<name>``
scalars (a string value, such as the MFU row's ``peak_source``, goes to the
JSONL only) and histograms (:meth:`MetricsWriter.histograms`):
``tensorboard --logdir WORKDIR/tensorboard``. The events are
written in the calling thread (:class:`_Events`), not by tensorboardX's
writer thread: when that thread dies on a full disk, the next scalars wait
forever on its queue; here a failed write raises ``OSError`` naming the
file, in the loop, which stops with one error (moejax.train.write_failure).

On resume from a checkpoint at step s, rows after s are dropped from the
JSONL (the resumed run writes them again, identically), so the file of a
killed-and-resumed run reads like that of an uninterrupted one. A torn last
line from a killed process is dropped too. (A train row averages the steps
since the previous row; the steps between that row and a checkpoint are
saved with the checkpoint, so the first row after a resume averages the same
steps as an uninterrupted run's.)

:func:`final_values` reads a finished run's headline numbers back from the
file (a run resumed at its final step trains nothing, and reports these).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Mapping, NamedTuple, Optional, Sequence, TextIO

import numpy as np

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def read_metrics(workdir: str, split: Optional[str] = None) -> list[dict]:
  """The rows of ``WORKDIR/metrics.jsonl`` (of one split if given); torn lines skipped."""
  path = os.path.join(workdir, METRICS_FILE)
  rows = []
  if not os.path.exists(path):
    return rows
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if split is None or row.get("split") == split:
        rows.append(row)
  return rows


def _jsonable(v):
  if isinstance(v, str):
    return v  # a label (the MFU row's peak_source), written as is, not a TensorBoard scalar
  v = float(v)
  return v if math.isfinite(v) else str(v)  # JSON has no NaN; keep it readable


class MetricsWriter:
  """Appends metrics to the JSONL file and TensorBoard.

  ``enabled=False`` writes nothing (the processes other than 0 of a
  multi-process run: one writer per workdir, or their rewrites and appends
  would interleave).
  """

  def __init__(self, workdir: str, resume_step: int = 0, enabled: bool = True,
               sinks: Sequence[Any] = ()):
    self.workdir = workdir
    self._file, self._tb = None, None
    # More writers of the TensorBoard records (add_scalars / add_histograms / close):
    # the optional W&B run of moejax.train.wandb_sink.
    self._sinks = list(sinks) if enabled else []
    if not enabled:
      return
    path = os.path.join(workdir, METRICS_FILE)
    if os.path.exists(path):
      keep = [r for r in read_metrics(workdir) if r.get("step", 0) <= resume_step]
      tmp = path + ".tmp"
      with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
      os.replace(tmp, path)  # atomic: a kill here leaves the old or the new file
    self._file = open(path, "a", encoding="utf-8")
    self._tb = None
    try:
      self._tb = _Events(os.path.join(workdir, TENSORBOARD_DIR),
                         purge_step=resume_step + 1 if resume_step else None)
    except ImportError:
      print("tensorboardX is not installed: metrics go to metrics.jsonl only "
            "(pip install tensorboardX)", file=sys.stderr)

  @classmethod
  def for_run(cls, cfg, workdir: str, resume_step: int, enabled: bool) -> "MetricsWriter":
    """The writer of a run of ``cfg`` (an ExperimentConfig): with its W&B copy when
    ``train.wandb_project`` names one (process 0 only, as every file here)."""
    from moejax.config.core import to_dict  # pylint: disable=g-import-not-at-top
    from moejax.train import wandb_sink  # pylint: disable=g-import-not-at-top
    sink = wandb_sink.sink_for(cfg.train, workdir, to_dict(cfg)) if enabled else None
    return cls(workdir, resume_step, enabled, sinks=[sink] if sink else [])

  def write(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
    if self._file is None:
      return
    row = {"step": int(step), "split": split, **{k: _jsonable(v) for k, v in metrics.items()}}
    try:
      self._file.write(json.dumps(row) + "\n")
      self._file.flush()
    except OSError as e:
      raise OSError(e.errno, e.strerror, self._file.name) from e
    scalars = {f"{split}/{k}": float(v) for k, v in metrics.items() if not isinstance(v, str)}
    for sink in self._writers():
      sink.add_scalars(int(step), scalars)

  def _writers(self) -> list:
    return ([self._tb] if self._tb is not None else []) + self._sinks

  def histograms(self, step: int, split: str, values: Mapping[str, Sequence[float]]) -> None:
    """TensorBoard histograms ``<split>/<name>`` (the per-layer expert loads); JSONL: none."""
    arrays = {f"{split}/{k}": np.asarray(v, np.float64) for k, v in values.items()}
    for sink in self._writers():
      sink.add_histograms(int(step), arrays)

  def close(self) -> None:
    for f in (self._file, self._tb, *self._sinks):
      try:
        if f is not None:
          f.close()
      except OSError:
        pass  # the write that failed was reported; the rest of the buffer is lost
    self._file = self._tb = None
    self._sinks = []


class _Events:
  """A TensorBoard event file written synchronously (see the module docstring).

  The records tensorboardX's SummaryWriter writes (its file name, the purge
  marker of a resumed run), without its writer thread.
  """

  def __init__(self, logdir: str, purge_step: Optional[int] = None):
    # pylint: disable=g-import-not-at-top
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto.event_pb2 import Event, SessionLog
    from tensorboardX.summary import histogram, scalar
    self._event, self._scalar, self._histogram = Event, scalar, histogram
    os.makedirs(logdir, exist_ok=True)
    self.name = os.path.join(logdir, "events")
    self._writer = EventsWriter(self.name)
    self.name = self._writer._file_name  # pylint: disable=protected-access
    if purge_step is not None:  # TensorBoard hides the old events from this step on
      self._writer.write_event(Event(step=purge_step, file_version="brain.Event:2"))
      self._writer.write_event(Event(step=purge_step,
                                     session_log=SessionLog(status=SessionLog.START)))
    self._flush()

  def add_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    for tag, value in scalars.items():
      self._writer.write_event(self._event(wall_time=time.time(), step=step,
                                           summary=self._scalar(tag, value)))
    self._flush()

  def add_histograms(self, step: int, values: Mapping[str, np.ndarray]) -> None:
    for tag, value in values.items():
      self._writer.write_event(self._event(wall_time=time.time(), step=step,
                                           summary=self._histogram(tag, value, "auto")))
    self._flush()

  def _flush(self) -> None:
    try:
      self._writer.flush()
    except OSError as e:
      raise OSError(e.errno, e.strerror, self.name) from e

  def close(self) -> None:
    self._writer.close()


def format_duration(seconds: float) -> str:
  seconds = max(0, int(round(seconds)))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def final_values(workdir: str) -> dict:
  """The last train and eval rows' headline numbers of ``WORKDIR/metrics.jsonl``.

  ``{"step", "train_loss", "val_loss", "unigram_baseline", "max_vio_global"}``,
  each present only when logged.
  """
  out: dict = {}
  train, evals = read_metrics(workdir, "train"), read_metrics(workdir, "eval")
  if train:
    out["step"], out["train_loss"] = train[-1]["step"], train[-1].get("loss")
  if evals:
    last = evals[-1]
    out["step"] = max(out.get("step", 0), last["step"])
    for key, name in (("loss", "val_loss"), ("unigram_baseline", "unigram_baseline"),
                      ("max_vio_global", "max_vio_global")):
      if key in last:
        out[name] = last[key]
  return out


class SuiteEta(NamedTuple):
  """What a suite has left after the run that is training (for :class:`Progress`)."""
  then_steps: int = 0                   # training steps of the later runs
  # The finished runs' mean time outside their training steps (measured) times the runs
  # it is still due for (this one and each later one); None: estimate it from this run.
  then_seconds: Optional[float] = None
  then_runs: int = 0                    # how many runs come after this one
  after_passes: int = 0                 # routing-analysis passes per run after training
  after_batches: Optional[int] = None   # batches per pass; None: the whole split


# A forward pass's share of a training step (forward + backward: 3x the forward FLOPs, as
# moejax.train.mfu counts them): an evaluation batch's time before one has been measured.
FORWARD_SHARE = 1.0 / 3.0


class Progress:
  """One line per log step: ``step 120/1000 (12%) | 9.8k tok/s | loss 2.345 | ETA 3m12s``.

  The ETA is what is left of this run: the remaining steps at the mean step
  time of this process (the first step, which compiles, excluded, and the
  first logged window too once a later one is timed; ``ETA --`` until a
  step after the first has been timed), the remaining periodic evaluations
  and the final whole-split evaluation (:meth:`plan_evals`) at the time per
  batch of the periodic evaluations after the first (which compiles the
  evaluation step: its time counts as start-up, not as a rate), or before
  one has been measured at :data:`FORWARD_SHARE` of a step. A line at 100%
  has no ETA. Inside a suite (``in_suite``) the line also shows ``suite
  ETA``: this run's ETA plus, never negative, the later runs' ``then_steps``
  at this step time and the time outside the training steps of this run's
  remainder and of each later run (``then_seconds``, measured on the suite's
  finished runs; before one has finished, estimated from this run: its
  start-up and compilations, its evaluations and the forward passes of each
  run's routing analysis, ``after_passes`` of ``after_batches``), so it is
  never below the run's ETA. The parts are counted because on 2 CPU cores
  the evaluation and analysis of a quick-suite run take as long as its
  training.
  """

  def __init__(self, total_steps: int, out: TextIO = sys.stdout, enabled: bool = True,
               then_steps: int = 0, then_seconds: Optional[float] = None,
               in_suite: bool = False, then_runs: int = 0, after_passes: int = 0,
               after_batches: Optional[int] = None, clock=time.perf_counter):
    self.total, self.out, self.enabled = total_steps, out, enabled
    self.train_seconds, self.steps_timed = 0.0, 0
    self.first_window: tuple = ()  # (seconds, steps) of the first timed window
    self.then_steps, self.then_seconds = then_steps, then_seconds
    self.in_suite = in_suite
    self.then_runs, self.after_passes, self.pass_batches = then_runs, after_passes, after_batches
    self.eval_seconds, self.eval_batches_done = 0.0, 0    # the evaluations after the first
    self.eval_compile_seconds = 0.0                      # the first (compiles its step)
    self.evals_seen = 0
    self.evals_left, self.evals_total, self.eval_batches, self.final_batches = 0, 0, 0, 0
    self.final_left = False
    self.clock = clock
    self.started, self.setup_seconds = clock(), 0.0

  def add_time(self, seconds: float, steps: int) -> None:
    self.train_seconds += seconds
    self.steps_timed += steps
    if not self.first_window:
      self.first_window = (seconds, steps)

  def first_step_done(self) -> None:
    """Marks the end of start-up and compilation (the first step)."""
    self.setup_seconds = self.clock() - self.started

  def plan_evals(self, evals_left: int, eval_batches: int, final_batches: int) -> None:
    """``evals_left`` periodic evaluations of ``eval_batches`` batches each, then one
    final evaluation of ``final_batches`` (the whole split)."""
    self.evals_left, self.evals_total = evals_left, evals_left
    self.eval_batches, self.final_batches, self.final_left = eval_batches, final_batches, True

  def add_eval(self, seconds: float, batches: int, final: bool = False) -> None:
    if final:
      self.final_left = False
      return
    self.evals_left = max(self.evals_left - 1, 0)
    self.evals_seen += 1
    if self.evals_seen == 1:
      self.eval_compile_seconds += seconds
      return
    self.eval_seconds += seconds
    self.eval_batches_done += batches

  def _per_step(self) -> float:
    """Seconds per step: the timed windows after the first once there are any (the steps
    right after compilation run slower, warming caches and touching fresh buffers, and an
    ETA from them converged slowly), else the first."""
    seconds, steps = self.train_seconds, self.steps_timed
    if self.first_window and steps > self.first_window[1]:
      seconds, steps = seconds - self.first_window[0], steps - self.first_window[1]
    return seconds / max(steps, 1)

  def _per_batch(self) -> float:
    if self.eval_batches_done:
      return self.eval_seconds / self.eval_batches_done
    return self._per_step() * FORWARD_SHARE

  def _evals_left_seconds(self) -> float:
    batches = self.evals_left * self.eval_batches + self.final_batches * self.final_left
    return self._per_batch() * batches

  def eta(self, step: int) -> float:
    return self._per_step() * max(self.total - step, 0) + self._evals_left_seconds()

  def suite_eta(self, step: int) -> float:
    return self.eta(step) + self._per_step() * self.then_steps + self._suite_overhead()

  def _suite_overhead(self) -> float:
    """The suite's time after this run's ETA outside training steps (never negative)."""
    per_batch = self._per_batch()
    if self.then_seconds is not None:
      # Measured on finished runs: what this run has not spent of a run's overhead yet
      # (beyond the evaluations its ETA holds), and all of it for each later run.
      per_run = self.then_seconds / (self.then_runs + 1)
      spent = self.setup_seconds + self.eval_compile_seconds + self.eval_seconds
      return (max(per_run - spent - self._evals_left_seconds(), 0.0)
              + self.then_runs * per_run)
    after = self.after_passes * (self.final_batches if self.pass_batches is None
                                 else min(self.pass_batches, self.final_batches))
    later_run = self.setup_seconds + self.eval_compile_seconds + per_batch * (
        self.evals_total * self.eval_batches + self.final_batches + after)
    return per_batch * after + self.then_runs * later_run

  def line(self, step: int, tokens_per_s: float, loss: float, extra: str = "") -> str:
    pct = 100 * step // self.total  # floored: "100%" only on the last step
    text = (f"step {step}/{self.total} ({pct}%) | {tokens_per_s / 1e3:.1f}k tok/s | "
            f"loss {loss:.4f}{extra}")
    done = step >= self.total
    if not done:
      text += f" | ETA {self._show(self.eta(step))}"
    if self.in_suite and (not done or self.then_runs):
      text += f" | suite ETA {self._show(self.suite_eta(step))}"
    if self.enabled:
      print(text, file=self.out, flush=True)
    return text

  def _show(self, seconds: float) -> str:
    """``--`` until a step after the compiling one has been timed (no rate yet)."""
    return format_duration(seconds) if self.steps_timed else "--"
