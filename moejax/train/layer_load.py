"""Per-layer, per-expert load of the logged window: host rows, dead experts, histograms.

Legend: L MoE layers, E FFN experts of a layer.

The train step returns, per MoE layer ``layer_<i>``, ``max_vio_batch/layer_<i>``
(MaxVio of that batch's load) and ``load/layer_<i>`` f32[E] (token copies the
router sent to each expert, before capacity; :func:`moejax.train.step.layer_loads`).
On the host:

- :func:`host_row` flattens a step's metrics into floats: a load vector
  becomes ``load/layer_<i>/<e>`` entries, so the loop's window (averaged per
  key, saved with a checkpoint between two logs) needs nothing new;
- :func:`summarise` turns a window's mean row into what is logged: the load
  entries leave the row (E x L numbers per row would swamp metrics.jsonl)
  and come back as f32[E] vectors for TensorBoard histograms, and
  ``dead_experts/layer_<i>`` counts the experts of the layer that got no token
  in any step of the window (their mean load is exactly 0: loads are counts,
  never negative), ``dead_experts`` sums them over layers.

``max_vio_batch/layer_<i>`` stays in the row as the window's mean of the
per-batch values, like the layer-averaged ``max_vio_batch`` (whose value is
their mean over the layers).
"""

from __future__ import annotations

import re
from typing import Mapping

import numpy as np

LOAD_PREFIX = "load/"
DEAD_PREFIX = "dead_experts/"
MAX_VIO_PREFIX = "max_vio_batch/"
_LOAD_KEY = re.compile(r"^load/(?P<layer>[^/]+)/(?P<expert>\d+)$")


def host_row(metrics: Mapping[str, np.ndarray]) -> dict[str, float]:
  """One step's metrics as floats; a 1-D entry ``k`` becomes ``k/0``, ``k/1``, ..."""
  row = {}
  for k, v in metrics.items():
    a = np.asarray(v)
    if a.ndim == 0:
      row[k] = float(a)
    elif a.ndim == 1:
      row.update((f"{k}/{e}", float(x)) for e, x in enumerate(a))
    else:
      raise ValueError(f"train metric {k!r} has shape {a.shape}; expected a scalar or [E]")
  return row


def _layer_order(name: str) -> list:
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def summarise(row: Mapping[str, float]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
  """(the row to log, ``{layer: f64[E] mean load}``) of a window's mean row (module doc)."""
  out, parts = {}, {}
  for k, v in row.items():
    m = _LOAD_KEY.match(k)
    if m is None:
      out[k] = v
    else:
      parts.setdefault(m["layer"], {})[int(m["expert"])] = v
  loads = {}
  for layer in sorted(parts, key=_layer_order):
    by_expert = parts[layer]
    loads[layer] = np.array([by_expert[e] for e in range(len(by_expert))], np.float64)
    out[f"{DEAD_PREFIX}{layer}"] = float(np.sum(loads[layer] == 0))
  if loads:
    out["dead_experts"] = float(sum(out[f"{DEAD_PREFIX}{n}"] for n in loads))
  return out, loads


def relative(load: np.ndarray) -> np.ndarray:
  """load / mean load (1 = balanced); the load itself when nothing was routed."""
  mean = float(np.mean(load)) if load.size else 0.0
  return load / mean if mean > 0 else load
