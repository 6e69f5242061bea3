"""Metrics out of a run: a JSONL file for notebooks, TensorBoard events, a progress line.

``WORKDIR/metrics.jsonl`` has one JSON object per line:
``{"step": 100, "split": "train", "loss": ..., ...}`` (``split`` is
``train`` or ``eval``). TensorBoard events (written with tensorboardX, which
needs no TensorFlow) go to ``WORKDIR/tensorboard`` as ``<split>/<name>``
scalars: ``tensorboard --logdir WORKDIR/tensorboard``.

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
from typing import Mapping, Optional, TextIO

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
  v = float(v)
  return v if math.isfinite(v) else str(v)  # JSON has no NaN; keep it readable


class MetricsWriter:
  """Appends metrics to the JSONL file and TensorBoard.

  ``enabled=False`` writes nothing (the processes other than 0 of a
  multi-process run: one writer per workdir, or their rewrites and appends
  would interleave).
  """

  def __init__(self, workdir: str, resume_step: int = 0, enabled: bool = True):
    self.workdir = workdir
    self._file, self._tb = None, None
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
      import tensorboardX  # pylint: disable=g-import-not-at-top
      self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, TENSORBOARD_DIR),
                                            purge_step=resume_step + 1 if resume_step else None)
    except ImportError:
      print("tensorboardX is not installed: metrics go to metrics.jsonl only "
            "(pip install tensorboardX)", file=sys.stderr)

  def write(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
    if self._file is None:
      return
    row = {"step": int(step), "split": split, **{k: _jsonable(v) for k, v in metrics.items()}}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in metrics.items():
        self._tb.add_scalar(f"{split}/{k}", float(v), int(step))

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()


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


class Progress:
  """One line per log step: ``step 120/1000 (12%) | 9.8k tok/s | loss 2.345 | ETA 3m12s``.

  The ETA is the remaining steps at the mean step time of this process
  (compilation and evaluation excluded). Inside a suite, ``then_steps`` /
  ``then_seconds`` are the steps of the runs still to train after this one
  and the suite's other time per remaining run (analysis), so the line also
  shows ``suite ETA``.
  """

  def __init__(self, total_steps: int, out: TextIO = sys.stdout, enabled: bool = True,
               then_steps: int = 0, then_seconds: Optional[float] = None):
    self.total, self.out, self.enabled = total_steps, out, enabled
    self.train_seconds, self.steps_timed = 0.0, 0
    self.then_steps, self.then_seconds = then_steps, then_seconds

  def add_time(self, seconds: float, steps: int) -> None:
    self.train_seconds += seconds
    self.steps_timed += steps

  def eta(self, step: int) -> float:
    per_step = self.train_seconds / max(self.steps_timed, 1)
    return per_step * (self.total - step)

  def suite_eta(self, step: int) -> float:
    per_step = self.train_seconds / max(self.steps_timed, 1)
    return self.eta(step) + per_step * self.then_steps + (self.then_seconds or 0.0)

  def line(self, step: int, tokens_per_s: float, loss: float, extra: str = "") -> str:
    pct = 100.0 * step / self.total
    text = (f"step {step}/{self.total} ({pct:.0f}%) | {tokens_per_s / 1e3:.1f}k tok/s | "
            f"loss {loss:.4f}{extra} | ETA {format_duration(self.eta(step))}")
    if self.then_seconds is not None:
      text += f" | suite ETA {format_duration(self.suite_eta(step))}"
    if self.enabled:
      print(text, file=self.out, flush=True)
    return text
