"""Plots of a suite summary: dot plots with intervals, differences to the baseline, curves.

Legend: n seeds of an arm.

Design rules (so that a picture does not overstate a result):

- no bar charts: a bar whose axis starts above zero makes a 0.01-nat
  difference look large. Values are dots with their 95% interval over seeds
  (and the single seeds as small hollow circles), on an axis that spans
  the data;
- a metric no arm has is left out (no empty or "n/a" panels);
- every axis says what it measures and in what unit;
- curves show the mean over seeds with the band between the lowest and the
  highest seed; the final point of the validation curve is the whole split
  (earlier points are the trainer's fixed ``train.eval_batches`` subset), so
  it is drawn as its own marker;
- PNG at 150 dpi.

Figures are built with matplotlib's object API on an Agg canvas, never
pyplot, so a notebook's backend stays as it is.
"""

from __future__ import annotations

import math
import os
from typing import Mapping, Optional, Sequence

import numpy as np

from moejax.ablation.columns import (ARM_COLUMNS, METRICS, VERDICT_METRICS, present,
                                     skip_constant_zero)
from moejax.train import metrics_log

DPI = 150


def _figure(size):
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=size, layout="constrained")
  FigureCanvasAgg(fig)
  return fig


def _ticks(ax, integer_x: bool = False):
  from matplotlib.ticker import MaxNLocator  # pylint: disable=g-import-not-at-top
  ax.xaxis.set_major_locator(MaxNLocator(5, integer=integer_x))


def _axis_label(key: str) -> str:
  title, unit, _ = METRICS[key]
  return f"{title} ({unit})"


def _grid(n: int, ncol: int, size=(4.2, 2.9)):
  ncol = min(ncol, n)
  nrow = math.ceil(n / ncol)
  fig = _figure((size[0] * ncol, size[1] * nrow))
  axes = fig.subplots(nrow, ncol, squeeze=False).flat
  for ax in list(axes)[n:]:
    ax.remove()
  return fig, list(fig.axes)


def plot_metrics(summary: Mapping, path: Optional[str] = None):
  """One dot plot per metric the arms have: mean, 95% interval over seeds, each seed."""
  keys = skip_constant_zero(summary, present(summary, ARM_COLUMNS))
  names = list(summary["arms"])
  if not keys:
    return None
  fig, axes = _grid(len(keys), 3, (4.2, 0.45 * len(names) + 1.4))
  base = summary.get("baseline")
  for ax, key in zip(axes, keys):
    for i, name in enumerate(names):
      y = len(names) - 1 - i
      m = summary["arms"][name]["metrics"].get(key)
      if m is None:
        continue
      iv = m["interval"]
      vals = list(m["values"].values())
      ax.plot(vals, [y] * len(vals), "o", mfc="none", color="0.55", ms=4)
      if iv["lo"] is not None:
        ax.plot([iv["lo"], iv["hi"]], [y, y], "-", color=f"C{i}", lw=2)
      ax.plot([iv["mean"]], [y], "o", color=f"C{i}", ms=6)
      if name == base:
        ax.axvline(iv["mean"], color="0.6", ls=":", lw=1)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([n + (" (baseline)" if n == base else "") for n in reversed(names)],
                       fontsize=8)
    ax.set_xlabel(_axis_label(key), fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.margins(x=0.15)
    ax.set_ylim(-0.6, len(names) - 0.4)
    _ticks(ax)
    ax.grid(axis="x", alpha=0.3)
  fig.suptitle(f"{summary.get('suite', '')}: mean (dot), 95% interval over seeds (line), "
               "single seeds (circles)", fontsize=9)
  if path:
    fig.savefig(path, dpi=DPI)
  return fig


def plot_differences(summary: Mapping, path: Optional[str] = None):
  """Arm - baseline per verdict metric: interval over seeds (thick), over documents (thin)."""
  comps = summary.get("comparisons") or {}
  keys = [k for k in VERDICT_METRICS if any(k in c for c in comps.values())]
  if not keys:
    return None
  names = list(comps)
  fig, axes = _grid(len(keys), 3, (4.2, 0.5 * len(names) + 1.4))
  for ax, key in zip(axes, keys):
    ax.axvline(0.0, color="0.3", lw=1)
    for i, name in enumerate(names):
      e = comps[name].get(key)
      if e is None:
        continue
      y = len(names) - 1 - i
      d = e["diff"]
      if d["lo"] is not None:
        ax.plot([d["lo"], d["hi"]], [y, y], "-", color="C0", lw=3, alpha=0.8,
                label="95% over seeds" if i == 0 else None)
      doc = e.get("documents")
      if doc and doc.get("lo") is not None:
        ax.plot([doc["lo"], doc["hi"]], [y - 0.18] * 2, "-", color="C1", lw=1.5,
                label="95% over documents" if i == 0 else None)
      ax.plot([d["mean"]], [y], "o", color="k", ms=5)
      ax.annotate(e["verdict"], (1.0, y), xycoords=("axes fraction", "data"),
                  xytext=(4, 0), textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(list(reversed(names)), fontsize=8)
    ax.set_xlabel(f"{chr(916)} {_axis_label(key)}", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.margins(x=0.15)
    ax.set_ylim(-0.6, len(names) - 0.4)
    _ticks(ax)
    if key == "val_loss":
      ax.legend(fontsize=7, loc="best")
  fig.suptitle(f"{summary.get('suite', '')}: arm - {summary['baseline']} (baseline); "
               "verdict at the right", fontsize=9)
  if path:
    fig.savefig(path, dpi=DPI)
  return fig


def _curve(runs: Sequence[dict], split: str, key: str):
  """(steps, mean, lo, hi) over the runs' rows of ``split`` at the steps all runs have."""
  series = []
  for r in runs:
    rows = metrics_log.read_metrics(r["_path"], split)
    series.append({row["step"]: row[key] for row in rows
                   if isinstance(row.get(key), (int, float))})
  common = sorted(set.intersection(*(set(s) for s in series))) if series else []
  if not common:
    return None
  v = np.array([[s[t] for t in common] for s in series], np.float64)   # [n, steps]
  return np.asarray(common), v.mean(0), v.min(0), v.max(0)


_CURVES = (("eval", "loss", "validation loss", "nats/token"),
           ("train", "loss", "training loss", "nats/token"),
           ("train", "max_vio_batch", "MaxVio batch", "max/mean load - 1"),
           ("eval", "max_vio_global", "MaxVio global", "max/mean load - 1"))


def plot_curves(summary: Mapping, results: Sequence[dict], path: Optional[str] = None):
  """Curves over training steps per arm: mean over seeds, min-max band (see module doc)."""
  by_arm: dict[str, list[dict]] = {}
  for r in results:
    by_arm.setdefault(r["arm"], []).append(r)
  names = [n for n in summary["arms"] if n in by_arm]
  panels = []
  for split, key, title, unit in _CURVES:
    curves = {n: _curve(by_arm[n], split, key) for n in names}
    curves = {n: c for n, c in curves.items() if c is not None}
    if curves:
      panels.append((split, title, unit, curves))
  if not panels:
    return None
  fig, axes = _grid(len(panels), 2, (5.2, 3.3))
  for ax, (split, title, unit, curves) in zip(axes, panels):
    for i, name in enumerate(names):
      if name not in curves:
        continue
      steps, mean, lo, hi = curves[name]
      n = len(by_arm[name])
      c = f"C{i}"
      # The trainer's last evaluation covers the whole split; earlier ones a fixed subset.
      sub = slice(None, -1) if split == "eval" and len(steps) > 1 else slice(None)
      ax.plot(steps[sub], mean[sub], ".-", color=c, lw=1.5, ms=4,
              label=f"{name} ({n} seed{'s' if n > 1 else ''})")
      if n > 1:
        ax.fill_between(steps[sub], lo[sub], hi[sub], color=c, alpha=0.2, lw=0)
      if split == "eval":
        ax.plot(steps[-1:], mean[-1:], "D", color=c, ms=5)
        if n > 1:
          ax.plot([steps[-1]] * 2, [lo[-1], hi[-1]], "-", color=c, lw=1)
    ax.set_xlabel("training step", fontsize=8)
    _ticks(ax, integer_x=True)
    ax.set_ylabel(f"{title} ({unit})", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if split == "eval":
      ax.set_title(f"{title}: line = eval subset, diamond = whole split", fontsize=8)
  axes[0].legend(fontsize=7)
  if path:
    fig.savefig(path, dpi=DPI)
  return fig


def write_plots(summary: Mapping, results: Sequence[dict], plots_dir: str) -> dict:
  """metrics.png, differences.png and curves.png (each only when it has something to show)."""
  os.makedirs(plots_dir, exist_ok=True)
  out = {}
  for name, draw in (("metrics", lambda p: plot_metrics(summary, p)),
                     ("differences", lambda p: plot_differences(summary, p)),
                     ("curves", lambda p: plot_curves(summary, results, p))):
    path = os.path.join(plots_dir, f"{name}.png")
    if draw(path) is not None:
      out[f"{name}_png"] = path
    elif os.path.exists(path):
      os.remove(path)  # a stale plot of an earlier summary
  return out
