"""Suite summaries: per-arm table (markdown, CSV), plots (PNG), cross-directory comparison.

A row is one arm: the mean over its seeds (with the standard deviation in the
markdown when there are several). Metrics a run does not provide are ``n/a``
and the markdown lists the reason under the table.
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Iterable, Optional, Sequence

import numpy as np

from moejax.ablation.budget import spread
from moejax.topology.accounting import human
from moejax.train import metrics_log

# (key in result.json, column title)
BUDGET_COLUMNS = (("total", "total params"), ("active", "active/token"),
                  ("flops_per_token", "FLOPs/token"), ("tokens", "train tokens"))
METRIC_COLUMNS = (
    ("val_loss", "val loss"), ("train_loss", "train loss"),
    ("max_vio_batch", "MaxVio batch"), ("max_vio_global", "MaxVio global"),
    ("drop_rate", "drop rate"), ("specialisation_mi_norm", "spec. MI/H"),
    ("active_experts_mean", "active experts mean"), ("active_experts_var", "active experts var"),
    ("a2a_bytes_per_token", "a2a B/token"), ("exposed_comm", "exposed comm"),
    ("moe_latency_p50_ms", "MoE P50 ms"), ("moe_latency_p99_ms", "MoE P99 ms"),
    ("probe_teacher_forced_loss", "probe TF loss"), ("probe_prefix_loss", "probe prefix loss"),
    ("probe_leak_gap", "leak gap"))
NOTE_KEYS = (("a2a_bytes_per_token", "a2a_note"), ("exposed_comm", "exposed_comm_note"))
PLOT_METRICS = ("val_loss", "max_vio_batch", "max_vio_global", "drop_rate",
                "specialisation_mi_norm", "active_experts_mean", "active_experts_var",
                "a2a_bytes_per_token", "exposed_comm", "moe_latency_p99_ms", "probe_leak_gap")


def find_results(root: str) -> list[dict]:
  """Every ``result.json`` under ``root`` (a suite dir, an arm dir or a parent of several)."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("checkpoints", "tensorboard", "plots"))
    if "result.json" in filenames:
      with open(os.path.join(dirpath, "result.json"), encoding="utf-8") as f:
        res = json.load(f)
      res["_path"] = dirpath
      found.append(res)
  return found


def _num(v) -> Optional[float]:
  return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def aggregate(results: Sequence[dict], label=lambda r: r["arm"]) -> list[dict]:
  """One row per label (arm): mean and std over seeds of every numeric column."""
  groups: dict[str, list[dict]] = {}
  for r in results:
    groups.setdefault(label(r), []).append(r)
  rows = []
  for name, rs in groups.items():
    row = {"arm": name, "suite": rs[0].get("suite", ""), "seeds": len(rs),
           "optimizer": rs[0]["budget"]["optimizer"], "paths": [r["_path"] for r in rs]}
    for key, _ in BUDGET_COLUMNS:
      row[key] = rs[0]["budget"][key]
    for key, _ in METRIC_COLUMNS:
      vals = [_num(r.get(key)) for r in rs]
      vals = [v for v in vals if v is not None]
      row[key] = float(np.mean(vals)) if vals else None
      row[key + "_std"] = float(np.std(vals)) if len(vals) > 1 else None
    for key, note in NOTE_KEYS:
      row[note] = rs[0].get(note)
    rows.append(row)
  return rows


def _fmt(v, key: str = "") -> str:
  if v is None:
    return "n/a"
  if key in ("total", "active", "flops_per_token", "tokens", "a2a_bytes_per_token"):
    return human(v)
  return f"{v:.4g}" if abs(v) < 1e4 else human(v)


def markdown(rows: Sequence[dict], title: str = "") -> str:
  cols = [("arm", "arm"), ("seeds", "seeds")] + list(BUDGET_COLUMNS) + list(METRIC_COLUMNS)
  cols = [c for c in cols if c[0] in ("arm", "seeds") or any(r.get(c[0]) is not None for r in rows)
          or c[0] in ("a2a_bytes_per_token", "exposed_comm", "moe_latency_p99_ms")]
  lines = [f"# {title}", ""] if title else []
  lines.append("| " + " | ".join(t for _, t in cols) + " |")
  lines.append("|" + "|".join("---" for _ in cols) + "|")
  for r in rows:
    cells = []
    for key, _ in cols:
      v = r.get(key)
      if key in ("arm",):
        cells.append(str(v))
      elif key == "seeds":
        cells.append(str(v))
      else:
        s = _fmt(v, key)
        if r.get(key + "_std") is not None:
          s += f" ± {r[key + '_std']:.2g}"
        cells.append(s)
    lines.append("| " + " | ".join(cells) + " |")
  notes = []
  for key, note in NOTE_KEYS:
    by_text: dict[str, list[str]] = {}
    for r in rows:
      if r.get(note):
        by_text.setdefault(r[note], []).append(r["arm"])
    notes += [f"- {key} ({', '.join(arms)}): {text}" for text, arms in by_text.items()]
  if rows:
    lines += ["", f"Optimizer: {rows[0]['optimizer']}"]
  if notes:
    lines += ["", "Notes:"] + notes
  return "\n".join(lines) + "\n"


def write_csv(rows: Sequence[dict], path: str) -> None:
  keys = (["arm", "suite", "seeds"] + [k for k, _ in BUDGET_COLUMNS] +
          [k for k, _ in METRIC_COLUMNS] + [k + "_std" for k, _ in METRIC_COLUMNS] +
          ["optimizer", "a2a_note", "exposed_comm_note"])
  with open(path, "w", newline="", encoding="utf-8") as f:
    w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in keys})


def read_csv(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    rows = list(csv.DictReader(f))
  for r in rows:
    for k, v in r.items():
      if k not in ("arm", "suite", "optimizer", "a2a_note", "exposed_comm_note"):
        r[k] = float(v) if v not in ("", None) else None
  return rows


def plot_metrics(rows: Sequence[dict], path: str, metrics: Iterable[str] = PLOT_METRICS) -> str:
  """One bar chart per metric (n/a metrics are drawn as an empty panel saying so)."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  metrics = list(metrics)
  titles = dict(METRIC_COLUMNS)
  ncol = 4
  nrow = math.ceil(len(metrics) / ncol)
  # Figure, not pyplot: no global backend switch (a notebook keeps its inline backend).
  fig = Figure(figsize=(4 * ncol, 3.2 * nrow))
  axes = fig.subplots(nrow, ncol, squeeze=False)
  names = [r["arm"] for r in rows]
  for ax, key in zip(axes.flat, metrics):
    vals = [r.get(key) for r in rows]
    ax.set_title(titles.get(key, key), fontsize=10)
    if all(v is None for v in vals):
      if key == "probe_leak_gap":
        ax.axis("off")  # only the expert-choice suite runs the probe
        continue
      ax.text(0.5, 0.5, "n/a (see summary.md notes)", ha="center", va="center",
              transform=ax.transAxes)
      ax.set_xticks([])
      ax.set_yticks([])
      continue
    err = [r.get(key + "_std") or 0.0 for r in rows]
    ax.bar(range(len(names)), [v if v is not None else 0.0 for v in vals], yerr=err,
           color=[f"C{i}" for i in range(len(names))])
    got = [v for v in vals if v is not None]
    if key in ("val_loss", "train_loss") and min(got) > 0:
      # Losses differ in the second decimal: a zero baseline would hide it.
      span = max(max(got) - min(got), 1e-3)
      ax.set_ylim(min(got) - 2 * span, max(got) + span)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
  for ax in list(axes.flat)[len(metrics):]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  return path


def plot_curves(results: Sequence[dict], path: str) -> str:
  """Validation loss and MaxVio_batch over training steps, one line per run."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(15, 3.6))
  axes = fig.subplots(1, 3)
  arms = sorted({r["arm"] for r in results})
  for r in results:
    c = f"C{arms.index(r['arm'])}"
    label = r["arm"] + (f" s{r['seed']}" if r.get("seed") else "")
    ev = metrics_log.read_metrics(r["_path"], "eval")
    tr = metrics_log.read_metrics(r["_path"], "train")
    axes[0].plot([e["step"] for e in ev], [e["loss"] for e in ev], "o-", color=c, label=label)
    axes[1].plot([t["step"] for t in tr], [t["loss"] for t in tr], color=c, label=label)
    if tr and "max_vio_batch" in tr[0]:
      axes[2].plot([t["step"] for t in tr], [t["max_vio_batch"] for t in tr], color=c,
                   label=label)
  for ax, t in zip(axes, ("validation loss", "training loss", "MaxVio batch")):
    ax.set_title(t)
    ax.set_xlabel("step")
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  return path


def write_summary(workdir: str, suite_name: str = "") -> dict:
  """summary.md, summary.csv and plots/{metrics,curves}.png for the results under workdir."""
  results = find_results(workdir)
  rows = aggregate(results)
  order_path = os.path.join(workdir, "suite.json")
  if os.path.exists(order_path):  # the suite's own arm order, not the directory order
    with open(order_path, encoding="utf-8") as f:
      order = list(json.load(f).get("arm_order", []))
    if order:  # runs left over from arms the suite file no longer has are not summarised
      results = [r for r in results if r["arm"] in order]
      rows = [r for r in rows if r["arm"] in order]
    rows.sort(key=lambda r: order.index(r["arm"]) if r["arm"] in order else len(order))
  with open(os.path.join(workdir, "summary.md"), "w", encoding="utf-8") as f:
    f.write(markdown(rows, f"suite {suite_name}" if suite_name else ""))
  write_csv(rows, os.path.join(workdir, "summary.csv"))
  plots = os.path.join(workdir, "plots")
  os.makedirs(plots, exist_ok=True)
  out = {"rows": rows}
  if rows:
    out["metrics_png"] = plot_metrics(rows, os.path.join(plots, "metrics.png"))
    out["curves_png"] = plot_curves(results, os.path.join(plots, "curves.png"))
  return out


def budget_mismatches(rows: Sequence[dict], tolerance: float = 0.02) -> list[str]:
  """Lines naming every budget quantity on which the rows differ (beyond ``tolerance``)."""
  out = []
  if len(rows) < 2:
    return out
  for key, title in BUDGET_COLUMNS:
    vals = {r["arm"]: float(r[key]) for r in rows if r.get(key) is not None}
    if len(vals) > 1 and spread(list(vals.values())) > tolerance:
      lo, hi = min(vals, key=vals.get), max(vals, key=vals.get)
      out.append(f"{title} differs by {100 * spread(list(vals.values())):.1f}% "
                 f"({lo} {human(vals[lo])} .. {hi} {human(vals[hi])})")
  opts = {r["optimizer"] for r in rows}
  if len(opts) > 1:
    out.append("optimizer settings differ: " + " | ".join(sorted(opts)))
  return out
