"""The plotted data of a suite's runs, small enough for its summary JSON: curves and load.

Legend: n seeds of an arm, L MoE layers, E_r routed columns (FFN experts plus
zero-computation experts).

- :func:`arm_curves`: per arm the training curves of :data:`CURVES` (rows of
  each run's ``metrics.jsonl``, moejax.train.metrics_log): at the steps every
  seed logged, the mean over seeds and the lowest and highest seed (the band;
  with n = 1 the three coincide), downsampled to at most :data:`MAX_POINTS`
  steps (evenly spaced, always the first and the last) so that
  ``results/ID.json`` stays small. The last point of an ``eval/`` curve is the
  trainer's final evaluation over the whole validation split (earlier points
  are its fixed ``train.eval_batches`` subset).
- :func:`arm_load`: the layer x expert load matrix f64[L, E_r] of the final
  whole-split evaluation (``routing.json``'s ``layers.<layer>.final_load``,
  written by moejax.ablation.runner), as load / mean load of the layer, so 1
  is perfect balance and the row maximum - 1 is the layer's MaxVio_global. It
  is one run's, the lowest seed's: expert numbers mean nothing across seeds
  (each seed initialises its own experts), so a mean over seeds would blur
  exactly what the heat map is for.

Values are rounded to 6 significant digits (far below any interval here).
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional, Sequence

import numpy as np

from moejax.train import metrics_log

# (split, key in metrics.jsonl): the curves kept per arm, keyed "split/key".
CURVES = (("train", "loss"), ("train", "max_vio_batch"), ("eval", "loss"),
          ("eval", "max_vio_global"))
MAX_POINTS = 60
# moejax.ablation.runner.ROUTING_FILE (runner imports the summary, so not imported back
# from here; tests/ablation/test_plots.py checks the two agree).
ROUTING_FILE = "routing.json"


def _round(v: float) -> float:
  return float(f"{v:.6g}")


def downsample(n: int, max_points: int = MAX_POINTS) -> np.ndarray:
  """Indices of at most ``max_points`` of ``n`` evenly spaced points, first and last kept."""
  if n <= max_points:
    return np.arange(n)
  return np.unique(np.round(np.linspace(0, n - 1, max_points)).astype(int))


def _series(run_path: str, split: str, key: str) -> dict[int, float]:
  rows = metrics_log.read_metrics(run_path, split)
  return {int(r["step"]): float(r[key]) for r in rows
          if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
          and np.isfinite(r[key])}


def arm_curves(runs: Sequence[dict], max_points: int = MAX_POINTS) -> dict:
  """``{"split/key": {"steps", "mean", "lo", "hi", "seeds"}}`` of one arm's runs (module doc).

  ``runs``: the arm's ``result.json`` dicts with their ``_path``
  (moejax.ablation.summary.find_results). A curve no seed logged, or whose
  seeds share no step, is left out.
  """
  out = {}
  paths = [r["_path"] for r in runs if r.get("_path")]
  for split, key in CURVES:
    series = [_series(p, split, key) for p in paths]
    series = [s for s in series if s]
    if not series:
      continue
    steps = sorted(set.intersection(*(set(s) for s in series)))
    if not steps:
      continue
    v = np.array([[s[t] for t in steps] for s in series], np.float64)   # [n, steps]
    keep = downsample(len(steps), max_points)
    pick = lambda a: [_round(x) for x in a[keep]]
    out[f"{split}/{key}"] = {"steps": [steps[i] for i in keep], "mean": pick(v.mean(0)),
                             "lo": pick(v.min(0)), "hi": pick(v.max(0)), "seeds": len(series)}
  return out


def _natural(name: str) -> list:
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def arm_load(runs: Sequence[dict]) -> Optional[dict]:
  """``{"seed", "layers", "relative"}``: the lowest seed's final load matrix (module doc).

  None when no run of the arm has one (a dense arm, a soft or PEER layer, a
  suite run without the per-run analysis).
  """
  for r in sorted(runs, key=lambda r: r.get("seed", 0)):
    path = os.path.join(r.get("_path", ""), ROUTING_FILE)
    if not r.get("_path") or not os.path.exists(path):
      continue
    with open(path, encoding="utf-8") as f:
      layers = json.load(f).get("layers", {})
    names = sorted((n for n, layer in layers.items() if layer.get("final_load")),
                   key=_natural)  # layer_2 before layer_10
    if not names:
      continue
    rows = []
    for n in names:
      load = np.asarray(layers[n]["final_load"], np.float64)
      mean = load.mean()
      rows.append([_round(x) for x in (load / mean if mean > 0 else load)])
    return {"seed": int(r.get("seed", 0)), "layers": names, "relative": rows}
  return None
